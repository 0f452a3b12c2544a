"""The decode state: statically shaped tensors a decode step reads and updates in place, one set per
`DecodeShape`, kept across calls so that a shape that comes back finds the addresses its graph was
captured on.

Per-row state is declared once (`DecodeState.FIELDS`): what each tensor holds, its shape, and how it
moves when the batch is compacted, so that a new field cannot be forgotten by the code that moves rows
(`torchkvops.rollout.batch.DecodeBatch`, the only code that changes a state's rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["DecodeShape", "DecodeState"]


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """What fixes a decode step's tensors (and so its graph): rows, the decode buffer's key length, the
    response length, the model's dtype; with the prompts read stacked, the prompts and the columns of their
    whole blocks, and for a compacted batch its query slots per prompt (torchkvops.rollout.compaction);
    whether log-probabilities are recorded."""

    rows: int
    key_columns: int
    max_new_tokens: int
    dtype: torch.dtype
    prompts: int = 0
    prompt_len: int = 0
    logprobs: bool = False
    slots: int = 0
    kv_block: int = 0  # the KV pool's block size (0: a dense buffer's state, DenseLayout's: no pool)
    # Prompts read stacked after a prefix common to every prompt: the columns of its whole blocks, read once a
    # step for every row's queries (the prompts' own part then starts there; 0: none).
    common_len: int = 0
    # Prompts read stacked whose whole blocks lie where `PagedStore.place_prompts` puts them: the read views
    # the pool in place (`paged_kv.block_runs`) instead of gathering them by their tables each step.
    prompts_in_place: bool = False


@dataclasses.dataclass(frozen=True)
class _Field:
    """One tensor of a DecodeState. `per`: what its first dim indexes, and so how compaction moves it:
    "row" (gathered with its row), "prompt" (gathered with its prompt group), "slot" (set from the
    compaction's plan), "shared" (read by every row: copied whole), "fixed" (set when the state is made,
    from its shape alone, and never moved: `fill` makes it)."""

    name: str
    per: str
    dims: Callable[[DecodeShape], tuple[int, ...] | None]  # its shape, or None when the shape has none
    dtype: torch.dtype | None = torch.long  # None: the model's dtype
    doc: str = ""
    fill: Callable[[Tensor], None] | None = None  # a "fixed" field's values, written into its zeros


def _if(condition: bool, dims: tuple[int, ...]) -> tuple[int, ...] | None:
    return dims if condition else None


def _stacked(s: DecodeShape) -> bool:
    """Whether a paged-layout shape reads its prompts' shared blocks stacked (prompt_len: their columns)."""
    return s.prompts > 0 and s.kv_block > 0 and s.prompt_len > 0


class DecodeState:
    """Statically shaped tensors that the decode step reads and updates in place, one set per DecodeShape."""

    FIELDS = (
        _Field("tokens", "row", lambda s: (s.rows, 1), doc="the token fed next"),
        _Field("position_ids", "row", lambda s: (s.rows, 1)),
        _Field(
            "column",
            "row",
            lambda s: (s.rows,),
            doc="the decode buffer's column the row writes next: each row its own (rows of one batch start "
            "at other columns after a packed turn, or when a streaming batch admits them)",
        ),
        _Field(
            "bias",
            "row",
            lambda s: (s.rows, 1, 1, s.key_columns),
            None,
            "additive bias over the decode buffer's keys: 0 where a row may attend, -inf elsewhere",
        ),
        _Field(
            "kv_start",
            "row",
            lambda s: (s.rows,),
            torch.int32,
            "the decode buffer's first column the row reads (after a left-padded prompt's padding): what it "
            "sees is the columns from there up to the one it writes, none skipped (DecodeBatch.admit checks)",
        ),
        _Field(
            "kv_length",
            "row",
            lambda s: (s.rows,),
            torch.int32,
            "the decode buffer's columns the row reads this step: up to and including the one it writes "
            "(column + 1, set by the step)",
        ),
        _Field(
            "kv_blocks",
            "row",
            lambda s: _if(s.kv_block > 0, (s.rows, s.key_columns // max(s.kv_block, 1))),
            torch.int32,
            "paged layout: each row's block table in the KV pool, a block per kv_block columns (block 0, a "
            "scratch block no row holds, where it has none yet: an ended row's filler writes land there)",
        ),
        _Field(
            "kv_slot",
            "row",
            lambda s: _if(s.kv_block > 0, (s.rows,)),
            doc="paged layout: the pool slot the row writes this step (its table's block for `column`, set by the step)",
        ),
        _Field("finished", "row", lambda s: (s.rows,), torch.bool),
        _Field("sample_keys", "row", lambda s: (s.rows,), doc="per-row sampling keys"),
        _Field(
            "nonfinite_step",
            "row",
            lambda s: (s.rows,),
            doc="the first step at which a live row's logits could not be sampled from (NaN, +inf, or all "
            "-inf: HF's sampling raises there); -1 while none",
        ),
        # One spare column: where a row that has its max_new_tokens tokens writes (the pad id) while others
        # go on (rows that joined a streaming batch later, torchkvops.rollout.streaming).
        _Field("responses", "row", lambda s: (s.rows, s.max_new_tokens + 1)),
        _Field(
            "logprobs",
            "row",
            lambda s: _if(s.logprobs, (s.rows, s.max_new_tokens + 1)),
            torch.float32,
            "each sampled token's log-probability (0 once the row has ended), as responses",
        ),
        _Field(
            "prompt_bias",
            "prompt",
            lambda s: _if(s.prompts > 0 and s.prompt_len > 0, (s.prompts, 1, 1, s.prompt_len)),
            None,
            "prompts read stacked: the bias over each prompt's whole blocks",
        ),
        # The pool with its prompts read stacked (`PagedLayout.stacked_tokens`): each prompt's whole
        # blocks, which every row of it names in its table (shared by reference), are read once a step for
        # its rows' stacked queries, as prompt_bias shows them (prompt_len: the columns they hold, a
        # multiple of kv_block); each row reads its own keys from own_start on; the two parts are merged by
        # their log-sum-exps.
        _Field(
            "prompt_table",
            "prompt",
            lambda s: _if(_stacked(s), (s.prompts, s.prompt_len // max(s.kv_block, 1))),
            torch.int32,
            "paged layout, prompts read stacked: each prompt's shared blocks, as its rows' tables name them",
        ),
        _Field(
            "own_start",
            "row",
            lambda s: _if(_stacked(s), (s.rows,)),
            torch.int32,
            "paged layout, prompts read stacked: the first column a row reads as its own (after its prompt's "
            "shared blocks, or its kv_start if later)",
        ),
        _Field(
            "common_table",
            "shared",
            lambda s: _if(s.common_len > 0 and s.kv_block > 0, (1, s.common_len // max(s.kv_block, 1))),
            torch.int32,
            "prompts read stacked after a common prefix: its whole blocks, which every prompt's table names",
        ),
        _Field(
            "common_bias",
            "fixed",
            lambda s: _if(s.common_len > 0, (1, 1, 1, s.common_len)),
            None,
            "prompts read stacked after a common prefix: the bias over its whole blocks (every key seen: zeros)",
        ),
        # A compacted batch whose prompts are read stacked (slots > 0): the stacked read's query slots, S per
        # prompt: the row at each slot, and each row's slot as (prompt, sample).
        _Field("slot_rows", "slot", lambda s: _if(s.slots > 0, (s.prompts * s.slots,))),
        _Field("row_prompt", "slot", lambda s: _if(s.slots > 0, (s.rows,))),
        _Field("row_sample", "slot", lambda s: _if(s.slots > 0, (s.rows,))),
        _Field(
            "cache_position",
            "shared",
            lambda s: (1,),
            doc="HF's cache_position of the token fed this step, one for every row: the column HF's padded "
            "layout holds it in (the input's width + steps), what the cache reports as its length",
        ),
        _Field(
            "step",
            "row",
            lambda s: (s.rows,),
            doc="each row's index of the token it samples next: its own step, which keys its sampling noise",
        ),
    )

    def __init__(self, shape: DecodeShape, device: torch.device):
        self.shape = shape
        for f in self.FIELDS:
            dims = f.dims(shape)
            value = None if dims is None else torch.zeros(dims, dtype=f.dtype or shape.dtype, device=device)
            if value is not None and f.fill is not None:
                f.fill(value)
            setattr(self, f.name, value)

    @property
    def rows(self) -> int:
        return self.shape.rows

    def scatter_rows_from(self, sub: DecodeState, rows: Tensor) -> None:
        """The "row" fields of `sub` (a state of len(rows) rows) into rows `rows` of this one."""
        for f in self.FIELDS:
            if f.per == "row" and getattr(self, f.name) is not None:
                getattr(self, f.name).index_copy_(0, rows, getattr(sub, f.name))

    def tensors(self) -> list[Tensor]:
        return [t for t in (getattr(self, f.name) for f in self.FIELDS) if t is not None]

    def clear(self) -> None:
        """Every field zero, but the "fixed" ones (which hold what the shape gives them)."""
        for f in self.FIELDS:
            t = getattr(self, f.name)
            if t is not None and f.per != "fixed":
                t.zero_()

    def gather_into(self, new: DecodeState, rows: Tensor, groups: Tensor | None) -> None:
        """Move the rows `rows` (device int64) into `new`, and (prompts read stacked) the prompt groups `groups`:
        every field as its declaration says; "slot" fields are the caller's (they come from a plan)."""
        for f in self.FIELDS:
            src = getattr(self, f.name)
            if src is None or f.per in ("slot", "fixed"):
                continue
            if f.per == "shared":
                getattr(new, f.name).copy_(src)
            elif f.per == "row" or groups is not None:
                torch.index_select(src, 0, rows if f.per == "row" else groups, out=getattr(new, f.name))
