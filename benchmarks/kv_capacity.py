"""How many sample rows (B*N) fit a fixed KV-memory budget with kv_sharing="copy" and "prefix".

The bytes are the rollout's own: the KV views a RolloutKVCache prepares (lengths rounded up as the
rollout rounds them), for a model shape of torchkvops.models, with no model built (the config is enough)
and no memory allocated (the views are made on the meta device). For each number of samples N
per prompt it finds the largest number of prompts B whose KV fits the budget.

    .venv/bin/python benchmarks/kv_capacity.py --model-shape qwen3-0.6b --dtype bf16 --budget-gib 40 \\
        --prompt-length 4096 --response-length 64 --samples-per-prompt 4 16 64
"""

from __future__ import annotations

import argparse

import torch

from torchkvops.models import MODEL_SHAPES, model_config
from torchkvops.models.adapter import CacheSpec
from torchkvops.rollout import kv_lengths
from torchkvops.rollout.kv_cache import RolloutKVCache
from torchkvops.rollout.layouts import layout_for

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def kv_bytes(
    shape: CacheSpec, dtype: torch.dtype, layout: str, prompts: int, samples: int, prompt_len: int, response_len: int
) -> int:
    cache = RolloutKVCache(shape, dtype, torch.device("meta"))
    rows = prompts * samples
    cache.prepare(layout_for(layout, samples), prompts, rows, kv_lengths(layout, prompt_len, response_len))
    return cache.used_bytes


def largest_batch(budget: int, **kw) -> int:
    lo, hi = 0, 1
    while kv_bytes(prompts=hi, **kw) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # kv_bytes grows with the number of prompts: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv_bytes(prompts=mid, **kw) <= budget else (lo, mid)
    return lo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", choices=list(MODEL_SHAPES), default="qwen3-0.6b")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--budget-gib", type=float, default=40.0)
    p.add_argument("--prompt-length", type=int, default=4096)
    p.add_argument("--response-length", type=int, default=64)
    p.add_argument("--samples-per-prompt", type=int, nargs="+", default=[4, 16, 64])
    args = p.parse_args()
    shape = CacheSpec.from_config(model_config(args.model_shape))
    budget = int(args.budget_gib * 2**30)
    print(
        f"{args.model_shape}, {args.dtype}, KV budget {args.budget_gib:g} GiB, P={args.prompt_length}, "
        f"R={args.response_length}"
    )
    print("| N | copy: largest B*N | prefix: largest B*N | prefix / copy | KV bytes prefix / copy at equal B, N |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.samples_per_prompt:
        kw = dict(
            shape=shape,
            dtype=DTYPES[args.dtype],
            samples=n,
            prompt_len=args.prompt_length,
            response_len=args.response_length,
        )
        copy = largest_batch(budget, layout="copy", **kw) * n
        prefix = largest_batch(budget, layout="prefix", **kw) * n
        ratio = kv_bytes(layout="prefix", prompts=1, **kw) / kv_bytes(layout="copy", prompts=1, **kw)
        print(f"| {n} | {copy} | {prefix} | {prefix / max(copy, 1):.1f}x | {ratio:.3f} |")


if __name__ == "__main__":
    main()
