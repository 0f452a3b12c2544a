"""Time torchkvops.write_kv_slots_ (the paged layout's cache write) against the advanced indexing it replaced.

For each case rows x tokens (a decode step: tokens=1; a prefill: a prompt's tokens) it builds a pool of
blocks [layers, 2, blocks, kv_heads, block_size, head_dim], K and V [rows, kv_heads, tokens, head_dim] as
views of one projection's output (as a layer hands them over: not contiguous) and distinct random slots,
and times

  op        torchkvops.ops.write_kv_slots_(pool, key, value, layer, slots): one launch for K and V
  indexing  blocks, offsets = slots // block_size, slots % block_size;
            pool[layer, 0][blocks, :, offsets] = key.transpose(1, 2)  (and V): the paged layout's write
            before write_kv_slots_ (two index_put kernels and the arithmetic around them)

in interleaved rounds after a warm-up; the median of --iters rounds, and GB/s = bytes written (K and V) /
median. Both write the same values (checked before timing). CUDA timings use events on the current stream.

Example: .venv/bin/python benchmarks/bench_write_kv_slots.py --device cpu --cases 64x1,16x256 --threads 2
"""

from __future__ import annotations

import argparse
import statistics

import torch

import torchkvops
from torchkvops.bench.op import add_device_arguments, device_from, time_methods

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def indexing(pool, key, value, layer, slots) -> None:
    block_size = pool.shape[4]
    slots = slots if slots.dim() == 2 else slots[:, None]
    blocks, offsets = slots // block_size, slots % block_size
    pool[layer, 0][blocks, :, offsets] = key.transpose(1, 2)
    pool[layer, 1][blocks, :, offsets] = value.transpose(1, 2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(p)
    p.add_argument("--cases", default="64x1,16x256", help="comma-separated rows x tokens")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {sorted(DTYPES)}")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    device = device_from(args)
    print(
        f"device={device} threads={torch.get_num_threads()} kv_heads={args.kv_heads} head_dim={args.head_dim} "
        f"block_size={args.block_size} warmup={args.warmup} iters={args.iters} (median of interleaved runs)"
    )
    print(f"{'rows x tokens':>14} {'dtype':>5} {'method':>9} {'median us':>10} {'GB/s':>7} {'vs op':>6}")
    for case in args.cases.split(","):
        rows, tokens = (int(x) for x in case.lower().split("x"))
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            g = torch.Generator().manual_seed(0)
            blocks = 2 * rows * -(-tokens // args.block_size) + 1
            pool = torch.zeros(2, 2, blocks, args.kv_heads, args.block_size, args.head_dim, dtype=dtype, device=device)
            projected = torch.randn(rows, tokens, 2 * args.kv_heads, args.head_dim, generator=g).to(device, dtype)
            key = projected[:, :, : args.kv_heads].transpose(1, 2)
            value = projected[:, :, args.kv_heads :].transpose(1, 2)
            slots = torch.randperm(blocks * args.block_size, generator=g)[: rows * tokens].view(rows, tokens)
            slots = slots.to(device)
            expected = pool.clone()
            indexing(expected, key, value, 1, slots)
            torchkvops.ops.write_kv_slots_(pool, key, value, 1, slots)
            if not torch.equal(pool, expected):  # both write the same values before either is timed
                raise SystemExit(f"{case} {name}: write_kv_slots_ and the indexing wrote different values")
            fns = {
                "op": lambda: torchkvops.ops.write_kv_slots_(pool, key, value, 1, slots),
                "indexing": lambda: indexing(pool, key, value, 1, slots),
            }
            times = time_methods(fns, device, args.warmup, args.iters)  # interleaved rounds, one clock
            nbytes = 2 * key.numel() * dtype.itemsize
            op_med = statistics.median(times["op"])
            for method, ts in times.items():
                med = statistics.median(ts)
                print(
                    f"{case:>14} {name:>5} {method:>9} {med * 1e6:10.1f} {nbytes / med / 1e9:7.2f} {med / op_med:5.2f}x"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
