"""Paged KV bookkeeping on the host: a pool of fixed-size KV blocks with reference counts, and each row's
block table (issue #52, the pool's step; `ops.paged_attention` reads what these tables say).

A row's KV is a list of blocks of `block_size` tokens each, taken from the pool as the row grows and given
back when it ends, so that a rollout holds what its rows hold, not rows x max_new_tokens. A prompt's full
blocks are shared by its N samples by reference (one reference each); its last, partly filled block is
copied per sample (each sample writes its own tokens after it), so `fork` returns the (source,
destination) block copies for the caller to make on the device. A sliding-window layer's row gives back
the blocks that lie wholly before its window (`slide`).

Nothing here touches a tensor but `BlockTables.tensor`, which writes the tables as `paged_attention`
takes them ([rows, blocks] int32): the decisions are made on the host, at the decode loop's checks, and
tested without a model (tests/test_block_pool.py). Modelled on vLLM v1's `BlockPool` and
`KVCacheManager` (reference-counted blocks, a free list, per-request block lists) without its prefix
cache: a rollout knows which rows share a prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["OutOfBlocks", "BlockPool", "BlockTables", "WindowBlocks", "blocks_for"]


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs (the scheduler preempts a row, or waits)."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens."""
    return -(-tokens // block_size)


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens: which are free, and how many rows hold each of the others.

    Freed blocks are taken again last-freed first, so that a row that ends and a row that starts reuse the
    same memory (warm in cache). `epoch[b]` counts the times block b was given back: a reader that noted it
    can check that the block was not given back since (`check_held`), the guard behind "no block is read
    after it is returned"."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"torchkvops: block_size must be at least 1, got {block_size}")
        if num_blocks < 0:
            raise ValueError(f"torchkvops: num_blocks must be at least 0, got {num_blocks}")
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.epoch = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is taken first
        self._aside: set[int] = set()  # free blocks kept for `take(at=)` only (`set_aside`)

    @property
    def num_blocks(self) -> int:
        return len(self.refs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_blocks - self.num_free - len(self._aside)

    def grow(self, num_blocks: int) -> None:
        """The pool has `num_blocks` blocks now (more than before: the caller made its tensor larger and
        copied the blocks over); the new ones are free, taken after the ones freed before."""
        if num_blocks < self.num_blocks:
            raise ValueError(f"torchkvops: a pool of {self.num_blocks} blocks cannot shrink to {num_blocks}")
        new = range(self.num_blocks, num_blocks)
        self.refs += [0] * len(new)
        self.epoch += [0] * len(new)
        self._free[:0] = reversed(new)  # under the freed ones: those are taken first

    def set_aside(self, blocks: list[int]) -> bool:
        """`blocks`, all free, kept from `take` but for a `take(at=)` that names them (a run of blocks a
        reader finds by position: `PagedStore.place_prompts`), until `put_back_aside`. False (nothing set
        aside) when one of them is held or past the pool."""
        if any(not 0 <= b < self.num_blocks or self.refs[b] or b in self._aside for b in blocks):
            return False
        self._aside.update(blocks)
        self._free = [b for b in self._free if b not in self._aside]
        return True

    def is_aside(self, block: int) -> bool:
        return block in self._aside

    def put_back_aside(self) -> None:
        """The blocks set aside and not taken are free again (taken before the others, lowest first)."""
        self._free += sorted(self._aside, reverse=True)
        self._aside.clear()

    def take(self, n: int, at: int | None = None) -> list[int]:
        """`n` free blocks, each now held once; OutOfBlocks (and nothing taken) when fewer are free. `at`:
        blocks [at, at + n) when all of them are set aside (`set_aside`), else any free ones."""
        if at is not None and n > 0 and all(b in self._aside for b in range(at, at + n)):
            self._aside.difference_update(range(at, at + n))
            for b in range(at, at + n):
                self.refs[b] = 1
            return list(range(at, at + n))
        if n > len(self._free):
            raise OutOfBlocks(f"torchkvops: {n} KV blocks wanted, {len(self._free)} of {self.num_blocks} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks` (a sample reading its prompt's blocks)."""
        for b in blocks:
            if self.refs[b] < 1:
                raise AssertionError(f"torchkvops: block {b} is free: it cannot be shared")
            self.refs[b] += 1

    def give_back(self, blocks: list[int]) -> list[int]:
        """One holder less of each of `blocks`; those no row holds any more are free again (returned)."""
        freed = []
        for b in blocks:
            if self.refs[b] < 1:
                raise AssertionError(f"torchkvops: block {b} given back while free")
            self.refs[b] -= 1
            if not self.refs[b]:
                self.epoch[b] += 1
                self._free.append(b)
                freed.append(b)
        return freed

    def check_held(self, blocks: list[int], epochs: list[int] | None = None) -> None:
        """Every one of `blocks` is held (and, given the `epochs` noted when it was read first, has not been
        given back since): a table that names a returned block would read another row's KV."""
        for i, b in enumerate(blocks):
            if self.refs[b] < 1 or (epochs is not None and self.epoch[b] != epochs[i]):
                raise AssertionError(f"torchkvops: block {b} was given back but a row still reads it")


class BlockTables:
    """Each of `rows` rows' blocks of one pool, in order, and its length in tokens. A row's table has at
    most `max_blocks` entries (its longest length's blocks). Sliding-window layers give blocks back through
    a `WindowBlocks` beside these tables; a table itself always holds every block of its row."""

    def __init__(self, pool: BlockPool, rows: int, max_blocks: int):
        self.pool, self.max_blocks = pool, max_blocks
        self.blocks: list[list[int]] = [[] for _ in range(rows)]
        self.lengths = [0] * rows  # the tokens each row has written (or reserved)
        # Rows whose blocks go to given places (`place`): row -> (block, index): its table's entry `index`
        # is that block, and each later entry the next block.
        self.placed: dict[int, tuple[int, int]] = {}

    @property
    def rows(self) -> int:
        return len(self.blocks)

    def place(self, row: int, block: int, index: int) -> None:
        """`row`'s table entries from `index` on are to be blocks `block`, `block + 1`, ... where the pool
        has set them aside (`BlockPool.set_aside`); any free blocks where it has not."""
        self.placed[row] = (block, index)

    def _at(self, row: int, index: int) -> int | None:
        """The block `row`'s table entry `index` is placed at (`place`), or None."""
        block, first = self.placed.get(row, (None, 0))
        return None if block is None or index < first else block + index - first

    def blocks_needed(self, row: int, tokens: int) -> int:
        """Blocks `row` takes to hold `tokens` more tokens."""
        bs = self.pool.block_size
        return blocks_for(self.lengths[row] + tokens, bs) - len(self.blocks[row])

    def append(self, row: int, tokens: int) -> list[int]:
        """Room for `tokens` more tokens in `row`: the blocks it takes (OutOfBlocks, nothing taken, when
        the pool has too few; ValueError past max_blocks)."""
        need = self.blocks_needed(row, tokens)
        if len(self.blocks[row]) + need > self.max_blocks:
            raise ValueError(
                f"torchkvops: row {row} would hold {self.lengths[row] + tokens} tokens, more than its table's "
                f"{self.max_blocks} blocks of {self.pool.block_size}"
            )
        new = self.pool.take(max(0, need), at=self._at(row, len(self.blocks[row])))
        self.blocks[row] += new
        self.lengths[row] += tokens
        return new

    def fork(self, parent: int, children: list[int]) -> list[tuple[int, int]]:
        """Each of `children` (empty rows) continues `parent`'s KV: it holds the parent's full blocks by
        reference, and a block of its own for the parent's partly filled last block, which the caller
        copies (the returned (source, destination) pairs); `parent` is unchanged. OutOfBlocks, nothing
        taken, when the pool has too few blocks for the copies."""
        bs, length = self.pool.block_size, self.lengths[parent]
        for c in children:
            if self.blocks[c]:
                raise AssertionError(f"torchkvops: row {c} holds blocks: fork takes empty rows")
        full = length // bs
        shared = self.blocks[parent][:full]
        partial = length % bs != 0
        copies = []
        if partial:
            at = [self._at(c, full) for c in children]
            aside = sum(b is not None and self.pool.is_aside(b) for b in at)
            if len(children) - aside > self.pool.num_free:  # (nothing taken)
                raise OutOfBlocks(f"torchkvops: {len(children)} KV blocks wanted, {self.pool.num_free} free")
            copies = [self.pool.take(1, at=b)[0] for b in at]
        for i, c in enumerate(children):
            self.pool.share(shared)
            self.blocks[c] = list(shared) + ([copies[i]] if partial else [])
            self.lengths[c] = length
        return [(self.blocks[parent][full], dst) for dst in copies]

    def release(self, row: int) -> list[int]:
        """`row` ends: it gives back every block it holds (those no other row holds are returned) and is
        empty again."""
        freed = self.pool.give_back(self.blocks[row])
        self.blocks[row], self.lengths[row] = [], 0
        self.placed.pop(row, None)
        return freed

    def move_row(self, src: int, dst: int) -> None:
        """Row `dst` (empty) takes row `src`'s blocks and length; `src` is empty after."""
        if self.blocks[dst]:
            raise AssertionError(f"torchkvops: row {dst} holds blocks: a row moves into an empty one")
        self.blocks[dst], self.lengths[dst] = self.blocks[src], self.lengths[src]
        self.blocks[src], self.lengths[src] = [], 0
        self.placed.pop(dst, None)
        if src in self.placed:
            self.placed[dst] = self.placed.pop(src)

    def move_rows(self, order: list[int]) -> None:
        """Compaction: the rows are `order`'s rows from now on (row i is old row order[i]); the rows left
        out must have been released."""
        kept = set(order)
        for r in range(self.rows):
            if r not in kept and self.blocks[r]:
                raise AssertionError(f"torchkvops: row {r} still holds blocks but is left out of the batch")
        self.blocks = [self.blocks[r] for r in order]
        self.lengths = [self.lengths[r] for r in order]

    def slots(self, row: int, start: int, count: int) -> list[int]:
        """The pool slots (block * block_size + offset) of `row`'s tokens [start, start + count): where a
        write puts them."""
        bs, table = self.pool.block_size, self.blocks[row]
        if start + count > self.lengths[row] or start < 0:
            raise AssertionError(f"torchkvops: tokens [{start}, {start + count}) of row {row} have no block")
        return [table[t // bs] * bs + t % bs for t in range(start, start + count)]

    def tensor(
        self, device: torch.device | str = "cpu", out: Tensor | None = None, rows: list[int] | None = None
    ) -> Tensor:
        """The tables as paged_attention takes them: [rows, max_blocks] int32, a row's i-th block at i (0
        past its blocks: entries past its length are never read). Into `out` when given (a CUDA graph
        reads the same tensor). `rows`: those rows' tables only, in that order (None: every row)."""
        rows = range(self.rows) if rows is None else rows
        table = torch.zeros(len(rows), self.max_blocks, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(self.blocks[r])] = torch.tensor(self.blocks[r], dtype=torch.int32)
        if out is None:
            return table.to(device)
        out.copy_(table, non_blocking=True)
        return out

    def tokens_held(self) -> int:
        """The token slots of every block some row holds (shared blocks once)."""
        return self.pool.num_held * self.pool.block_size


class WindowBlocks:
    """A sliding-window pool's blocks beside a `BlockTables` of full-attention blocks (issue #52: "sliding-
    window groups return blocks that fall entirely out of the window").

    A sliding-window layer reads a row's keys less than `window` columns before its query; the rows' tables
    stay the full-attention layers' (one table a row, moved by compaction and admission as they are), and
    each table block some row still reads in its window has a block of this pool (`of[b]`; 0, the scratch
    block, where none). A forward reads a sliding layer's KV through `of[table]` (`paged_kv.window_table`):
    entries for blocks out of every holder's window name the scratch block, never read (the reads start at
    the window). `refs[b]`: the rows that hold table block b and still read it in their window (a prompt's
    block, shared by its samples, keeps its window block until the last of them slides past it); `first[row]`:
    the first of the row's table blocks it still reads. So a sliding layer holds about `window` tokens and
    one block per row, however long the rows grow.

    The store (`paged_store.PagedStore`) calls these after each change of the tables, with room in this
    pool made first, and uploads `of` when `changed` says it changed; nothing here touches a tensor."""

    def __init__(self, tables: BlockTables, pool: BlockPool, window: int):
        if window < 1:
            raise ValueError(f"torchkvops: a sliding window must be at least 1 token, got {window}")
        self.tables, self.pool, self.window = tables, pool, window
        if pool.take(1) != [0]:  # block 0: the scratch block, which entries out of every window name
            raise AssertionError("torchkvops: a window pool starts with every block free")
        self.of: list[int] = []
        self.refs: list[int] = []
        self.first = [0] * tables.rows
        self.changed = True  # `of` changed since the store last uploaded it

    def fit(self) -> None:
        """Entries for every block of the tables' pool (which grows)."""
        more = self.tables.pool.num_blocks - len(self.of)
        if more > 0:
            self.of += [0] * more
            self.refs += [0] * more

    def _hold(self, blocks: list[int]) -> None:
        """One more row reads each of `blocks` in its window (a window block taken for those none read)."""
        self.fit()
        for b in blocks:
            if not self.refs[b]:
                self.of[b] = self.pool.take(1)[0]
                self.changed = True
            self.refs[b] += 1

    def _drop(self, blocks: list[int]) -> None:
        """One row less reads each of `blocks` in its window (the window blocks none reads given back)."""
        for b in blocks:
            if self.refs[b] < 1:
                raise AssertionError(f"torchkvops: table block {b} left a window it was not in")
            self.refs[b] -= 1
            if not self.refs[b]:
                self.pool.give_back([self.of[b]])
                self.of[b] = 0
                self.changed = True

    def appended(self, row: int, new: list[int]) -> None:
        """`row` took table blocks `new` (its last ones)."""
        self._hold(new)

    def forked(self, parent: int, children: list[int], copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """`children` continue `parent` (`BlockTables.fork` returned `copies`): each reads the parent's blocks
        from the parent's first on. Returns the window pool's block copies (source, destination)."""
        self.fit()
        fresh = {dst for _, dst in copies}
        for c in children:
            self.first[c] = self.first[parent]
            self._hold([b for b in self.tables.blocks[c][self.first[c] :] if b not in fresh])
        self._hold(sorted(fresh))
        return [(self.of[src], self.of[dst]) for src, dst in copies]

    def released(self, row: int) -> None:
        """`row` is about to give back its table blocks (call before `BlockTables.release`)."""
        self._drop(self.tables.blocks[row][self.first[row] :])
        self.first[row] = 0

    def slide(self, row: int, column: int) -> None:
        """`row` writes its next token at `column`: the blocks wholly before that token's window are read
        no more (by this row)."""
        keep_from = min(max(0, column + 1 - self.window) // self.pool.block_size, len(self.tables.blocks[row]))
        if keep_from > self.first[row]:
            self._drop(self.tables.blocks[row][self.first[row] : keep_from])
            self.first[row] = keep_from

    def moved(self, src: int, dst: int) -> None:
        """`BlockTables.move_row(src, dst)` was made."""
        self.first[dst], self.first[src] = self.first[src], 0
