"""The paged KV bookkeeping (torchkvops.rollout.block_pool) without a model: blocks taken and given back,
shared prompt blocks freed last, sliding windows, compaction, and the tables as paged_attention reads them
(the operator itself is the oracle for what a table means)."""

import random

import pytest
import torch

from torchkvops import ops
from torchkvops.rollout.block_pool import BlockPool, BlockTables, OutOfBlocks, WindowBlocks, blocks_for


def test_blocks_are_taken_once_and_every_one_comes_back():
    pool = BlockPool(8, 4)
    a, b = pool.take(3), pool.take(5)
    assert sorted(a + b) == list(range(8)) and pool.num_free == 0
    with pytest.raises(OutOfBlocks, match="1 KV blocks wanted, 0 of 8 free"):
        pool.take(1)
    assert pool.give_back(a) == a and pool.num_free == 3
    assert pool.take(3) == a[::-1]  # the last given back is taken first
    with pytest.raises(AssertionError, match="given back while free"):
        pool.give_back(pool.give_back(b)[:1])


def test_a_failed_take_takes_nothing():
    pool = BlockPool(4, 2)
    tables = BlockTables(pool, rows=2, max_blocks=8)
    tables.append(0, 5)  # 3 blocks
    with pytest.raises(OutOfBlocks):
        tables.append(1, 3)  # needs 2, 1 free
    assert pool.num_free == 1 and tables.blocks[1] == [] and tables.lengths[1] == 0


def test_append_takes_a_block_only_when_the_last_one_is_full():
    pool = BlockPool(16, 4)
    tables = BlockTables(pool, rows=1, max_blocks=4)
    taken = [len(tables.append(0, 1)) for _ in range(9)]
    assert taken == [1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert tables.lengths[0] == 9 and len(tables.blocks[0]) == blocks_for(9, 4) == 3
    with pytest.raises(ValueError, match="more than its table's 4 blocks of 4"):
        tables.append(0, 8)


@pytest.mark.parametrize("prompt_len", [8, 10])
def test_samples_share_the_prompts_full_blocks_and_copy_its_partial_one(prompt_len):
    pool = BlockPool(32, 4)
    tables = BlockTables(pool, rows=4, max_blocks=8)
    tables.append(0, prompt_len)
    copies = tables.fork(0, [1, 2, 3])
    full = prompt_len // 4
    for child in (1, 2, 3):
        assert tables.blocks[child][:full] == tables.blocks[0][:full] and tables.lengths[child] == prompt_len
    assert all(pool.refs[b] == 4 for b in tables.blocks[0][:full])
    if prompt_len % 4:
        assert copies == [(tables.blocks[0][full], tables.blocks[c][full]) for c in (1, 2, 3)]
        assert len({tables.blocks[c][full] for c in range(4)}) == 4  # each row its own last block
    else:
        assert copies == []
    # The samples write their own tokens: none lands in a block another row holds.
    for child in (1, 2, 3):
        tables.append(child, 6)
    written = [set(tables.slots(c, prompt_len, 6)) for c in (1, 2, 3)]
    assert not (written[0] & written[1]) and not (written[1] & written[2]) and not (written[0] & written[2])
    # The prompt's row ends first: its shared blocks stay until the last sample gives them back.
    tables.release(0)
    for child in (1, 2):
        tables.release(child)
        pool.check_held(tables.blocks[3])
    tables.release(3)
    assert pool.num_free == pool.num_blocks


def test_a_block_given_back_is_caught_when_a_table_still_names_it():
    pool = BlockPool(4, 2)
    tables = BlockTables(pool, rows=2, max_blocks=4)
    tables.append(0, 4)
    read = list(tables.blocks[0])
    epochs = [pool.epoch[b] for b in read]
    tables.release(0)
    tables.append(1, 4)  # takes the same blocks again
    with pytest.raises(AssertionError, match="given back but a row still reads it"):
        pool.check_held(read, epochs)


def test_compaction_moves_tables_not_kv_and_refuses_to_drop_a_row_that_holds_blocks():
    pool = BlockPool(16, 4)
    tables = BlockTables(pool, rows=3, max_blocks=4)
    for r, n in enumerate((3, 9, 5)):
        tables.append(r, n)
    before = [list(b) for b in tables.blocks]
    with pytest.raises(AssertionError, match="row 1 still holds blocks"):
        tables.move_rows([2, 0])
    tables.release(1)
    tables.move_rows([2, 0])
    assert tables.blocks == [before[2], before[0]] and tables.lengths == [5, 3]


def test_a_grown_pool_keeps_its_blocks_and_frees_the_new_ones():
    pool = BlockPool(2, 4)
    held = pool.take(2)
    pool.grow(5)
    assert pool.refs[:2] == [1, 1] and pool.num_free == 3
    assert sorted(pool.take(3)) == [2, 3, 4]
    pool.give_back(held)
    with pytest.raises(ValueError, match="cannot shrink"):
        pool.grow(1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_random_workload_returns_every_block_and_never_shares_a_written_slot(block_size):
    """Rows start (some forked from a prompt row), grow and end at random; at every point each
    slot a row may write belongs to that row alone, and at the end every block is free."""
    rng = random.Random(block_size)
    pool = BlockPool(400, block_size)
    tables = BlockTables(pool, rows=12, max_blocks=200)
    live: set[int] = set()
    for _ in range(600):
        r = rng.randrange(12)
        if r not in live:
            try:
                tables.append(r, rng.randrange(1, 30))
            except OutOfBlocks:
                continue
            live.add(r)
            kids = [c for c in range(12) if c not in live][: rng.randrange(0, 3)]
            try:
                tables.fork(r, kids)
            except OutOfBlocks:
                continue
            live |= set(kids)
        elif rng.random() < 0.1:
            tables.release(r)
            live.discard(r)
        else:
            try:
                tables.append(r, 1)
            except (OutOfBlocks, ValueError):
                tables.release(r)
                live.discard(r)
                continue
            mine = tables.blocks[r][-1]  # the block the row writes into
            assert pool.refs[mine] == 1, "a row writes into a block another row reads"
    for r in list(live):
        tables.release(r)
    assert pool.num_free == pool.num_blocks and all(ref == 0 for ref in pool.refs)


@pytest.mark.parametrize("block_size, window", [(4, 10), (16, 16), (1, 3)])
def test_a_window_pool_holds_each_rows_window_and_gives_every_block_back(block_size, window):
    """Prompts are forked to samples that grow a token at a time (sliding before each write, as the decode
    loop does), end at random and move; the oracle is each live row's window counted from its column:
    every table block holding a key some row still reads has a window block of its own (two table blocks
    never share one), the pool holds no block no row reads, and every block comes back."""
    rng = random.Random(block_size * window)
    rows = 12
    pool = BlockPool(1000, block_size)
    tables = BlockTables(pool, rows=rows, max_blocks=400)
    windows = WindowBlocks(tables, BlockPool(1000, block_size), window)
    written = [0] * rows  # the column each row writes next
    live: set[int] = set()
    for _ in range(800):
        r = rng.randrange(rows)
        if r not in live:
            prompt = rng.randrange(1, 40)
            windows.appended(r, tables.append(r, prompt))
            kids = [c for c in range(rows) if c not in live and c != r][: rng.randrange(0, 4)]
            copies = tables.fork(r, kids)
            assert len(windows.forked(r, kids, copies)) == len(copies)
            for row in (r, *kids):
                written[row] = prompt
                live.add(row)
                windows.slide(row, prompt)  # (the decode loop's first stretch)
        elif rng.random() < 0.08:
            windows.released(r)
            tables.release(r)
            live.discard(r)
        elif rng.random() < 0.05 and len(live) < rows:  # a row moves to an empty one (fork_prompts' move)
            dst = next(c for c in range(rows) if c not in live)
            tables.move_row(r, dst)
            windows.moved(r, dst)
            written[dst] = written[r]
            live.discard(r)
            live.add(dst)
        else:
            windows.slide(r, written[r])
            if tables.lengths[r] <= written[r]:
                windows.appended(r, tables.append(r, 1))
            written[r] += 1
        read = set()  # the table blocks of the keys some live row's next query reads
        for row in live:
            first = max(0, written[row] + 1 - window)
            read |= {tables.blocks[row][t // block_size] for t in range(first, written[row])}
        assert all(windows.of[b] for b in read), "a key a row reads has no window block"
        assert len({windows.of[b] for b in read}) == len(read)
        held = {b for b in range(len(windows.of)) if windows.of[b]}
        # The only extra blocks: a row's last one before it writes into it, and one a row straddles.
        assert read <= held and len(held - read) <= len(live)
        assert windows.pool.num_held == len(held) + 1  # (+ the scratch block)
    for r in list(live):
        windows.released(r)
        tables.release(r)
    assert windows.pool.num_free == windows.pool.num_blocks - 1 and not any(windows.of)


def test_the_tables_tensor_is_what_paged_attention_reads():
    """Rows forked from one prompt and grown to ragged lengths, their KV written slot by slot into a pool
    tensor: paged_attention over the tables equals softmax attention over each row's tokens."""
    torch.manual_seed(0)
    bs, heads, dim = 4, 2, 8
    pool = BlockPool(64, bs)
    tables = BlockTables(pool, rows=3, max_blocks=16)
    kv = torch.zeros(2, pool.num_blocks, heads, bs, dim)  # [K/V, blocks, kv_heads, block_size, head_dim]
    rows_kv = [[] for _ in range(3)]

    def write(row, start, keys):
        for slot, k in zip(tables.slots(row, start, len(keys)), keys):
            kv[:, slot // bs, :, slot % bs] = k
        rows_kv[row] += list(keys)

    tables.append(0, 6)
    write(0, 0, torch.randn(6, 2, heads, dim).unbind(0))
    for src, dst in tables.fork(0, [1, 2]):
        kv[:, dst].copy_(kv[:, src])
    rows_kv[1], rows_kv[2] = list(rows_kv[0]), list(rows_kv[0])
    for row, extra in ((0, 1), (1, 7), (2, 13)):
        start = tables.lengths[row]
        tables.append(row, extra)
        write(row, start, torch.randn(extra, 2, heads, dim).unbind(0))
    q = torch.randn(3, heads, dim)
    lengths = torch.tensor(tables.lengths, dtype=torch.int32)
    out, _ = ops.paged_attention(q, kv[0], kv[1], tables.tensor(), lengths)
    for row in range(3):
        k = torch.stack([t[0] for t in rows_kv[row]], 1)  # [heads, tokens, dim]
        v = torch.stack([t[1] for t in rows_kv[row]], 1)
        expected = torch.softmax(q[row, :, None] @ k.transpose(1, 2) * dim**-0.5, -1) @ v
        torch.testing.assert_close(out[row], expected[:, 0])


def test_blocks_set_aside_go_only_to_the_rows_placed_on_them_and_come_back_after():
    """A run set aside (`set_aside`) is taken by the rows placed on it (`BlockTables.place`: a prompt's
    blocks where a stacked read views them), never by other rows' takes; what is left of it is free again
    after `put_back_aside`; a run that holds a block cannot be set aside."""
    pool = BlockPool(16, 4)
    tables = BlockTables(pool, rows=6, max_blocks=6)
    assert pool.take(1) == [0]  # (the scratch block)
    assert not pool.set_aside([0, 1, 2])  # block 0 is held: nothing set aside
    assert pool.num_free == 15
    assert pool.set_aside(list(range(4, 12)))  # two prompts' runs of 4 blocks (3 whole and room for one)
    assert pool.num_free == 7 and pool.num_held == 1  # (blocks set aside are neither free nor held)
    tables.place(0, 4, 0)
    tables.place(1, 8, 0)
    assert tables.append(0, 14) == [4, 5, 6, 7]  # 3 whole blocks and a partly filled one
    assert tables.append(1, 12) == [8, 9, 10]
    assert tables.append(2, 8) == [1, 2]  # an unplaced row: the free blocks outside the runs
    copies = tables.fork(1, [3, 4])  # (12 tokens: no partly filled block to copy)
    assert copies == [] and tables.blocks[3] == [8, 9, 10]
    pool.put_back_aside()
    assert pool.take(1) == [11]  # the run's untaken block, free again (taken first)
    for row in range(5):
        tables.release(row)
    pool.give_back([0, 11])
    assert pool.num_free == pool.num_blocks


def test_a_placed_fork_copies_the_partial_block_into_the_childs_run():
    """A common prefix's partly filled block copied to each prompt's row at that row's place (its run's
    first block), while the whole blocks stay shared."""
    pool = BlockPool(16, 4)
    tables = BlockTables(pool, rows=3, max_blocks=6)
    pool.take(1)
    tables.append(0, 6)  # the common prefix: block 1 whole, block 2 partly filled
    assert tables.blocks[0] == [1, 2]
    assert pool.set_aside([5, 6, 7, 8, 9, 10, 11])  # runs of 3 from block 2: row 0 holds its first
    for row in range(3):
        tables.place(row, 2 + 3 * row, 1)
    assert tables.fork(0, [1, 2]) == [(2, 5), (2, 8)]
    assert tables.blocks[1] == [1, 5] and tables.blocks[2] == [1, 8]
    assert tables.append(2, 6) == [9]  # 12 tokens: its run's second block
    pool.set_aside([])  # (an empty run: nothing)
    assert pool.take(1) == [3]  # an unplaced take: outside the runs
