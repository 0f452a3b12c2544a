"""The paged layout's KV storage (`kv_sharing="paged"`, issue #52): every full-attention cache group's KV in
a pool of fixed-size blocks (`paged_kv.PagedKV`), and one block table per row for all of them
(`block_pool.BlockTables`: the groups' rows and columns are the same, so their blocks are too).

A row holds blocks for the columns it has written or is about to write, not for the call's budget: the
rollout reserves (`reserve`) a prompt's blocks before prefill, forks them to the prompt's N rows after it
(full blocks shared by reference, the partly filled last one copied: `fork_prompts`), and before each
stretch of decode steps the blocks its live rows will write (`Decoder._make_room`). Ended rows take no
more: their filler writes go to block 0, a scratch block no row holds. Every row's blocks are kept after a
call for `Rollout.extend`, and all of them are given back when the next call prepares the cache.

The tables live twice: on the host (`tables`, where blocks are decided) and on the device (`table`,
[rows, blocks] int32: what a forward reads; a decode state's `kv_blocks` holds its rows' copy, gathered
with them when the batch is compacted, so compaction moves no KV). A pool that runs out of blocks is made
larger (a new allocation, the blocks copied: the addresses change, and a CUDA graph is captured anew).

Sliding-window groups (`GroupSpec.window`) keep their KV in a pool of their own whose blocks follow the
rows' windows (`block_pool.WindowBlocks`): the rows' tables are the same, and a sliding layer reads and
writes through `window_map` (table block -> window block, on the device), so that those layers hold about
a window and one block per row whatever the rows' lengths, and nothing that moves tables changes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .block_pool import BlockPool, BlockTables, OutOfBlocks, WindowBlocks, blocks_for
from .paged_kv import PagedKV, slot_mapping, window_slots, window_table

__all__ = ["PagedStore", "KV_BLOCK_SIZE", "SCRATCH_BLOCK"]

# Tokens per KV block (vLLM's default): a row wastes less than one block, and a block is a whole number
# of the operator's partitions' steps.
KV_BLOCK_SIZE = 16
# Block 0 is held by no row: table entries for columns a row holds no block for name it, so that an ended
# row's filler writes (and reads, never used) land somewhere harmless.
SCRATCH_BLOCK = 0


class PagedStore:
    """The blocks of `shapes` (each full-attention group's KVShape) in pools of `dtype` on `device`;
    `windows[g]`: group g's sliding window (None: it keeps every key). Sliding groups share one window pool
    of the largest window (a smaller one keeps a few more keys than it reads)."""

    def __init__(self, shapes, dtype: torch.dtype, device: torch.device, block_size: int = KV_BLOCK_SIZE, windows=None):
        self.shapes, self.dtype, self.device, self.block_size = list(shapes), dtype, device, block_size
        self.windowed = [w is not None for w in (windows or [None] * len(self.shapes))]
        self.window = max((w for w in (windows or []) if w is not None), default=None)
        self.kv: list[PagedKV] = []  # one per group, in the groups' order (a sliding group's: the window pool's)
        self.pool: BlockPool | None = None
        self.tables: BlockTables | None = None
        self.table: Tensor | None = None  # [rows, max_blocks] int32, the device copy of `tables`
        self.windows: WindowBlocks | None = None  # the sliding groups' blocks (None: no sliding group)
        self.window_map: Tensor | None = None  # [table pool's blocks] int32, the device copy of `windows.of`
        self.peak_blocks = 0  # the most table blocks held at once since `prepare`
        self.peak_bytes = 0  # the most bytes held at once since `prepare` (every pool's blocks)
        self.peak_window_blocks = 0  # the most window pool blocks held at once since `prepare`
        self.samples = 0  # tables of samples before the prompts' own (a streaming batch: `prompt_table`)
        self.limit: int | None = None  # the most blocks held at once (a KV budget; the scratch block included)

    @property
    def full_kv(self) -> list[PagedKV]:
        return [kv for kv, w in zip(self.kv, self.windowed) if not w]

    @property
    def window_kv(self) -> list[PagedKV]:
        return [kv for kv, w in zip(self.kv, self.windowed) if w]

    # --- a call's tables ------------------------------------------------------------------------------
    def prepare(
        self, rows: int, columns: int, expected_blocks: int, samples: int | None = None, limit: int | None = None
    ) -> None:
        """Every block free, `rows` empty tables of up to `columns` columns (the first `samples` of them the
        samples', the rest the prompts' own: a streaming batch; None: every one a row's); the pools hold at
        least `expected_blocks` blocks (kept from an earlier call when they are that large). `limit`: the
        most blocks rows may hold at once (a budget of KV tokens: the pools are that large; the window pool
        too, as it never holds more blocks than the tables do)."""
        self.samples = rows if samples is None else samples
        self.limit = None if limit is None else limit + 1  # (+ the scratch block)
        # (+ the scratch block.) Under a limit, the pools are its size from the start, as vLLM allocates its KV
        # cache up front: they never grow, so a CUDA graph's addresses stay across the call.
        need = max(expected_blocks, 1) + 1 if self.limit is None else self.limit
        max_blocks = blocks_for(columns, self.block_size)
        # A window pool's first guess: every row's window and a block, or the tables' guess if that is less.
        window_need = need
        if self.window is not None and self.limit is None:
            window_need = min(need, rows * (blocks_for(self.window, self.block_size) + 2) + 1)
        sizes = [window_need if w else need for w in self.windowed]
        if not self.kv or any(kv.num_blocks < size for kv, size in zip(self.kv, sizes)):
            self.kv = []  # the old pools go before the new ones are made
            self.kv = [
                PagedKV(s.layers, s.kv_heads, s.head_dim, self.block_size, size, self.dtype, self.device)
                for s, size in zip(self.shapes, sizes)
            ]
        full = [kv.num_blocks for kv in self.full_kv]
        self.pool = BlockPool(min(full, default=need) if self.limit is None else need, self.block_size)
        assert self.pool.take(1) == [SCRATCH_BLOCK]
        self.tables = BlockTables(self.pool, rows, max_blocks)
        self.table = torch.full((rows, self.tables.max_blocks), SCRATCH_BLOCK, dtype=torch.int32, device=self.device)
        self.windows = self.window_map = None
        if self.window is not None:
            window_pool = BlockPool(min(kv.num_blocks for kv in self.window_kv), self.block_size)
            self.windows = WindowBlocks(self.tables, window_pool, self.window)
            self.window_map = torch.zeros(self.pool.num_blocks, dtype=torch.int32, device=self.device)
        self.peak_blocks = self.pool.num_held
        self.peak_bytes = self.held_bytes
        self.peak_window_blocks = 0 if self.windows is None else self.windows.pool.num_held

    def release(self) -> None:
        self.kv, self.pool, self.tables, self.table, self.windows, self.window_map = [], None, None, None, None, None

    def widen(self, columns: int) -> None:
        """Tables of up to `columns` columns (a longer history, `Rollout.extend`): the device table widened."""
        max_blocks = blocks_for(columns, self.block_size)
        if max_blocks <= self.tables.max_blocks:
            return
        self.tables.max_blocks = max_blocks
        wider = torch.full((self.table.shape[0], max_blocks), SCRATCH_BLOCK, dtype=torch.int32, device=self.device)
        wider[:, : self.table.shape[1]].copy_(self.table)
        self.table = wider

    # --- blocks ---------------------------------------------------------------------------------------
    def reserve(self, rows: list[int], until: list[int], written: list[int] | None = None) -> list[int]:
        """Rows `rows` hold blocks for their columns [0, until[i]) (more taken where they hold fewer; a pool
        that runs out is made larger). `written[i]`: the column row i writes next (known in decode: its
        sliding-window blocks before that token's window are given back first); None: unknown. Returns the
        rows whose tables changed (the device table is updated)."""
        changed = []
        for i, (row, end) in enumerate(zip(rows, until)):
            if self.windows is not None and written is not None:
                self.windows.slide(row, written[i])
            more = min(end, self.tables.max_blocks * self.block_size) - self.tables.lengths[row]
            if more <= 0:
                continue
            while True:
                try:
                    self._window_room(self.tables.blocks_needed(row, more))
                    new = self.tables.append(row, more)
                    break
                except OutOfBlocks:
                    self._grow(self.tables.blocks_needed(row, more))
            if self.windows is not None:
                self.windows.appended(row, new)
            changed.append(row)
        self._upload(changed)
        return changed

    def fork_prompts(self, batch: int, repeats: int) -> None:
        """Rows [0, batch) hold the prompts: rows [0, batch * repeats) hold them in repeat_interleave order
        (row b * repeats + j continues prompt b), full blocks shared by reference, each row's copy of the
        partly filled last block made on the device."""
        for b in range(batch - 1, -1, -1):  # (a destination row is never a prompt row still to be read)
            home = b * repeats
            if home != b:
                self.tables.move_row(b, home)
                if self.windows is not None:
                    self.windows.moved(b, home)
            self._fork(home, list(range(home + 1, home + repeats)))
        self._upload(list(range(batch * repeats)))

    # --- prompts read in place -------------------------------------------------------------------------
    def place_prompts(self, rows: int, first: int, blocks: int) -> None:
        """Before the prompts' KV is written: prompt rows [0, `rows`) take their table entries from `first`
        on (past a common prefix's `first` whole blocks, which are blocks 1 .. first) at blocks
        `1 + first + i * (blocks + 1)` on, for prompt i (`blocks` whole blocks, then room for a partly
        filled one), so that the stacked read finds every prompt's whole blocks as one strided view of the
        pool, with no gather (`prompts_in_place`). The run is set aside until `end_placement`; nothing is
        placed under a KV budget (a block set aside would be one the scheduler counted as free) or where
        the run's blocks are not all free."""
        if self.limit is not None or blocks < 1 or rows < 1:
            return
        start, stride = 1 + first, blocks + 1
        if start + rows * stride > self.pool.num_blocks:
            self._grow(start + rows * stride - self.pool.num_blocks)
        run = []
        for i in range(rows):  # (a row may hold its first placed blocks: the common prefix's partly filled one)
            held = self.tables.blocks[i][first:]
            if held != list(range(start + i * stride, start + i * stride + len(held))):
                return
            run += range(start + i * stride + len(held), start + (i + 1) * stride)
        if not self.pool.set_aside(run):
            return
        for i in range(rows):
            self.tables.place(i, start + i * stride, first)

    def end_placement(self) -> None:
        """The prompts are written: the blocks set aside and not taken are free again."""
        if self.tables is not None:
            self.tables.placed.clear()
            self.pool.put_back_aside()

    def prompts_in_place(self, homes: list[int], first: int, blocks: int) -> bool:
        """Whether the tables of rows `homes` (prompt i's at homes[i]) name blocks 1 .. first for a common
        prefix's whole blocks (when `first`), and for prompt i's next (up to `blocks`) whole blocks the run
        from `1 + first + i * (blocks + 1)`: what `place_prompts` lays out, and what the stacked read then
        views in place (`paged_kv.block_runs`; past a prompt's own blocks it reads other blocks, masked)."""
        for i, home in enumerate(homes):
            table = self.tables.blocks[home]
            own = table[first : first + blocks]  # (a shorter prompt holds fewer: the read masks the rest)
            start = 1 + first + i * (blocks + 1)
            if table[:first] != list(range(1, 1 + first)) or own != list(range(start, start + len(own))):
                return False
        return bool(homes)

    def prompt_table(self, prompt: int) -> int:
        """A streaming batch: the table that holds prompt `prompt`'s KV while its samples get rows."""
        return self.samples + prompt

    def fork_to(self, prompt: int, samples: list[int]) -> None:
        """A streaming batch: `samples` (empty tables) continue prompt `prompt`'s table (full blocks shared,
        the partly filled one copied)."""
        self._fork(self.prompt_table(prompt), samples)
        self._upload(samples)

    def release_prompt(self, prompt: int) -> None:
        """A streaming batch: prompt `prompt`'s own table gives its blocks back (its samples that started
        hold them still)."""
        self.release_table(self.prompt_table(prompt))

    def release_table(self, table: int) -> None:
        """Table `table` gives its blocks back (its sample ended; those others hold stay)."""
        if self.windows is not None:
            self.windows.released(table)
        self.tables.release(table)

    def _fork(self, parent: int, children: list[int]) -> None:
        """`children` (empty tables) continue `parent`'s (`BlockTables.fork`, the pools made larger when they
        have too few blocks for the copies), the partly filled block's copies made in every pool."""
        while True:
            try:
                self._window_room(len(children))  # (the shared blocks have theirs: the parent reads them)
                copies = self.tables.fork(parent, children)
                break
            except OutOfBlocks:
                self._grow(len(children))
        for kv in self.full_kv:
            kv.copy_blocks(copies)
        if self.windows is not None:
            window_copies = self.windows.forked(parent, children, copies)
            for kv in self.window_kv:
                kv.copy_blocks(window_copies)

    def _window_room(self, blocks: int) -> None:
        """The window pool has at least `blocks` free blocks (made larger when it has fewer: up to the
        tables' pool's size, which it never needs to pass)."""
        if self.windows is None or self.windows.pool.num_free >= blocks:
            return
        pool = self.windows.pool
        _grow_to(pool, self.window_kv, min(_doubled(pool, blocks), max(self.pool.num_blocks, pool.num_blocks + blocks)))

    def _grow(self, at_least: int) -> None:
        """Pools with at least `at_least` more free blocks (doubling, up to `limit`): a new allocation each
        (not under a limit that the pools' tensors hold already). OutOfBlocks past the limit: the budget's
        scheduler takes no more than it holds, so this is a bookkeeping error."""
        size = _doubled(self.pool, at_least)
        if self.limit is not None:
            size = min(size, self.limit)
            if size - self.pool.num_blocks < at_least:
                raise OutOfBlocks(
                    f"torchkvops: the KV budget (max_kv_tokens: {self.limit - 1} blocks of {self.block_size}) has "
                    f"{self.pool.num_free} free, {at_least} more wanted: the scheduler should have preempted"
                )
        _grow_to(self.pool, self.full_kv, size)

    def _upload(self, rows: list[int]) -> None:
        self.peak_blocks = max(self.peak_blocks, self.pool.num_held)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        windows = self.windows
        if windows is not None:
            self.peak_window_blocks = max(self.peak_window_blocks, windows.pool.num_held)
            windows.fit()
            if windows.changed or self.window_map.numel() != len(windows.of):  # (the whole map, a few thousand int32)
                mapped = torch.tensor(windows.of, dtype=torch.int32)
                if self.window_map.numel() != mapped.numel():  # (the tables' pool grew: a new tensor, a new graph)
                    self.window_map = torch.zeros_like(mapped, device=self.device)
                self.window_map.copy_(mapped, non_blocking=True)
                windows.changed = False
        if not rows:
            return
        table = self.tables.tensor(self.device, rows=rows)  # (only the changed rows', built on the host)
        self.table.index_copy_(0, torch.tensor(rows, device=self.device), table)

    # --- reading and writing --------------------------------------------------------------------------
    def slots(self, table: Tensor, columns: Tensor) -> Tensor:
        """The pool slots of each row's `columns` ([rows] or [rows, tokens]) through `table` (its rows')."""
        return slot_mapping(table, columns, self.block_size)

    def group_table(self, group: int, table: Tensor) -> Tensor:
        """What group `group` reads through rows' `table`: the table itself, or for a sliding group the
        window pool's blocks of its entries."""
        return window_table(self.window_map, table) if self.windowed[group] else table

    def group_slots(self, group: int, slots: Tensor) -> Tensor:
        """Where group `group` writes tokens whose table slots are `slots` (a sliding group: in the window
        pool)."""
        return window_slots(self.window_map, slots, self.block_size) if self.windowed[group] else slots

    def _bytes_per_block(self, windowed: bool) -> int:
        return sum(kv.nbytes // kv.num_blocks for kv, w in zip(self.kv, self.windowed) if w == windowed)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in every full-attention group's pool (K and V of every layer)."""
        return self._bytes_per_block(False)

    @property
    def held_bytes(self) -> int:
        """Bytes of the blocks held now (the scratch blocks included)."""
        held = self.pool.num_held * self.block_bytes
        if self.windows is not None:
            held += self.windows.pool.num_held * self._bytes_per_block(True)
        return held

    @property
    def used_bytes(self) -> int:
        """Bytes of the most blocks rows held at once (the scratch blocks included)."""
        return self.peak_bytes

    @property
    def allocated_bytes(self) -> int:
        return sum(kv.nbytes for kv in self.kv)


def _doubled(pool: BlockPool, at_least: int) -> int:
    """A pool's next size: doubled, or more where `at_least` more free blocks are wanted (amortized growth,
    as a list's)."""
    return max(2 * pool.num_blocks, pool.num_blocks + at_least)


def _grow_to(pool: BlockPool, kvs: list[PagedKV], size: int) -> None:
    """`pool` and the KV tensors of its blocks (a new allocation each, not where one holds `size` already)
    made `size` blocks."""
    for kv in kvs:
        if kv.num_blocks < size:
            kv.grow(size)
    pool.grow(size)
