"""Time torchkvops.merge_attention_states against eager PyTorch formulas.

For each size rows x heads x head_dim and dtype it builds random (out_a, lse_a, out_b, lse_b) and times

  op         torchkvops.merge_attention_states(out_a, lse_a, out_b, lse_b)
  reference  torchkvops.reference.merge_attention_states (eager PyTorch, same edge cases as the op)
  formula    the bare stable formula in eager PyTorch, without the -inf / NaN handling:
             m = max(lse_a, lse_b); wa, wb = exp(lse_a - m), exp(lse_b - m)
             out = (wa*out_a + wb*out_b) / (wa + wb); lse = m + log(wa + wb)

Warm-up runs are excluded; the methods are timed in interleaved rounds (op, reference, formula, op,
...) and the median of --iters rounds is printed, with GB/s = bytes read and written (both outputs and
both lse in, one of each out) / median time. CUDA timings use events on the current stream with a
synchronize around each; CPU timings use perf_counter.

Example: .venv/bin/python benchmarks/bench_merge_attention_states.py --device cpu --sizes 32x16x128,512x32x128
"""

from __future__ import annotations

import argparse
import statistics

import torch

import torchkvops
from torchkvops import reference
from torchkvops.bench.op import add_device_arguments, device_from, time_methods

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def formula(out_a, lse_a, out_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    s = wa + wb
    out = (wa.unsqueeze(-1) * out_a.float() + wb.unsqueeze(-1) * out_b.float()) / s.unsqueeze(-1)
    return out.to(out_a.dtype), m + torch.log(s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(p)
    p.add_argument("--sizes", default="32x16x128,512x32x128", help="comma-separated rows x heads x head_dim")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {sorted(DTYPES)}")
    p.add_argument(
        "--layout",
        choices=["contiguous", "permuted"],
        default="contiguous",
        help="permuted: [rows, heads, D] views of a [heads, rows, D] buffer (SDPA's layout)",
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    device = device_from(args)
    print(
        f"device={device} threads={torch.get_num_threads()} layout={args.layout} "
        f"warmup={args.warmup} iters={args.iters} (median of interleaved runs)"
    )
    print(f"{'size':>14} {'dtype':>5} {'method':>10} {'median us':>10} {'GB/s':>7} {'vs op':>6}")
    for size in args.sizes.split(","):
        rows, heads, head_dim = (int(x) for x in size.lower().split("x"))
        for name in args.dtypes.split(","):
            dtype = DTYPES[name]
            g = torch.Generator().manual_seed(0)

            def make_out():
                t = torch.randn(heads, rows, head_dim, generator=g).to(device, dtype)
                return t.transpose(0, 1) if args.layout == "permuted" else t.transpose(0, 1).contiguous()

            def make_lse():
                t = (torch.randn(heads, rows, generator=g) * 3).to(device)
                return t.transpose(0, 1) if args.layout == "permuted" else t.transpose(0, 1).contiguous()

            inputs = (make_out(), make_lse(), make_out(), make_lse())
            got = torchkvops.merge_attention_states(*inputs)
            want = reference.merge_attention_states(*inputs)
            torch.testing.assert_close(got, want)  # the op and the reference agree before timing
            fns = {
                "op": lambda: torchkvops.merge_attention_states(*inputs),
                "reference": lambda: reference.merge_attention_states(*inputs),
                "formula": lambda: formula(*inputs),
            }
            times = time_methods(fns, device, args.warmup, args.iters)  # interleaved rounds, one clock
            nbytes = 3 * rows * heads * head_dim * dtype.itemsize + 3 * rows * heads * 4
            op_med = statistics.median(times["op"])
            for k, ts in times.items():
                med = statistics.median(ts)
                print(f"{size:>14} {name:>5} {k:>10} {med * 1e6:10.1f} {nbytes / med / 1e9:7.2f} {med / op_med:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
