"""A call's prompts as the rollout holds their KV: as given (left-padded, one forward over every prompt),
or after a prefix that every prompt begins with, computed once (a system prompt: tool schemas,
instructions, few-shot examples in front of every question).

The common prefix is found on each prompt's real tokens, wherever left padding puts them: the longest run
that every prompt begins with, leaving each prompt at least one token of its own (whose logits start its
samples), and taken when it is at least `min_shared_tokens` long. It is computed once (one row of its
tokens), then each prompt's remainder, packed without padding (`packing`), attends to it and to itself.
Each prompt's row holds it, its remainder right after it (no padding between: each row's columns are its
own, `Prompts.columns`); in the pool its whole blocks are held once, named by every prompt's table.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

__all__ = ["Prompts", "common_prefix_length", "plain_prompts", "common_prompts"]


@dataclasses.dataclass
class Prompts:
    """Where a call's B prompts' KV is (module docstring)."""

    ids: Tensor  # [B, P] as given, left-padded
    mask: Tensor  # [B, P] 0/1
    common: int  # the tokens of the prefix every prompt begins with, computed once (0: none)
    columns: Tensor  # [B, W] bool: the prompt KV columns that hold each prompt's tokens (after the common prefix's)
    ends: Tensor  # [B] the first column after each prompt's KV (where its rows decode first)

    @property
    def width(self) -> int:
        """The prompt KV's columns: P as given, the longest remainder's end after a common prefix."""
        return self.columns.shape[1]

    @property
    def lengths(self) -> Tensor:
        """[B] each prompt's real tokens: the position of its first generated token."""
        return self.mask.sum(dim=1)

    def remainders(self) -> list[Tensor]:
        """Each prompt's tokens after the common prefix (at least one each)."""
        lengths = self.lengths.tolist()  # host sync: once per call
        width = self.ids.shape[1]
        return [self.ids[b, width - n + self.common :] for b, n in enumerate(lengths)]


def common_prefix_length(input_ids: Tensor, attention_mask: Tensor, min_tokens: int | None) -> int:
    """The prefix of real tokens every prompt of [B, P] left-padded `input_ids` begins with, leaving each at
    least one token of its own: its length when it is at least `min_tokens` (and B >= 2), else 0."""
    batch, width = input_ids.shape
    if min_tokens is None or batch < 2:
        return 0
    lengths = attention_mask.sum(dim=1)
    shortest = int(lengths.min())  # host sync: once per call
    if shortest - 1 < min_tokens:
        return 0
    columns = (width - lengths)[:, None] + torch.arange(shortest - 1, device=input_ids.device)[None, :]
    aligned = input_ids.gather(1, columns)  # each prompt's first tokens, left-aligned
    agree = (aligned == aligned[:1]).all(dim=0).long()
    common = int(agree.cumprod(dim=0).sum())  # host sync: once per call
    return common if common >= min_tokens else 0


def plain_prompts(input_ids: Tensor, attention_mask: Tensor) -> Prompts:
    """The prompts as given: each one's KV in columns [0, P), its padding hidden."""
    width = input_ids.shape[1]
    ends = torch.full((input_ids.shape[0],), width, dtype=torch.long, device=input_ids.device)
    return Prompts(input_ids, attention_mask, 0, attention_mask.bool(), ends)


def common_prompts(input_ids: Tensor, attention_mask: Tensor, common: int) -> Prompts:
    """The prompts after a common prefix of `common` tokens: each remainder's KV from column `common` on
    (the prompt's rows hold the common prefix's KV before it), without padding."""
    ends = attention_mask.sum(dim=1)
    columns = torch.arange(int(ends.max()), device=input_ids.device)[None, :] < ends[:, None]
    return Prompts(input_ids, attention_mask, common, columns, ends)
