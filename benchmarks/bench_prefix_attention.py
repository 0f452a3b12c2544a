"""One attention layer's forward + backward for G rows that share a P-token prefix and have C tokens each of
their own, three ways (why patch_forward's attention is split, not expanded):

  plain     every row attends causally over its own P + C tokens (what the unpatched model does), SDPA
  expanded  the prefix K/V once per row (expand + cat), each row's C queries attend to [prefix, own] with
            a dense [C, P + C] mask, SDPA; the prefix's own causal attention once
  split     torchkvops.training.prefix_attention.shared_prefix_attention: prefix causal once, the G*C suffix
            queries stacked against the prefix once (grouped-query heads folded), each suffix causally
            against itself, merged by log-sum-exp; backward by each part's fused kernel

Modes alternate (A B C A B C ...) after a warm-up; medians of --iters; perf_counter on CPU, CUDA events
on CUDA. "saved MiB": tensors autograd holds for backward (unique storages).

    python benchmarks/bench_prefix_attention.py --prefix 1024 --suffix 128 --group 8 --heads 4 --kv-heads 2
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import torchkvops  # noqa: F401  (loads the operators)
from torchkvops.bench.metrics import saved_tensor_bytes
from torchkvops.bench.op import time_methods
from torchkvops.training.prefix_attention import shared_prefix_attention


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--suffix", type=int, default=128)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    dev = torch.device(args.device)
    P, C, G, H, Hkv, D = args.prefix, args.suffix, args.group, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    q_pre, k_pre, v_pre = rand(1, H, P, D), rand(1, Hkv, P, D), rand(1, Hkv, P, D)
    q_suf, k_suf, v_suf = rand(G, H, C, D), rand(G, Hkv, C, D), rand(G, Hkv, C, D)
    grad_pre, grad_suf = rand(1, H, P, D), rand(G, H, C, D)
    zero_pre = torch.zeros(1, 1, 1, P, device=dev, dtype=dtype)
    zero_suf = torch.zeros(G, 1, 1, C, device=dev, dtype=dtype)
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    suffix_mask = torch.cat([torch.ones(C, P, dtype=torch.bool, device=dev), causal], dim=1)  # [C, P + C]

    def leaves():
        return [t.clone().requires_grad_() for t in (q_pre, k_pre, v_pre, q_suf, k_suf, v_suf)]

    def plain():
        qp, kp, vp, qs, ks, vs = leaves()
        q = torch.cat([qp.expand(G, -1, -1, -1), qs], dim=2)
        k = torch.cat([kp.expand(G, -1, -1, -1), ks], dim=2)
        v = torch.cat([vp.expand(G, -1, -1, -1), vs], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out, (out[:, :, :P].sum(0, keepdim=True), out[:, :, P:])

    def expanded():
        qp, kp, vp, qs, ks, vs = leaves()
        out_pre = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        k = torch.cat([kp.expand(G, -1, -1, -1), ks], dim=2)
        v = torch.cat([vp.expand(G, -1, -1, -1), vs], dim=2)
        out_suf = F.scaled_dot_product_attention(qs, k, v, attn_mask=suffix_mask, enable_gqa=True)
        return None, (out_pre, out_suf)

    def split():
        qp, kp, vp, qs, ks, vs = leaves()
        return None, shared_prefix_attention(qp, kp, vp, qs, ks, vs, zero_pre, zero_suf)

    def step(fn):
        _, (out_pre, out_suf) = fn()
        # plain's prefix rows get the same upstream gradient G times (once per row): fair to its backward.
        torch.autograd.backward([out_pre, out_suf], [grad_pre.expand_as(out_pre), grad_suf])

    modes = {"plain": plain, "expanded": expanded, "split": split}
    seconds = time_methods({name: lambda fn=fn: step(fn) for name, fn in modes.items()}, dev, 1, args.iters)
    times = {name: [t * 1e3 for t in ts] for name, ts in seconds.items()}
    print(
        f"one layer, fwd+bwd: P={P} C={C} G={G} heads={H} kv_heads={Hkv} head_dim={D} {args.dtype} on {dev}, "
        f"{torch.get_num_threads()} threads, median of {args.iters}"
    )
    print("| mode | ms | vs plain | saved MiB |")
    print("|---|---:|---:|---:|")
    base = statistics.median(times["plain"])
    for name, fn in modes.items():
        ms = statistics.median(times[name])
        print(f"| {name} | {ms:.1f} | {base / ms:.2f}x | {saved_tensor_bytes(fn) / 2**20:.1f} |")


if __name__ == "__main__":
    main()
