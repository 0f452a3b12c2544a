"""Multi-turn rollouts (`Rollout.extend`): what a call leaves for the next one, and the inputs of a turn.

An agent's rollout goes on after a tool call: the tool's answer is appended to each row and the model
decodes again. Every row's KV stays in the rollout's KV buffers after a call (compaction keeps the rows
that leave at home, `RolloutKVCache.compact`), and `History` records what is where: each row's tokens
after its prompt (generated and appended), which decode-buffer columns hold their KV, and the position
of its last token. The last token of a row's history has no KV yet (a decode step feeds the token it
sampled only at the next step), so a turn computes it again together with the appended tokens: its
`chunk` is [last token] + appended, one forward for every row over the chunks, left-padded to the longest
and written to the decode buffer from the first column no call has written (`frontier`). Decode then
goes on from there, every row at the same column with its own position ids, the columns a row has not
written (holes) hidden by its attention bias as left padding is.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

_SEED_STEP = 0x9E3779B97F4A7C15  # each turn's sampling seed: the first call's plus this times the turn
_SEED_MASK = 2**63 - 1


@dataclasses.dataclass
class History:
    """What the last call of a Rollout left for `extend` (module docstring)."""

    output: object  # the RolloutOutput it returned: extend takes only that one
    prompts: Tensor  # [rows, P] each row's prompt, left-padded as given
    prompt_mask: Tensor  # [prompts, P] 0/1
    tokens: list[Tensor]  # per row: its history after the prompt (int64)
    generated: list[Tensor]  # per row: 1 where the model generated the token, 0 where it was appended
    logprobs: list[Tensor] | None  # per row: each token's log-probability (0 on appended tokens)
    visible: Tensor  # [rows, frontier] bool: decode-buffer columns that hold a history token's KV
    last_position: Tensor  # [rows] int64: the position of each row's last token (which has no KV)
    seed: int
    row_ids: Tensor
    turns: int = 1

    @property
    def frontier(self) -> int:
        return self.visible.shape[1]

    def last_tokens(self) -> Tensor:
        return torch.stack([t[-1] for t in self.tokens])

    def turn_seed(self) -> int:
        return (self.seed + self.turns * _SEED_STEP) & _SEED_MASK


def first_history(output, prompt_mask: Tensor, samples: int, first_column: int, seed: int, row_ids: Tensor) -> History:
    """The history after `generate`: each row's response through its first EOS. Its KV sits in the
    decode buffer from `first_column` on (the copy layout: after the prompt, whose columns are visible
    where the prompt has a token; the prefix layout: from column 0, the prompt's KV shared by its group)."""
    row_mask = prompt_mask.repeat_interleave(samples, dim=0).bool()
    lengths = output.response_mask.sum(dim=1)
    response_len = output.responses.shape[1]
    frontier = first_column + response_len - 1
    columns = torch.arange(frontier, device=row_mask.device)
    visible = (columns >= first_column) & (columns < first_column + lengths[:, None] - 1)
    if first_column:
        visible[:, :first_column] = row_mask
    counts = lengths.tolist()
    tokens = [output.responses[r, :n].clone() for r, n in enumerate(counts)]
    generated = [output.response_mask[r, :n].clone() for r, n in enumerate(counts)]
    logprobs = None if output.logprobs is None else [output.logprobs[r, :n].clone() for r, n in enumerate(counts)]
    last_position = row_mask.sum(dim=1) + lengths - 1
    prompts = output.sequences[:, : output.prompt_length].clone()
    return History(output, prompts, prompt_mask, tokens, generated, logprobs, visible, last_position, seed, row_ids)


@dataclasses.dataclass
class Turn:
    """One extend call's inputs: each live row's chunk ([last token] + appended), left-padded."""

    live: Tensor  # [rows] bool: rows that go on
    appended: list[Tensor | None]  # per row, on the device
    ids: Tensor  # [rows, C] the chunks, left-padded with pad_id (a dead row: all padding)
    real: Tensor  # [rows, C] bool: where a chunk has a token
    positions: Tensor  # [rows, C] each chunk token's position (padding: the row's last position)

    @property
    def width(self) -> int:
        return self.ids.shape[1]


def check_appended(appended, rows: int, vocab: int | None, device: torch.device) -> list[Tensor | None]:
    """`appended` as one int64 tensor (or None) per row, each problem named."""
    where = "Rollout.extend"
    if isinstance(appended, Tensor) or not hasattr(appended, "__len__"):
        raise TypeError(
            f"{where}: appended must be a list with one entry per row (a list or 1-D tensor of token ids, or "
            f"None), got {type(appended).__name__}"
        )
    if len(appended) != rows:
        raise ValueError(f"{where}: appended has {len(appended)} entries, but the rollout has {rows} rows")
    out: list[Tensor | None] = []
    for r, a in enumerate(appended):
        if a is None:
            out.append(None)
            continue
        if isinstance(a, Tensor):
            if a.dim() != 1 or a.dtype.is_floating_point or a.dtype.is_complex or a.dtype == torch.bool:
                raise ValueError(
                    f"{where}: appended[{r}] must be a 1-D tensor of integer token ids, got {a.dtype} of shape "
                    f"{tuple(a.shape)}"
                )
            ids = a.to(device, torch.long)
        else:
            values = list(a)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise TypeError(f"{where}: appended[{r}] must hold int token ids, got {values[:8]!r}")
            ids = torch.tensor(values, dtype=torch.long, device=device)
        out.append(ids)
    given = [(r, a) for r, a in enumerate(out) if a is not None and a.numel()]
    if given:  # one host sync for every row's range
        ids = torch.cat([a for _, a in given])
        outside = (ids < 0) | (ids >= vocab) if vocab is not None else ids < 0
        if bool(outside.any()):
            offset = int(outside.int().argmax())  # the first id outside, in the rows' order
            for r, a in given:
                if offset < a.numel():
                    raise ValueError(
                        f"{where}: appended[{r}] must hold token ids in [0, {vocab}) (the model's vocabulary)"
                    )
                offset -= a.numel()
    return out


def left_pad(rows: list[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """1-D token id tensors (on one device) as one left-padded batch: (ids [rows, longest] with pad_id
    before each row, where [rows, longest] bool: True on the rows' tokens)."""
    ids = pad_sequence([r.flip(0) for r in rows], batch_first=True, padding_value=-1).flip(1)
    real = ids >= 0
    return ids.clamp(min=0).masked_fill(~real, pad_id), real


def make_turn(history: History, appended: list[Tensor | None], pad_id: int) -> Turn:
    device = history.last_position.device
    live = torch.tensor([a is not None for a in appended], device=device)
    last = history.last_tokens()
    chunks = [torch.cat([last[r : r + 1], a]) if a is not None else last.new_zeros(0) for r, a in enumerate(appended)]
    # Left-padded: every chunk's last token is in the last column, whose logits are the first sample's.
    ids, real = left_pad(chunks, pad_id)
    width = ids.shape[1]
    lengths = real.sum(dim=1)
    offsets = torch.arange(width, device=device) - (width - lengths[:, None])  # 0 at each chunk's first token
    positions = torch.where(real, history.last_position[:, None] + offsets, history.last_position[:, None])
    return Turn(live, appended, ids, real, positions)


def extend_mask(history: History, turn: Turn, prompt_visible: Tensor | None) -> Tensor:
    """[rows, C, keys] bool: which keys each chunk position attends to. Keys are (prefix layout: the row's
    prompt, then) the decode buffer's columns up to the frontier, then the chunks. A padding query (and
    every query of a dead row) sees itself only, so that no softmax row is empty."""
    width = turn.width
    query = turn.real[:, :, None]
    causal = torch.ones(width, width, dtype=torch.bool, device=query.device).tril()
    chunk = (causal[None] & turn.real[:, None, :] & query) | torch.eye(width, dtype=torch.bool, device=query.device)
    parts = [history.visible[:, None, :] & query, chunk]
    if prompt_visible is not None:
        parts.insert(0, prompt_visible[:, None, :] & query)
    return torch.cat(parts, dim=2)


def record(history: History, turn: Turn, output, first_column: int) -> None:
    """Append this turn to each live row's history: its appended tokens, then what it generated (through
    its first EOS), whose KV sits in the decode buffer from `first_column` on."""
    live = turn.live
    lengths = torch.where(live, output.response_mask.sum(dim=1), 0)
    response_len = output.responses.shape[1]
    chunk_visible = turn.real & live[:, None]
    columns = torch.arange(response_len - 1, device=live.device)
    decoded_visible = columns[None] < (lengths[:, None] - 1)
    history.visible = torch.cat([history.visible, chunk_visible, decoded_visible], dim=1)
    history.last_position = torch.where(
        live, history.last_position + turn.real.sum(dim=1) + lengths - 1, history.last_position
    )
    for r, n in enumerate(lengths.tolist()):
        if turn.appended[r] is None:
            continue
        a = turn.appended[r]
        history.tokens[r] = torch.cat([history.tokens[r], a, output.responses[r, :n]])
        history.generated[r] = torch.cat([history.generated[r], torch.zeros_like(a), output.response_mask[r, :n]])
        if history.logprobs is not None:
            zeros = torch.zeros(a.numel(), dtype=torch.float32, device=a.device)
            history.logprobs[r] = torch.cat([history.logprobs[r], zeros, output.logprobs[r, :n]])
    history.turns += 1
    assert history.frontier == first_column + response_len - 1


def history_output(history: History, pad_id: int, output_type):
    """The RolloutOutput over the whole history after the prompt, each row right-padded with pad_id."""
    responses = pad_sequence(history.tokens, batch_first=True, padding_value=pad_id)
    mask = pad_sequence(history.generated, batch_first=True, padding_value=0)
    logprobs = None if history.logprobs is None else pad_sequence(history.logprobs, batch_first=True, padding_value=0.0)
    sequences = torch.cat([history.prompts, responses], dim=1)
    return output_type(sequences, responses, mask, history.prompts.shape[1], logprobs)
