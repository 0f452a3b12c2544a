"""Several rows' chunks of tokens packed, in row order and without padding, into one sequence: the input of
a packed forward (a turn's appended tokens, `turns`; the prompts after a prefix common to all of them,
`prompts`). Each token knows its row, the column of its row's buffer its K and V go to (its row's chunk
starts at the row's `frontier`) and its position; the forward's attention is `attention.PackedAttention`."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

__all__ = ["Packed", "pack"]


@dataclasses.dataclass
class Packed:
    """Rows' chunks packed in row order (module docstring)."""

    live: Tensor  # [rows] bool: rows with a chunk
    lengths: Tensor  # [rows] each row's chunk length (0: none)
    ids: Tensor  # [T] the chunks' tokens
    row: Tensor  # [T] each token's row
    column: Tensor  # [T] the buffer column its K and V go to
    positions: Tensor  # [T] each token's position
    last: Tensor  # [live rows] the index in the packed tokens of each live row's last token

    @property
    def tokens(self) -> int:
        return self.ids.numel()


def pack(chunks: list[Tensor | None], frontier: Tensor, first_position: Tensor) -> Packed:
    """`chunks[r]` (1-D int64, or None for a row without one) packed: row r's chunk goes to its buffer's
    columns from `frontier[r]` on, at positions from `first_position[r]` on ([rows] each)."""
    device = frontier.device
    live = torch.tensor([c is not None and c.numel() > 0 for c in chunks], device=device)
    lengths = torch.tensor([0 if c is None else c.numel() for c in chunks], device=device)
    ids = torch.cat([c for c in chunks if c is not None and c.numel()])
    row = torch.repeat_interleave(torch.arange(len(chunks), device=device), lengths)
    ends = torch.cumsum(lengths, 0)
    offset = torch.arange(ids.numel(), device=device) - (ends - lengths)[row]  # 0 at each chunk's first token
    return Packed(live, lengths, ids, row, frontier[row] + offset, first_position[row] + offset, ends[live] - 1)
