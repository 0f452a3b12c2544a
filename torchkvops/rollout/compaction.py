"""Compaction of the decode batch as responses end (`RolloutConfig.compact_finished_rows`).

RL responses end at very different lengths, and a static batch decodes every row until the longest has
ended. At the rollout's all-ended check (every FINISHED_CHECK_INTERVAL steps, which reads `finished` on
the host anyway) the live rows are gathered into a smaller batch when that saves enough, and decode goes
on with it. Nothing else syncs: the plan is made on the host from the `finished` flags the check read.

What moves with a row: its KV (its block table in the pool; a recurrent group's state row), and
the prompts that still have a live row where prompts are read stacked, its position, attention bias, last token, finished flag and
sampling key, its step (each row counts its own tokens), and the tokens (and log-probabilities) it has
produced. A row's sampling key is a hash of its row id and its noise is keyed by its own step, so every
row draws the same noise at the same step as it would have in the full batch: its tokens do not change (its logits may differ in the last bits, by the
GEMM's blocking at another batch size; the sampled tokens only where two logits tie to that precision).

Sizes. A compacted batch has `bucket(live rows)` rows: every size up to 8, then four per octave (10, 12,
14, 16, 20, 24, 28, 32, 40, ...), so that a rollout of R rows meets at most 8 + 4 log2(R / 8) decode
shapes; their decode states (and CUDA graphs) are kept across calls, and compiled decode's row dim is
dynamic. The extra rows of a bucket are rows that have ended (each row appears once), so they only
ever produce the pad id. A batch is compacted when its bucket is at most COMPACT_FRACTION of the rows
it has (with four sizes per octave: whenever the bucket drops) and a check interval of steps is left.

A stacked prompt read (`kv_sharing="prefix"`, or "paged" past its threshold) stacks the queries of a
prompt's rows against that prompt's whole blocks. Compacted rows no longer come in equal groups per
prompt, so a compacted batch's stacked read takes index maps instead (`torchkvops.rollout.attention`):
`slot_rows` [G * S] (the row whose query fills each of S slots of each of G prompts; padding slots repeat a
row) and, per row, the (prompt, slot) its prompt part is read from. Only the attention's prompt part sees
the padding (extra queries against keys it reads anyway); the model's projections, MLPs and LM head run
on the compacted rows alone. Prompts without a live row are dropped. A batch whose rows read no prompt
stacked keeps no groups or slots in its shape. Until the first compaction the batch keeps the plain layout (N rows per
prompt, no maps), so a rollout in which no row ends early runs exactly as without compaction.

Outputs. The first decode state's `responses` and `logprobs` hold every original row: at each compaction
the rows of the batch being left are written back to their original rows (`original`), and columns from
the current step on are set to the pad id (and 0), which is what a row that has ended holds; rows that go
on are written back again at the next compaction or at the end.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

__all__ = ["COMPACT_FRACTION", "bucket", "bucket_sizes", "Plan", "BatchMap", "plan"]

# A batch is compacted when bucket(live rows) <= this fraction of its rows: the smallest step between
# two sizes above 8 is 7/8, so with four sizes per octave every drop of a bucket compacts.
COMPACT_FRACTION = 0.875
_EXACT_UP_TO = 8  # every batch size up to this is its own bucket
_PER_OCTAVE_LOG2 = 2  # 2**2 = 4 sizes per octave above it


def bucket(n: int) -> int:
    """The decode batch size for n live rows: n up to 8, else n rounded up to one of four sizes per
    octave (10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, ...): at most 25% padding."""
    if n <= _EXACT_UP_TO:
        return max(n, 1)
    step = 1 << ((n - 1).bit_length() - 1 - _PER_OCTAVE_LOG2)
    return -(-n // step) * step


def bucket_sizes(rows: int) -> list[int]:
    """Every size a batch of `rows` rows can be compacted to (its own size included): the bound on the
    decode shapes of one rollout configuration."""
    return sorted({bucket(n) for n in range(1, rows + 1) if bucket(n) < rows} | {rows})


@dataclasses.dataclass
class Plan:
    """One compaction, in terms of the current batch (host tensors)."""

    rows: Tensor  # [rows'] the current rows the compacted batch holds, in order (live ones, then ended ones)
    groups: Tensor | None = None  # prefix: [G'] the current prompt groups kept, ascending
    slot_rows: Tensor | None = None  # prefix: [G' * S'] the compacted row at each query slot
    row_slot: Tensor | None = None  # prefix: [rows'] the query slot of each compacted row
    row_group: Tensor | None = None  # prefix: [rows'] each compacted row's prompt group (ended rows: 0)

    @property
    def size(self) -> int:
        return self.rows.numel()

    @property
    def prompts(self) -> int:
        return 0 if self.groups is None else self.groups.numel()

    @property
    def slots(self) -> int:
        return 0 if self.slot_rows is None else self.slot_rows.numel() // self.groups.numel()


class BatchMap:
    """Host-side bookkeeping of a batch (`torchkvops.rollout.batch.DecodeBatch` keeps it): which output row
    each row of the current batch is (-1: a free row of a streaming batch), and (prompts read stacked) which
    prompt group each row's query is stacked with."""

    def __init__(self, rows: int, samples: int | None = None):
        self.original = torch.arange(rows)
        self.group = None if samples is None else torch.arange(rows) // samples
        self.groups = 0 if samples is None else rows // samples

    def apply(self, p: Plan) -> None:
        self.original = self.original[p.rows]
        if p.groups is not None:
            self.group, self.groups = p.row_group, p.groups.numel()


def plan(finished: Tensor, batch: BatchMap, min_rows: int = 2) -> Plan | None:
    """The compaction of the current batch given its `finished` flags (host bool [rows]), or None when it
    would not save enough (COMPACT_FRACTION). min_rows: the smallest batch made (2 keeps compiled decode
    off the size-1 specialization that a dynamic dim of size 1 gets)."""
    rows = finished.numel()
    live = (~finished).nonzero().flatten()
    size = max(bucket(live.numel()), min(min_rows, rows))
    if size >= rows or size > COMPACT_FRACTION * rows:  # (the first: a batch is never "compacted" to its own size)
        return None
    ended = finished.nonzero().flatten()
    keep = torch.cat([live, ended[: size - live.numel()]])
    if batch.group is None:
        return Plan(keep)
    return _grouped_plan(keep, live.numel(), batch, min_rows)


def _grouped_plan(keep: Tensor, n_live: int, batch: BatchMap, min_rows: int) -> Plan:
    """The prompt groups and query slots of a compacted batch whose rows are grouped by prompt (the paged
    layouts', which the stacked prompt reads use: see the module docstring)."""
    group = batch.group[keep]
    live_groups = group[:n_live].unique()  # sorted
    n_groups = min(batch.groups, max(bucket(live_groups.numel()), min_rows))
    dead = torch.ones(batch.groups, dtype=torch.bool)
    dead[live_groups] = False
    groups = torch.cat([live_groups, dead.nonzero().flatten()[: n_groups - live_groups.numel()]]).sort().values
    new_group = torch.full((batch.groups,), -1, dtype=torch.long)
    new_group[groups] = torch.arange(n_groups)
    row_group = new_group[group].clamp(min=0)  # ended rows of dropped prompts read prompt 0's (never used)
    # Slot t of prompt g holds its t-th live row; S' = the most live rows of one prompt, a power of two
    # (padding costs the prefix attention extra queries only, and few sizes mean few decode shapes), at
    # least min_rows (compiled decode would specialize S' = 1, where the slots are as many as the prompts).
    live_group = row_group[:n_live]
    counts = torch.bincount(live_group, minlength=n_groups)
    slots = max(1 << max(0, int(counts.max()) - 1).bit_length(), min_rows)
    order = torch.argsort(live_group, stable=True)  # live rows by prompt
    first = torch.cumsum(counts, 0) - counts
    rank = torch.empty(n_live, dtype=torch.long)
    rank[order] = torch.arange(n_live) - first[live_group[order]]
    row_slot = torch.zeros(keep.numel(), dtype=torch.long)  # ended rows read slot 0 (never used)
    row_slot[:n_live] = live_group * slots + rank
    slot_rows = torch.zeros(n_groups * slots, dtype=torch.long)  # padding slots repeat row 0
    slot_rows[row_slot[:n_live]] = torch.arange(n_live)
    return Plan(keep, groups, slot_rows, row_slot, row_group)
