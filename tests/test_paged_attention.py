"""paged_attention: decode attention over a pool of KV blocks, reading only the keys each row has written.

Oracles: dense attention (SDPA in float64) over each row's keys laid out contiguously, and
torchkvops.reference.paged_attention (row by row, gathered from the blocks). Cases: ragged lengths
(0, 1, a block's edge, several partitions of 256 keys), shuffled and shared blocks, grouped-query heads
(up to more heads per KV head than a task takes), block sizes 1 to 32, windows, per-head query
positions (a shared prompt's level), softcapping, every dtype; the merge with a second level equals
attention over both; the partitions past a row's length are never read; opcheck; torch.compile; an error
naming the argument for bad input. The CPU kernel runs the CUDA kernel's algorithm in its order
(csrc/paged_attention.h), so these CPU cases test the CUDA kernel's row logic too; the CUDA param runs
the kernel itself.
"""

from __future__ import annotations

import math

import pytest
import torch
from devices import DEVICES

import torchkvops
from torchkvops import reference

OP = torch.ops.torchkvops.paged_attention.default
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def paged_case(
    lens,
    heads=4,
    kv_heads=2,
    head_dim=16,
    block_size=4,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    spare_blocks=3,
    extra_table=1,
):
    """(query, key_cache, value_cache, block_tables, seq_lens) for rows of `lens` keys: each row's blocks
    drawn at random from a pool with `spare_blocks` more than needed (which hold NaN: a read of one shows),
    tables `extra_table` entries longer than needed (filled with -1: never read)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lens)
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g)
    key_cache = torch.full((num_blocks, kv_heads, block_size, head_dim), float("nan"), dtype=torch.float64)
    value_cache = key_cache.clone()
    max_blocks = max(need + [0]) + extra_table
    tables = torch.full((rows, max_blocks), -1, dtype=torch.int32)
    taken = 0
    for r, n in enumerate(lens):
        blocks = order[taken : taken + need[r]]
        taken += need[r]
        tables[r, : need[r]] = blocks.int()
        for j, b in enumerate(blocks.tolist()):
            used = min(block_size, n - j * block_size)
            key_cache[b, :, :used] = torch.randn(kv_heads, used, head_dim, generator=g, dtype=torch.float64)
            value_cache[b, :, :used] = torch.randn(kv_heads, used, head_dim, generator=g, dtype=torch.float64)
    query = torch.randn(rows, heads, head_dim, generator=g, dtype=torch.float64) * 2
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), tables, seq_lens))


def dense(
    query, key_cache, value_cache, tables, seq_lens, positions=None, window=0, softcap=0.0, scale=None, starts=None
):
    """Attention in float64 over each row's keys [start, length) laid out contiguously, masked by position and
    window."""
    rows, heads, dim = query.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    scale = dim**-0.5 if scale is None else scale
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float64)
    for r in range(rows):
        n = int(seq_lens[r])
        first = 0 if starts is None else int(starts[r])
        if n == first:
            continue
        t = torch.arange(first, n)
        b = tables[r, t // block_size].long().cpu()
        k = key_cache.cpu()[b, :, t % block_size].double().repeat_interleave(heads // kv_heads, dim=1)
        v = value_cache.cpu()[b, :, t % block_size].double().repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("hd,thd->ht", query[r].double().cpu(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.full((heads,), n - 1) if positions is None else positions[r].cpu()
        seen = (t[None] <= pos[:, None]) & ((pos[:, None] - t[None] < window) if window else True)
        s = s.masked_fill(~seen, float("-inf"))
        some = seen.any(dim=1)
        lse[r] = torch.where(some, torch.logsumexp(s, dim=1), float("-inf"))
        out[r] = torch.einsum("ht,thd->hd", torch.softmax(s, dim=1).nan_to_num(0.0), v)
    return out, lse


def assert_matches(got, want, dtype):
    out, lse = got
    tol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), want[1], rtol=1e-5, atol=1e-5)


LENGTHS = {
    "one key": [1],
    "ragged": [0, 1, 3, 4, 5, 17],
    "block edges": [8, 16, 7, 9],
    "partitions": [255, 256, 257, 600],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_equals_dense_attention_over_each_rows_keys(device, dtype, lengths):
    args = paged_case(LENGTHS[lengths], dtype=dtype, device=device, seed=len(lengths))
    got = torchkvops.paged_attention(*args)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32 and got[0].is_contiguous()
    assert_matches(got, dense(*args), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(1, 1, 1, 1), (8, 1, 64, 16), (20, 2, 24, 3), (6, 6, 128, 32), (4, 2, 256, 8), (12, 4, 7, 5)],
)
def test_grouped_heads_head_sizes_and_block_sizes(device, heads, kv_heads, head_dim, block_size):
    """Up to 10 query heads per KV head (more than the 8 a task takes: two chunks), odd head sizes (the dot
    product's lanes), block sizes from 1."""
    args = paged_case(
        [5, 0, 40, 300], heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, device=device
    )
    assert_matches(torchkvops.paged_attention(*args), dense(*args), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 3, 8, 300])
def test_a_sliding_window_sees_only_the_last_keys(device, window):
    args = paged_case([1, 6, 20, 520], device=device, seed=window)
    assert_matches(torchkvops.paged_attention(*args, window=window), dense(*args, window=window), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_query_positions_per_head_as_a_shared_prompt_level_reads_them(device):
    """Stacked queries of the rows that share a prompt (their own positions past it) against its blocks;
    a position inside the keys sees only those up to it; with a window the far ones drop out; positions
    with stride 0 (one per row, expanded over heads) are read in place."""
    query, k, v, tables, lens = paged_case([10, 10, 300], heads=4, kv_heads=2, device=device, seed=3)
    positions = torch.tensor([[10, 12, 15, 40], [3, 9, 0, 5], [300, 301, 700, 299]], device=device)
    for window in (0, 6, 100):
        got = torchkvops.paged_attention(query, k, v, tables, lens, positions, window=window)
        assert_matches(got, dense(query, k, v, tables, lens, positions, window=window), torch.float32)
    per_row = torch.tensor([11, 2, 280], device=device)[:, None].expand(-1, 4)
    got = torchkvops.paged_attention(query, k, v, tables, lens, per_row, window=5)
    assert_matches(got, dense(query, k, v, tables, lens, per_row, window=5), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softcapped_scores_and_a_given_scale(device, dtype):
    args = paged_case([3, 70, 260], dtype=dtype, device=device, seed=5)
    got = torchkvops.paged_attention(*args, scale=0.7, softcap=2.5)
    assert_matches(got, dense(*args, scale=0.7, softcap=2.5), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_equals_the_reference(device):
    args = paged_case([0, 9, 33, 258], heads=6, kv_heads=3, device=device, seed=6)
    positions = torch.tensor([[0] * 6, [8] * 6, [40] * 6, [257] * 6], device=device)
    got = torchkvops.paged_attention(*args, positions, window=20, softcap=3.0)
    want = reference.paged_attention(*(a.cpu() for a in args), positions.cpu(), window=20, softcap=3.0)
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_two_levels_merged_equal_attention_over_both(device):
    """A prompt's blocks shared by its rows (one table for the level, read with each row's position) and
    each row's own blocks: merge_attention_states of the two equals attention over prompt + own keys."""
    prompt, rows = 37, 3
    query, k, v, tables, lens = paged_case([prompt] + [5, 0, 300], heads=4, kv_heads=2, device=device, seed=7)
    shared = tables[:1].expand(rows, -1)
    own = (torch.tensor([5, 0, 300], device=device) + prompt - 1)[:, None].expand(-1, 4)
    level_prompt = torchkvops.paged_attention(query[1:], k, v, shared, lens[:1].expand(rows), own)
    level_own = torchkvops.paged_attention(query[1:], k, v, tables[1:], lens[1:])
    out, lse = torchkvops.merge_attention_states(*level_prompt, *level_own)
    # The oracle: each row's keys = the prompt's blocks then its own.
    block = k.shape[2]
    want_out, want_lse = [], []
    for r in range(rows):
        n_own = int(lens[1 + r])
        keys = [(int(tables[0, t // block]), t % block) for t in range(prompt)]
        keys += [(int(tables[1 + r, t // block]), t % block) for t in range(n_own)]
        kk = torch.stack([k[b, :, s] for b, s in keys]).double().cpu().repeat_interleave(2, dim=1)
        vv = torch.stack([v[b, :, s] for b, s in keys]).double().cpu().repeat_interleave(2, dim=1)
        scores = torch.einsum("hd,thd->ht", query[1 + r].double().cpu(), kk) / math.sqrt(k.shape[-1])
        want_lse.append(torch.logsumexp(scores, dim=1))
        want_out.append(torch.einsum("ht,thd->hd", torch.softmax(scores, dim=1), vv))
    torch.testing.assert_close(out.double().cpu(), torch.stack(want_out), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse.double().cpu(), torch.stack(want_lse), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_reads_only_the_keys_written(device):
    """Every slot past a row's length, every spare block and every table entry past its last block holds
    NaN or -1: any read of one would show in the output."""
    args = paged_case([3, 260, 1], block_size=8, spare_blocks=20, extra_table=40, device=device, seed=8)
    out, lse = torchkvops.paged_attention(*args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_matches((out, lse), dense(*args), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_that_sees_no_key_is_an_empty_part(device):
    query, k, v, tables, lens = paged_case([0, 4], device=device)
    positions = torch.tensor([[5] * 4, [-1] * 4], device=device)  # the second row's query precedes its keys
    out, lse = torchkvops.paged_attention(query, k, v, tables, lens, positions)
    assert torch.equal(out.cpu(), torch.zeros_like(out).cpu())
    assert torch.equal(lse.cpu(), torch.full_like(lse, float("-inf")).cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_strided_caches_as_a_pools_layer_views_are_read_in_place(device):
    """One layer's K and V of a [blocks, layers, 2, kv_heads, block_size, head_dim] pool (strided blocks), a
    query view [rows, heads, head_dim] of a [heads, rows, head_dim] buffer."""
    query, k, v, tables, lens = paged_case([4, 30, 9], device=device, seed=9)
    pool = torch.zeros(k.shape[0], 2, 2, *k.shape[1:], dtype=k.dtype, device=device)  # [blocks, layers, 2, ...]
    pool[:, 1, 0], pool[:, 1, 1] = k, v
    q_view = query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not pool[:, 1, 0].is_contiguous() and not q_view.is_contiguous()
    got = torchkvops.paged_attention(q_view, pool[:, 1, 0], pool[:, 1, 1], tables, lens)
    assert_matches(got, dense(query, k, v, tables, lens), torch.float32)


def with_starts(args, starts):
    """`args` (a paged_case) whose rows start at `starts`: the keys before each start are NaN and the table
    entries of the blocks wholly before it -1, so that a read of either shows; the starts as int32."""
    query, k, v, tables, lens = (t.clone() for t in args)
    block_size = k.shape[2]
    for r, first in enumerate(starts):
        for t in range(first):
            b = int(tables[r, t // block_size])
            k[b, :, t % block_size] = float("nan")
            v[b, :, t % block_size] = float("nan")
        tables[r, : first // block_size] = -1
    return (query, k, v, tables, lens), torch.tensor(starts, dtype=torch.int32, device=query.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_from_their_start_only(device, dtype):
    """A row's keys before its start (a left-padded prompt's padding) are never read, whole partitions of
    them skipped; a row whose start is its length sees no key."""
    lens, starts = [9, 17, 600, 300, 5, 260], [3, 0, 300, 257, 5, 256]
    args, seq_starts = with_starts(paged_case(lens, dtype=dtype, device=device, seed=21), starts)
    got = torchkvops.paged_attention(*args, seq_starts=seq_starts)
    assert_matches(got, dense(*args, starts=starts), dtype)
    assert got[1][4].eq(float("-inf")).all() and got[0][4].eq(0).all()
    want = reference.paged_attention(*(a.cpu() for a in args), seq_starts=seq_starts.cpu())
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_starts_with_windows_positions_and_softcap(device):
    query, k, v, tables, lens = paged_case([40, 20, 300], heads=4, kv_heads=2, device=device, seed=22)
    (query, k, v, tables, lens), starts = with_starts((query, k, v, tables, lens), [10, 19, 100])
    positions = (lens.long() - 1)[:, None].expand(-1, 4).clone()
    positions[0] = torch.tensor([39, 30, 12, 9])  # the last: before the row's start (sees nothing)
    got = torchkvops.paged_attention(query, k, v, tables, lens, positions, window=25, softcap=2.0, seq_starts=starts)
    want = dense(query, k, v, tables, lens, positions, window=25, softcap=2.0, starts=[10, 19, 100])
    assert_matches(got, want, torch.float32)


def test_the_cpu_kernel_raises_for_starts_outside_the_rows_keys():
    query, k, v, tables, lens = paged_case([4, 6], block_size=4)
    for starts, match in (
        ([0, 7], r"seq_starts\[1\] = 7 is outside \[0, seq_lens\[1\] = 6\]"),
        ([-1, 0], "seq_starts"),
    ):
        with pytest.raises(ValueError, match="paged_attention: " + match):
            torchkvops.paged_attention(query, k, v, tables, lens, seq_starts=torch.tensor(starts, dtype=torch.int32))
    with pytest.raises(TypeError, match="paged_attention: seq_starts must be int32"):
        torchkvops.paged_attention(query, k, v, tables, lens, seq_starts=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"paged_attention: seq_starts must be \[rows\]"):
        torchkvops.paged_attention(query, k, v, tables, lens, seq_starts=torch.zeros(3, dtype=torch.int32))


def test_the_cpu_kernel_raises_for_lengths_and_blocks_outside_the_table_and_pool():
    query, k, v, tables, lens = paged_case([4, 6], block_size=4)
    with pytest.raises(ValueError, match=r"paged_attention: seq_lens\[1\] = 13 is outside \[0, 12\]"):
        torchkvops.paged_attention(query, k, v, tables, torch.tensor([4, 13], dtype=torch.int32))
    bad = tables.clone()
    bad[1, 1] = k.shape[0]
    with pytest.raises(ValueError, match=r"paged_attention: block_tables\[1\]\[1\] = \d+ is not a block of the pool"):
        torchkvops.paged_attention(query, k, v, bad, lens)


BAD = {
    "query 2-D": (lambda a: (a[0][0], *a[1:]), ValueError, "query must be 3-D"),
    "int query": (lambda a: (a[0].long(), *a[1:]), TypeError, "query dtype"),
    "cache dtype": (lambda a: (a[0], a[1].half(), *a[2:]), TypeError, "key_cache must have query's dtype"),
    "cache 3-D": (lambda a: (a[0], a[1][0], *a[2:]), ValueError, "key_cache must be 4-D"),
    "value shape": (lambda a: (a[0], a[1], a[2][:1], *a[3:]), ValueError, "value_cache must have key_cache's shape"),
    "heads": (lambda a: (a[0][:, :3], *a[1:]), ValueError, r"query's heads \(3\) must be a multiple"),
    "table dtype": (lambda a: (*a[:3], a[3].long(), a[4]), TypeError, "block_tables must be int32"),
    "table rows": (lambda a: (*a[:3], a[3][:1], a[4]), ValueError, "block_tables must be"),
    "lens dtype": (lambda a: (*a[:4], a[4].long()), TypeError, "seq_lens must be int32"),
    "lens rows": (lambda a: (*a[:4], a[4][:1]), ValueError, "seq_lens must be"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_are_named(case):
    make, error, match = BAD[case]
    with pytest.raises(error, match="paged_attention: " + match):
        torchkvops.paged_attention(*make(paged_case([3, 5])))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(window=-1), ValueError, "window must be >= 0"),
        (dict(softcap=-1.0), ValueError, "softcap must be >= 0"),
        (dict(scale=float("nan")), ValueError, "scale must be finite"),
    ],
)
def test_bad_settings_are_named(kwargs, error, match):
    with pytest.raises(error, match="paged_attention: " + match):
        torchkvops.paged_attention(*paged_case([3]), **kwargs)


def test_positions_of_another_shape_or_dtype_are_named():
    args = paged_case([3, 5])
    with pytest.raises(ValueError, match=r"query_positions must be \[rows, heads\]"):
        torchkvops.paged_attention(*args, torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="query_positions must be int64"):
        torchkvops.paged_attention(*args, torch.zeros(2, 4, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    samples = [
        paged_case([3, 0, 9], device=device),
        paged_case([300], heads=8, kv_heads=1, head_dim=32, block_size=16, dtype=torch.bfloat16, device=device),
        paged_case([1, 2], heads=2, kv_heads=2, head_dim=5, block_size=1, dtype=torch.float16, device=device),
    ]
    for args in samples:
        torch.library.opcheck(OP, (*args, None, 0.25, 0, 0.0))
    query, k, v, tables, lens = samples[0]
    positions = torch.tensor([[2] * 4, [0] * 4, [8] * 4], device=device)
    torch.library.opcheck(OP, (query, k, v, tables, lens, positions, 0.5, 3, 2.0))
    starts = torch.tensor([1, 0, 4], dtype=torch.int32, device=device)
    torch.library.opcheck(OP, (query, k, v, tables, lens, positions, 0.5, 3, 2.0, starts))


def test_compiled_equals_eager():
    args = paged_case([3, 40, 260], seed=11)

    def f(q, k, v, t, n):
        out, lse = torchkvops.paged_attention(q, k, v, t, n, window=50)
        return out * 2, lse

    want = f(*args)
    got = torch.compile(f, fullgraph=True, dynamic=False)(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_cuda_graph_serves_every_length_without_a_host_sync():
    """Lengths and tables are data: a graph captured once, replayed after the rows grew (new lengths, new
    blocks in their tables, written in place), equals the eager op on the new values; no host sync."""
    query, k, v, tables, lens = paged_case(
        [3, 40, 0, 250], block_size=8, spare_blocks=60, extra_table=40, device="cuda"
    )
    k.copy_(torch.randn_like(k))  # (every slot written: the rows grow into their blocks' empty slots)
    v.copy_(torch.randn_like(v))
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torchkvops.paged_attention(query, k, v, tables, lens)  # (warm-up on the side stream)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = torchkvops.paged_attention(query, k, v, tables, lens)
    spare = [b for b in range(k.shape[0]) if b not in set(tables[tables >= 0].tolist())]
    for new_lens in ([4, 41, 1, 251], [9, 200, 17, 500]):
        for r, n in enumerate(new_lens):  # give each row the blocks its new length needs, and fresh keys
            for j in range(-(-n // 8)):
                if int(tables[r, j]) < 0:
                    tables[r, j] = spare.pop()
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = torchkvops.paged_attention(query, k, v, tables, lens)
        torch.testing.assert_close((out, lse), want, rtol=0, atol=0)
        assert_matches((out, lse), dense(query, k, v, tables, lens), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_windows_that_begin_at_and_across_partition_edges(device):
    """Under a window a task skips the partitions wholly before its queries' windows: a window that begins
    exactly at a partition's first key, one key after it, and heads of one task whose windows begin in other
    partitions (per-head positions) give the dense oracle's attention."""
    query, k, v, tables, lens = paged_case([600, 600, 513, 256], heads=4, kv_heads=2, device=device, seed=23)
    for window in (88, 87, 257, 1):
        assert_matches(
            torchkvops.paged_attention(query, k, v, tables, lens, window=window),
            dense(query, k, v, tables, lens, window=window),
            torch.float32,
        )
    positions = (lens.long() - 1)[:, None].expand(-1, 4).clone()
    positions[0] = torch.tensor([599, 300, 511, 256])  # one KV head's two queries: windows in partitions 2 and 1
    got = torchkvops.paged_attention(query, k, v, tables, lens, positions, window=100)
    assert_matches(got, dense(query, k, v, tables, lens, positions, window=100), torch.float32)
