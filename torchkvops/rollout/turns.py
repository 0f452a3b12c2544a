"""Multi-turn rollouts (`Rollout.extend`): what a call leaves for the next one, and the inputs of a turn.

An agent's rollout goes on after a tool call: the tool's answer is appended to each row and the model
decodes again. Every row's KV stays in the rollout's KV buffers after a call (compaction keeps the rows
that leave at home, `RolloutKVCache.compact`), and `History` records what is where: each row's tokens
after its prompt (generated and appended), its `frontier` (the first decode-buffer column after its
history's KV: each row's history is contiguous in its own row of the buffer), and the position of its
last token. The last token of a row's history has no KV yet (a decode step feeds the token it sampled
only at the next step), so a turn computes it again together with the appended tokens: its `chunk` is
[last token] + appended. The chunks are packed, without padding, into one sequence (`Turn`): one forward
over their tokens alone, each token's K and V written at its row's own columns from its frontier on, each
token attending to its row's history and the chunk before it (`attention.PackedAttention`, read by the
rollout's attention). Decode then goes on in every row from the column after its chunk, at its own position.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from ..utils import check_has_values
from .attention import PackedAttention, packed_attention
from .packing import Packed, pack
from .prompts import Prompts

_SEED_STEP = 0x9E3779B97F4A7C15  # each turn's sampling seed: the first call's plus this times the turn
_SEED_MASK = 2**63 - 1


@dataclasses.dataclass
class History:
    """What the last call of a Rollout left for `extend` (module docstring)."""

    output: object  # the RolloutOutput it returned: extend takes only that one
    prompts: Tensor  # [rows, P] each row's prompt, left-padded as given
    prompt_info: Prompts  # where the prompts' KV is (a common prefix computed once, its columns)
    tokens: list[Tensor]  # per row: its history after the prompt (int64)
    generated: list[Tensor]  # per row: 1 where the model generated the token, 0 where it was appended
    logprobs: list[Tensor] | None  # per row: each token's log-probability (0 on appended tokens)
    own_kv_start: Tensor  # [rows] the decode buffer's first column of each row's own KV (after its prompt's)
    prompt_columns: Tensor | None  # [rows, W] bool: the columns before it that hold the row's prompt
    frontier: Tensor  # [rows] int64: the first decode-buffer column after each row's history's KV
    last_position: Tensor  # [rows] int64: the position of each row's last token (which has no KV)
    seed: int
    row_ids: Tensor
    turns: int = 1

    @property
    def rows(self) -> int:
        return self.frontier.numel()

    @property
    def prompt_mask(self) -> Tensor:
        """[prompts, P] 0/1: each prompt's mask, as given."""
        return self.prompt_info.mask

    def last_tokens(self) -> Tensor:
        return torch.stack([t[-1] for t in self.tokens])

    def turn_seed(self) -> int:
        return (self.seed + self.turns * _SEED_STEP) & _SEED_MASK

    def visible(self, columns: int, frontier: Tensor | None = None) -> Tensor:
        """[rows, columns] bool: the decode-buffer columns that hold a history token's KV (up to `frontier`,
        default the history's): the prompt's tokens first, then every column from the
        prompt's end up to the frontier."""
        frontier = self.frontier if frontier is None else frontier
        index = torch.arange(columns, device=frontier.device)
        visible = (index >= self.own_kv_start[:, None]) & (index < frontier[:, None])
        if self.prompt_columns is not None:
            width = min(columns, self.prompt_columns.shape[1])
            visible[:, :width] |= self.prompt_columns[:, :width]
        return visible


def first_history(output, prompts: Prompts, samples: int, layout, seed: int, row_ids: Tensor) -> History:
    """The history after `generate`: each row's response through its first EOS. Its KV sits in the
    decode buffer from the layout's first column of the row on (after its prompt's, whose columns hold the
    prompt)."""
    lengths = output.response_mask.sum(dim=1)
    counts = lengths.tolist()
    tokens = [output.responses[r, :n].clone() for r, n in enumerate(counts)]
    generated = [output.response_mask[r, :n].clone() for r, n in enumerate(counts)]
    logprobs = None if output.logprobs is None else [output.logprobs[r, :n].clone() for r, n in enumerate(counts)]
    own_kv_start = prompts.ends.repeat_interleave(samples)  # (after each prompt's KV)
    prompt_columns = layout.decode_visible(prompts.columns.repeat_interleave(samples, dim=0))
    last_position = prompts.lengths.repeat_interleave(samples) + lengths - 1
    return History(
        output,
        output.sequences[:, : output.prompt_length].clone(),
        prompts,
        tokens,
        generated,
        logprobs,
        own_kv_start,
        prompt_columns if prompt_columns.shape[1] else None,
        own_kv_start + lengths - 1,
        last_position,
        seed,
        row_ids,
    )


@dataclasses.dataclass
class Turn(Packed):
    """One extend call's inputs: each live row's chunk ([last token] + appended), packed in row order
    without padding (`packing.Packed`), and what was appended to each row (None: a row that does not go on)."""

    appended: list[Tensor | None] = dataclasses.field(default_factory=list)


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
            check_has_values(a, f"appended[{r}]", where)
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


def make_turn(history: History, appended: list[Tensor | None]) -> Turn:
    last = history.last_tokens()
    chunks = [None if a is None else torch.cat([last[r : r + 1], a]) for r, a in enumerate(appended)]
    packed = pack(chunks, history.frontier, history.last_position)
    return Turn(**vars(packed), appended=appended)


def turn_attention(history: History, turn: Turn) -> PackedAttention:
    """What the turn's packed forward attends to: each live row's chunk token j sees its row's history
    (`History.visible`) and its chunk's tokens up to j."""
    keys = int((history.frontier + turn.lengths).max())  # host sync: the columns read, once per turn
    return packed_attention(turn, history.frontier, history.visible(keys))


def record(history: History, turn: Turn, output) -> None:
    """Append this turn to each live row's history: its appended tokens, then what it generated (through
    its first EOS), whose KV sits in the decode buffer after the chunk."""
    live = turn.live
    lengths = torch.where(live, output.response_mask.sum(dim=1), 0)
    history.frontier = torch.where(live, history.frontier + turn.lengths + lengths - 1, history.frontier)
    history.last_position = torch.where(live, history.last_position + turn.lengths + lengths - 1, history.last_position)
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


def history_output(history: History, pad_id: int, output_type):
    """The RolloutOutput over the whole history after the prompt, each row right-padded with pad_id."""
    responses = pad_sequence(history.tokens, batch_first=True, padding_value=pad_id)
    mask = pad_sequence(history.generated, batch_first=True, padding_value=0)
    logprobs = None if history.logprobs is None else pad_sequence(history.logprobs, batch_first=True, padding_value=0.0)
    sequences = torch.cat([history.prompts, responses], dim=1)
    return output_type(sequences, responses, mask, history.prompts.shape[1], logprobs)
