"""The KV layouts (`RolloutConfig.kv_sharing`) as objects: everything that differs between them.

- `DenseLayout`: one dense KV buffer of rows x positions, each row's prompt in its own row: what a streaming
  batch's scratch cache prefills its prompts into, and what the layouts below share.
- `PagedLayout` ("paged") and its two named ways of reading (`PagedCopyLayout`, "copy";
  `PagedPrefixLayout`, "prefix"): every full-attention group's KV in a pool of blocks taken as rows grow
  (`paged_store`), a prompt's whole blocks shared by its rows by reference; "copy" reads each row through
  its table, "prefix" a prompt's whole blocks once a step for its rows' stacked queries (`attention`),
  "paged" the one or the other by the prompt's length (`PagedLayout.stacked_tokens`). The expanded baseline
  (`shared_prefill=False`) is "copy" whose rows are prefilled each alone into blocks of their own.

Every cache group (`cache_groups`) has the layout's buffers; a layout reads and writes them through the
cache's views of every group (`KVViews`), one group at a time.

The rest of the engine asks its layout instead of testing the name: the buffers' lengths and rows, which
index each buffer is gathered by when the batch is compacted, the column decode writes first, what a row
sees when it starts, the prompt part of a decode shape, the prompt groups compaction keeps, and where a
streaming batch puts a prompt's KV.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..models.families import ATTENTION_KINDS
from .cache_groups import KVViews
from .compaction import BatchMap
from .paged_store import KV_BLOCK_SIZE, SCRATCH_BLOCK
from .state import DecodeShape

__all__ = [
    "DenseLayout",
    "PagedLayout",
    "PagedCopyLayout",
    "PagedPrefixLayout",
    "LAYOUTS",
    "layout_for",
    "round_up",
    "KV_LENGTH_MULTIPLE",
    "FIRST_DECODE_COLUMNS",
]

# Decode buffers are rounded up to a multiple of this many positions: nearby prompt lengths then share
# one decode shape (graph), and the attention kernels get aligned mask widths.
KV_LENGTH_MULTIPLE = 64
# The decode buffer holds this many tokens a row when a call starts (rounded up), and the decoder widens it
# (doubled, at most to what max_new_tokens needs: `Decoder._make_room`) before the rows' next stretch of steps
# could pass its end: its size follows the longest row, not the budget.
FIRST_DECODE_COLUMNS = 256


def round_up(n: int, multiple: int = KV_LENGTH_MULTIPLE) -> int:
    return max(1, -(-n // multiple)) * multiple


class DenseLayout:
    """Each row's KV in dense rows of its own (module docstring): what a streaming batch's scratch cache
    prefills its prompts into, and what the paged layouts share of a layout (`PagedLayout` holds all the
    rest). The unit tests of the dense buffers' moves (expansion, compaction), which the recurrent groups'
    states make as these do, use it alone."""

    name = "dense"
    paged = False  # the KV in blocks taken as rows grow (PagedLayout)

    def __init__(self, samples: int):
        self.samples = samples

    # --- a prefix common to every prompt (torchkvops.rollout.prompts) ------------------------------------
    def share_common(self, cache, batch: int, common: int) -> None:
        """After the common prefix was computed once: every prompt's rows hold it (one copy per prompt)."""
        cache.expand_prompts(1, batch, common)

    # --- the KV buffers -------------------------------------------------------------------------
    def kv_lengths(self, prompt_len: int, new_tokens: int) -> tuple[int, ...]:
        """The positions of each KV buffer. The last sampled token is never fed back: decode writes
        new_tokens - 1 positions."""
        return (round_up(prompt_len + new_tokens - 1),)

    def first_kv_lengths(self, prompt_len: int, new_tokens: int) -> tuple[tuple[int, ...], int]:
        """The KV buffers' lengths a call starts with (room for FIRST_DECODE_COLUMNS tokens a row), and the
        decode buffer's length at the budget of `new_tokens` (what it may be widened to)."""
        return self.kv_lengths(prompt_len, min(new_tokens, FIRST_DECODE_COLUMNS)), self.kv_lengths(
            prompt_len, new_tokens
        )[-1]

    def buffer_rows(self, prompts: int, rows: int) -> tuple[int, ...]:
        """The rows of each KV buffer, for `prompts` prompts and `rows` rows."""
        return (rows,)

    def kv_index(self, rows: Tensor, prompts: Tensor | None) -> tuple[Tensor, ...]:
        """What each buffer keeps when the batch keeps rows `rows` and prompt groups `prompts`."""
        return (rows,)

    def expand_prompts(self, cache, batch: int, prompt_len: int) -> None:
        """After a shared prefill of `batch` prompts: each prompt's KV in its N rows."""
        cache.expand_prompts(batch, self.samples, prompt_len)

    # --- a call's first decode step ----------------------------------------------------------------
    def decode_visible(self, row_mask: Tensor) -> Tensor:
        """What each row sees of the decode buffer when decode starts ([rows, C] bool)."""
        return row_mask

    # --- a streaming batch (torchkvops.rollout.streaming) -----------------------------------------------
    def stream_map(self, rows: int) -> BatchMap:
        """The host-side map of a streaming batch before any row starts: every row free."""
        batch_map = BatchMap(rows)
        batch_map.original.fill_(-1)
        return batch_map

    def place_prompts(self, batch, prompts: list[int], kv: KVViews, mask: Tensor) -> list:
        """Where each freshly prefilled prompt's KV waits for its rows: here, its own KV (views of `kv`,
        per group [group layers, 2, prompts, kv_heads, P, head_dim], made a copy by `keep_apart` if rows
        wait)."""
        return [kv.narrow_rows(i, 1) for i in range(len(prompts))]

    def release_rows(self, batch, rows: list[int]) -> None:
        """Rows whose samples ended leave their prompt (nothing to do: each row held its own copy)."""


def _storage(views: KVViews) -> int:
    """The address of the allocation the views are carved from."""
    return views.buffers[0].untyped_storage().data_ptr()


class PagedLayout(DenseLayout):
    """Each row reads its prompt's KV, then its own, through one block table, their KV in blocks of a pool
    taken as they grow (`paged_store`): a prompt's full blocks shared by its N rows
    by reference, a row's memory what it holds, not the longest row's or the budget's (issue #52)."""

    name = "paged"
    needs_shared_prefill = True  # (a prompt's blocks are written once and shared)
    paged = True
    block_size = KV_BLOCK_SIZE

    # A call's rows read their prompt's whole blocks (which every row of the prompt names in its table, shared
    # by reference) once a step for the rows' stacked queries, when
    # the widest prompt has at least this many tokens in whole blocks; each row then reads its own keys from
    # there on, and the two parts are merged by their log-sum-exps. Shorter prompts are read through each
    # row's table: a second read and a merge cost more than they save (docs/benchmarks.md, "Paged KV:
    # prompts read stacked"). A streaming batch (rows of prompts that come and go) reads through its tables.
    stacked_tokens = 256

    def _reads_stacked(self, width: int) -> bool:
        """Whether prompts of `width` columns are read stacked: their rows' stacked queries need samples to
        stack, and the widest prompt `stacked_tokens` tokens in whole blocks."""
        return self.samples > 1 and width // self.block_size * self.block_size >= max(self.stacked_tokens, 1)

    def lay_out_prompts(self, cache, prompts: int, width: int, common: int = 0) -> None:
        """Prompts that will be read stacked (`prompt_visible`) get their whole blocks (past a common
        prefix's) as runs of the pool a fixed stride apart (`PagedStore.place_prompts`), which the stacked
        read views in place instead of gathering them every step (`DecodeShape.prompts_in_place`)."""
        if self._reads_stacked(width):
            first = common // self.block_size
            cache.paged.place_prompts(prompts, first, width // self.block_size - first)

    def expand_prompts(self, cache, batch: int, prompt_len: int) -> None:
        cache.paged.end_placement()  # (the prompts are written: their runs' spare blocks are free again)
        super().expand_prompts(cache, batch, prompt_len)

    def reserve(self, cache, rows: list[int] | Tensor, until: list[int] | Tensor) -> None:
        host = [t.tolist() if isinstance(t, Tensor) else t for t in (rows, until)]  # (host sync: tensors)
        cache.reserve(*host)

    def prompt_visible(self, prompt_mask: Tensor, cache) -> Tensor | None:
        """The prompts' columns ([prompts, W] bool, `prompt_mask`) when a call's rows read their prompts'
        shared blocks stacked (`stacked_tokens`), else None (each row reads its prompt through its table)."""
        return prompt_mask.bool() if self._reads_stacked(prompt_mask.shape[1]) else None

    def batch_map(self, rows: int) -> BatchMap:
        """N rows per prompt, grouped: compaction keeps the prompt groups of the rows it keeps and their
        query slots, which the stacked prompt reads use."""
        return BatchMap(rows, self.samples)

    # A streaming batch keeps a table per sample (its output row), not per batch row, as a call does: a row's
    # next occupant starts from an empty table, and the decode loop finds each row's table by its sample.
    # Each admitted prompt's KV is written once into a table of its own (after the samples'), which its
    # samples fork as they get rows; the scratch cache's views still carry a hybrid's recurrent states.
    def place_prompts(self, batch, prompts: list[int], kv: KVViews, mask: Tensor) -> list:
        batch.cache.write_prompts(prompts, kv, mask.shape[1])
        return super().place_prompts(batch, prompts, kv, mask)

    def seat(self, batch, cache, home, row_mask: Tensor, rows: Tensor, samples: Tensor) -> Tensor:
        """Give rows `rows` (their samples `samples`) the prompt at `home`: each sample's table forks the
        prompt's (its full blocks shared, its partly filled one copied), the recurrent groups' states copied
        as the copy layout copies them. Returns the rows' attention bias over their columns."""
        prompt_len = row_mask.shape[1]
        samples = samples.tolist()
        cache.seat_samples(samples[0] // self.samples, samples, home, rows)
        visible = torch.full((rows.numel(), cache.decode_columns), float("-inf"), device=rows.device)
        visible[:, :prompt_len] = torch.where(row_mask, 0.0, float("-inf"))
        return visible

    def release_rows(self, batch, rows: list[int]) -> None:
        """Rows whose samples ended (or were preempted) give their blocks back (a streamed call keeps no KV
        for a turn); until another sample takes them, their filler writes go to the scratch block, not to
        blocks now free (which another row may take at the next stretch)."""
        batch.cache.release_tables(batch.map.original[rows].tolist())
        kv_blocks = batch.state.kv_blocks
        kv_blocks.index_fill_(0, torch.tensor(rows, device=kv_blocks.device), SCRATCH_BLOCK)

    def drop_prompt(self, batch, prompt: int) -> None:
        """The prompt's own table gives its blocks back (its started samples hold them still)."""
        batch.cache.release_prompt(prompt)

    def keep_apart(self, home: KVViews, scratch) -> KVViews:
        """A waiting prompt's states in the groups without a pool (recurrent layers), copied out of the scratch
        cache; its attention KV waits in its table already (an empty stand-in for those groups)."""
        pooled = [g.kind in ATTENTION_KINDS for g in scratch.groups]  # (the groups a paged cache pools)
        views = scratch.prompt_views
        if views is None or _storage(home) != _storage(views):
            return home
        buffers = tuple(b[..., :0, :].clone() if p else b.clone() for b, p in zip(home.buffers, pooled))
        return KVViews(buffers, home.slots, home.state_slots)

    def decode_shape(
        self,
        cache,
        rows: int,
        prompts: int,
        max_new_tokens: int,
        dtype,
        logprobs: bool,
        slots: int = 0,
        prompt_columns: int = 0,
        common: int = 0,
    ):
        """A call's rows read their prompts' shared blocks stacked when `prompts` (`prompt_visible`): the
        whole blocks of the widest prompt, those of a prefix of `common` tokens common to every prompt read
        once for every row (`common_len`) and the rest once per prompt (`prompt_len`), when some are left."""
        block = self.block_size
        shared = prompt_columns // block * block if prompts else 0
        common_len = common // block * block
        if common_len >= shared:  # (no prompt has a whole block of its own: the prompts' level reads it all)
            common_len = 0
        homes = [i * self.samples for i in range(prompts)] if shared else []
        in_place = cache.paged.prompts_in_place(homes, common_len // block, (shared - common_len) // block)
        return DecodeShape(
            rows,
            cache.columns,
            max_new_tokens,
            dtype,
            prompts=prompts if shared else 0,
            prompt_len=shared - common_len,
            logprobs=logprobs,
            slots=slots if shared else 0,
            kv_block=self.block_size,
            common_len=common_len,
            prompts_in_place=in_place,
        )

    def dynamic_tensors(self, state, cache) -> list[tuple[Tensor, tuple[int, ...]]]:
        window_map = cache.paged.window_map  # (sliding-window groups: read by a step, made anew as the pool grows)
        return [] if window_map is None else [(window_map, ())]


class PagedCopyLayout(PagedLayout):
    """`kv_sharing="copy"` on the pool: each row reads its prompt's blocks through its own table."""

    name = "copy"
    needs_shared_prefill = False  # (without one, the expanded baseline: each row prefilled into its own blocks)
    stacked_tokens = math.inf


class PagedPrefixLayout(PagedLayout):
    """`kv_sharing="prefix"` on the pool: a prompt's whole blocks read once a step for its rows' stacked
    queries, whatever its length."""

    name = "prefix"
    stacked_tokens = 1


LAYOUTS = {layout.name: layout for layout in (PagedCopyLayout, PagedPrefixLayout, PagedLayout)}


def layout_for(kv_sharing: str, samples: int, shared_prefill: bool = True) -> PagedLayout:
    """The layout object of RolloutConfig.kv_sharing, for `samples` rows per prompt (the expanded baseline,
    without a shared prefill: "copy", on the pool too, so that it differs from the shared modes only by the
    prefill each row makes alone)."""
    if not shared_prefill:
        return PagedCopyLayout(samples)
    return LAYOUTS[kv_sharing](samples)
