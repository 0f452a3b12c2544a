"""Time torchkvops.paged_attention against SDPA on the same rows, as a decode step reads them.

Rows hold spread lengths (log-normal around --mean-length, capped at --capacity, the budget a dense
engine allocates each row); each row's keys lie in blocks of --block-size drawn at random from a pool.
Three ways to compute one decode step's attention (grouped-query heads, one query per row):

  paged        torchkvops.paged_attention over the pool, through each row's block table: reads the keys
               each row has written and nothing else
  sdpa-dense   SDPA over a [rows, kv_heads, capacity, head_dim] buffer with an additive mask of the
               buffer's width: what a dense engine's decode does today (reads every row at its capacity)
  sdpa-exact   SDPA over a buffer as wide as the longest row (a dense engine that grows with its rows:
               the best a padded layout can do)

With --window W each query sees its row's last W keys only (a sliding-window layer): paged reads those
(the partitions wholly before the window are skipped), the SDPA methods mask the rest.

All three are checked against each other before timing. Warm-up runs are excluded; the methods are
timed in interleaved rounds (paged, sdpa-dense, sdpa-exact, paged, ...) on one clock (CUDA events with a
synchronize around each on CUDA), and the median of --iters rounds is printed with the bytes of K and V
each reads (GB/s = those bytes / median time) and the ratio to paged.

Example: .venv/bin/python benchmarks/bench_paged_attention.py --device cpu --rows 16 --capacity 2048 7936
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import torchkvops
from torchkvops.bench.op import add_device_arguments, device_from, time_methods

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def lengths_of(rows: int, mean: int, capacity: int, seed: int) -> list[int]:
    """Log-normal lengths (sigma 1) with median `mean`, each in [1, capacity]."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(rows, generator=g)) * mean
    return [int(min(max(x, 1), capacity)) for x in raw.tolist()]


def case(rows, heads, kv_heads, head_dim, block_size, capacity, lengths, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-capacity // block_size)
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 1
    order = torch.randperm(num_blocks, generator=g)
    key_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(device, dtype)
    value_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g).to(device, dtype)
    tables = torch.zeros(rows, max_blocks, dtype=torch.int32)
    taken = 0
    for r, n in enumerate(need):
        tables[r, :n] = order[taken : taken + n].int()
        taken += n
    tables = tables.to(device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    query = torch.randn(rows, heads, head_dim, generator=g).to(device, dtype)
    return query, key_cache, value_cache, tables, seq_lens


def dense_buffers(key_cache, value_cache, tables, lengths, width, window=0):
    """[rows, kv_heads, width, head_dim] K and V with each row's keys first, and the additive mask (with a
    `window`: each row's last `window` keys only)."""
    rows = tables.shape[0]
    kv_heads, block_size, head_dim = key_cache.shape[1:]
    k = key_cache.new_zeros(rows, kv_heads, width, head_dim)
    v = value_cache.new_zeros(rows, kv_heads, width, head_dim)
    for r, n in enumerate(lengths):
        t = torch.arange(n, device=key_cache.device)
        b = tables[r, t // block_size].long()
        k[r, :, :n] = key_cache[b, :, t % block_size].transpose(0, 1)
        v[r, :, :n] = value_cache[b, :, t % block_size].transpose(0, 1)
    column = torch.arange(width, device=key_cache.device)[None, :]
    length = torch.tensor(lengths, device=key_cache.device)[:, None]
    seen = (column < length) & ((length - 1 - column < window) if window else True)
    mask = torch.zeros(rows, 1, 1, width, dtype=key_cache.dtype, device=key_cache.device)
    return k, v, mask.masked_fill(~seen[:, None, None, :], float("-inf"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(p)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mean-length", type=int, default=300, help="median row length (log-normal, sigma 1)")
    p.add_argument("--capacity", type=int, nargs="+", default=[512, 2048, 7936], help="each row's budget")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--window", type=int, default=0, help="a sliding window (0: none)")
    args = p.parse_args(argv)
    device = device_from(args)
    dtype = DTYPES[args.dtype]
    per_kv = args.heads // args.kv_heads
    print(
        f"device={device} threads={torch.get_num_threads()} dtype={args.dtype} rows={args.rows} heads={args.heads} "
        f"kv_heads={args.kv_heads} head_dim={args.head_dim} block_size={args.block_size} "
        f"median length={args.mean_length} (log-normal) window={args.window or None} warmup={args.warmup} iters={args.iters} (medians of "
        "interleaved rounds)"
    )
    print(f"{'capacity':>8} {'keys':>7} {'method':>10} {'median us':>10} {'MB read':>8} {'GB/s':>7} {'vs paged':>8}")
    for capacity in args.capacity:
        lengths = lengths_of(args.rows, args.mean_length, capacity, seed=1)
        query, kc, vc, tables, seq_lens = case(
            args.rows, args.heads, args.kv_heads, args.head_dim, args.block_size, capacity, lengths, dtype, device
        )
        k_cap, v_cap, mask_cap = dense_buffers(kc, vc, tables, lengths, capacity, args.window)
        k_ex, v_ex, mask_ex = dense_buffers(kc, vc, tables, lengths, max(lengths), args.window)
        q4 = query[:, :, None, :]  # [rows, heads, 1, head_dim]

        def sdpa(k, v, mask):
            return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=per_kv > 1)[:, :, 0]

        paged = torchkvops.paged_attention(query, kc, vc, tables, seq_lens, window=args.window)[0]
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(paged, sdpa(k_cap, v_cap, mask_cap), rtol=tol, atol=tol)
        torch.testing.assert_close(paged, sdpa(k_ex, v_ex, mask_ex), rtol=tol, atol=tol)
        fns = {
            "paged": lambda: torchkvops.paged_attention(query, kc, vc, tables, seq_lens, window=args.window),
            "sdpa-dense": lambda: sdpa(k_cap, v_cap, mask_cap),
            "sdpa-exact": lambda: sdpa(k_ex, v_ex, mask_ex),
        }
        times = time_methods(fns, device, args.warmup, args.iters)
        row_bytes = 2 * args.kv_heads * args.head_dim * dtype.itemsize  # K and V of one key
        held = [min(n, args.window) for n in lengths] if args.window else lengths
        read = {"paged": sum(held), "sdpa-dense": args.rows * capacity, "sdpa-exact": args.rows * max(lengths)}
        base = statistics.median(times["paged"])
        for name, ts in times.items():
            med = statistics.median(ts)
            mb = read[name] * row_bytes / 1e6
            print(
                f"{capacity:>8} {sum(lengths):>7} {name:>10} {med * 1e6:10.1f} {mb:8.2f} {mb / 1e3 / med:7.2f} "
                f"{med / base:7.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
