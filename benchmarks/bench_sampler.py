"""Time the fused sampler, torchkvops.ops.sample_tokens, against the Python sampler it replaced
(torchkvops.reference.sample_tokens, ~55 ATen ops and a full-vocabulary sort for top-p) and against
Hugging Face generate's sampling step (its temperature / top-k / top-p logits warpers, softmax and
torch.multinomial; argmax when greedy).

    .venv/bin/python benchmarks/bench_sampler.py --device cpu --rows 64 8 --vocab 151936 50272 --dtype bf16 --iters 10
    .venv/bin/python benchmarks/bench_sampler.py --device cuda --rows 64 8 --vocab 151936 50272 --iters 50

Each (rows, vocab) pair is timed in five modes: greedy, temperature 0.8, top-k 50, top-p 0.9 and
top-k 50 + top-p 0.9 (temperature 0.8 in all but greedy). After one warm-up call of each, op,
reference and HF calls alternate (A B C A B C ...), each call timed on its own (time.perf_counter on
CPU, CUDA events on CUDA), and the table gives the medians, the op's speedups and the fraction of rows
on which the op and the reference drew the same token. Logits are N(0, 3^2) noise in the chosen dtype
(fixed seed); the decode step advances every iteration, as in a rollout.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import torchkvops
from torchkvops import ops, reference
from torchkvops.rollout.sampling import row_keys

MODES = {  # name: (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "temperature": (0.8, 0, 1.0),
    "top-k 50": (0.8, 50, 1.0),
    "top-p 0.9": (0.8, 0, 0.9),
    "top-k 50 + top-p 0.9": (0.8, 50, 0.9),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 8], help="rows of each case (default: 64 8)")
    p.add_argument(
        "--vocab",
        type=int,
        nargs="+",
        default=[151936, 50272],
        help="vocab of each case, paired with --rows (default: 151936 50272)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="logits dtype (default: bf16)")
    p.add_argument("--iters", type=int, default=10, help="timed calls of each side per mode (default: 10)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads for both sides (default: torch's)")
    args = p.parse_args(argv)
    if len(args.rows) != len(args.vocab):
        p.error(f"--rows and --vocab must have the same number of values, got {len(args.rows)} and {len(args.vocab)}")
    if min(args.rows) < 1 or min(args.vocab) < 1:
        p.error(f"--rows and --vocab must be >= 1, got {args.rows} and {args.vocab}")
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def timed(fn, device: torch.device) -> tuple[float, torch.Tensor]:
    """Milliseconds of one call of fn(), and its result."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), out
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def hf_sampler(temperature: float, top_k: int, top_p: float):
    """Hugging Face generate's token selection for these settings (GenerationMixin._sample): the logits
    copied to float32, the warpers generate builds (temperature, top-k, top-p, in that order), then
    softmax + multinomial, or argmax when greedy."""
    warpers = LogitsProcessorList()
    if temperature != 0.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))

    def select(logits: torch.Tensor) -> torch.Tensor:
        scores = warpers(None, logits.to(copy=True, dtype=torch.float32))
        if temperature == 0.0:
            return scores.argmax(dim=-1)
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)

    return select


def bench_case(rows: int, vocab: int, dtype: torch.dtype, device: torch.device, iters: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 3.0).to(device=device, dtype=dtype)
    keys = row_keys(0, torch.arange(rows, device=device))
    step = torch.zeros(1, dtype=torch.long, device=device)
    results = []
    for name, (temperature, top_k, top_p) in MODES.items():

        def op():
            return ops.sample_tokens(logits, keys, step, temperature, top_k, top_p)

        def ref():
            return reference.sample_tokens(logits, keys, step, temperature, top_k, top_p)

        hf_select = hf_sampler(temperature, top_k, top_p)

        def hf():
            return hf_select(logits)

        op(), ref(), hf()  # warm-up
        op_ms, ref_ms, hf_ms, same = [], [], [], []
        for _ in range(iters):
            step.add_(1)
            t_op, a = timed(op, device)
            t_ref, b = timed(ref, device)
            t_hf, _ = timed(hf, device)
            op_ms.append(t_op)
            ref_ms.append(t_ref)
            hf_ms.append(t_hf)
            same.append((a == b).float().mean().item())
        results.append(
            dict(
                rows=rows,
                vocab=vocab,
                mode=name,
                op_ms=statistics.median(op_ms),
                ref_ms=statistics.median(ref_ms),
                hf_ms=statistics.median(hf_ms),
                same=statistics.mean(same),
            )
        )
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"sample_tokens vs the Python sampler and HF's sampling: {where}, {args.dtype} logits, median of "
        f"{args.iters} interleaved calls each, torch {torch.__version__}, torchkvops {torchkvops.__version__}\n"
    )
    print("| rows | vocab | mode | op ms | Python ms | HF ms | vs Python | vs HF | same tokens |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows, vocab in zip(args.rows, args.vocab):
        for r in bench_case(rows, vocab, dtype, device, args.iters):
            print(
                f"| {r['rows']} | {r['vocab']} | {r['mode']} | {r['op_ms']:.3f} | {r['ref_ms']:.3f} | "
                f"{r['hf_ms']:.3f} | {r['ref_ms'] / r['op_ms']:.1f}x | {r['hf_ms'] / r['op_ms']:.1f}x | "
                f"{r['same']:.1%} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
