"""Effective bandwidth of repeat_kv_cache_ against the memory roofline and the obvious alternatives.

For each cache size (1 MiB .. 1 GiB by default, powers of 4) it builds one whole KV buffer
[layers, 2, rows, kv_heads, max_tokens, head_dim] with rows = batch * repeats, and times:

  op        torchkvops.repeat_kv_cache_(cache, batch, repeats, num_tokens)   (in place)
  copy      dst.copy_(src) of the same number of bytes between two preallocated tensors: the roofline
  interleave cache[..., :batch, :, :num_tokens, :].repeat_interleave(repeats, dim=-4)  (allocates)
  loop      for r in reversed(range(1, batch*repeats)):
                cache[..., r, :, :T, :].copy_(cache[..., r // repeats, :, :T, :])

Every method is charged the same bytes: the in-place op reads and writes (batch*repeats - 1) rows'
prompt positions, so bytes = 2 * (batch*repeats - 1) * layers*2*kv_heads*num_tokens*head_dim*itemsize,
and GB/s = bytes / median time / 1e9. The ratios are then ratios of times.

Every buffer is written before it is timed (no first-touch page faults inside a timing); warm-up runs
are excluded; methods are timed in interleaved rounds and the median of --iters is reported; CUDA
timings use events on the current stream with a synchronize around each, CPU timings use
perf_counter. repeat_interleave allocates a new output each call, so on the CPU its time
includes the page faults of that fresh memory: that cost is what the in-place op avoids.

Run as `python benchmarks/bench_repeat_kv_cache.py ...` or `torchkvops bench-op ...`.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

# No torch at import time: `torchkvops bench-op --help` and bad arguments answer without it.
from .cli_checks import CLIError, available_memory_bytes, check_output_file, device_name, float_in, gib, int_in

DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4}
METHODS = {
    "op": "torchkvops.repeat_kv_cache_(cache, batch, repeats, num_tokens), in place",
    "copy": "dst.copy_(src) of the same bytes between two preallocated tensors: the roofline",
    "interleave": "repeat_interleave of the prompt rows (allocates its output)",
    "loop": "a reverse Python loop of row copies, in place",
}
MiB = 1 << 20
MAX_MIB = 1 << 20  # 1 TiB: a cache size beyond any machine this runs on
MAX_SIZES = 64
DESCRIPTION = __doc__.split("\n\n")[0]
EPILOG = "methods (--methods, comma-separated):\n" + "\n".join(f"  {k:<11} {v}" for k, v in METHODS.items()) + (
    "\n\nCache sizes: --min-mib, --min-mib * --factor, ... up to --max-mib. GB/s = (bytes read + written) / "
    "median time / 1e9.")


def methods_list(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(METHODS)}, got {text!r}")
    return list(dict.fromkeys(names))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=device_name, default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="fp16", help="the cache's element type")
    p.add_argument("--batch", type=int_in(1), default=8, help="prompts B (rows [0, B) hold them)")
    p.add_argument("--repeats", type=int_in(2), default=4, help="samples per prompt N (rows = B*N; 1 moves nothing)")
    p.add_argument("--kv-heads", type=int_in(1), default=8, help="KV heads per layer")
    p.add_argument("--head-dim", type=int_in(1), default=128, help="the dimension of each head")
    p.add_argument("--prompt-frac", type=float_in(0, 1, lo_open=True), default=0.5,
                   help="num_tokens = this fraction of max_tokens, in (0, 1]")
    p.add_argument("--min-mib", type=float_in(0, MAX_MIB, lo_open=True), default=1.0, help="smallest cache size in MiB")
    p.add_argument("--max-mib", type=float_in(0, MAX_MIB, lo_open=True), default=1024.0,
                   help="largest cache size in MiB")
    p.add_argument("--factor", type=int_in(2), default=4, help="ratio between successive sizes")
    p.add_argument("--warmup", type=int_in(0), default=3, help="untimed runs per method and size")
    p.add_argument("--iters", type=int_in(1), default=10, help="timed runs per method and size (median reported)")
    cpus = os.cpu_count() or 1
    p.add_argument("--threads", type=int_in(1, cpus, f" (the {cpus} CPUs here)"), default=None,
                   help="torch.set_num_threads, CPU only (default: torch's choice)")
    p.add_argument("--methods", type=methods_list, default=",".join(METHODS),
                   help=f"comma-separated subset of {', '.join(METHODS)} to time (see below)")
    p.add_argument("--no-check", action="store_true", help="skip the check that op and loop agree")
    p.add_argument("--output", metavar="FILE.json",
                   help="also write the rows as JSON to this file (rewritten after each size)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check bench-op arguments as `torchkvops bench-op` does (bad input: SystemExit(2))."""
    from .cli import parse_args as cli_parse_args

    return cli_parse_args(["bench-op", *(sys.argv[1:] if argv is None else argv)])


def cache_shape(target_bytes: int, rows: int, kv_heads: int, head_dim: int, itemsize: int) -> list[int]:
    """[layers, 2, rows, kv_heads, max_tokens, head_dim] of about target_bytes: max_tokens grows to
    256 before layers do (up to 32 layers), as in a real model's cache."""
    per_layer_token = 2 * rows * kv_heads * head_dim * itemsize
    layer_tokens = max(1, target_bytes // per_layer_token)
    layers = max(1, min(32, layer_tokens // 256))
    max_tokens = max(2, layer_tokens // layers)
    return [layers, 2, rows, kv_heads, max_tokens, head_dim]


def _time_once(device) -> Callable[[Callable[[], object]], float]:
    """Seconds one call of fn takes: CUDA events on the current stream with a synchronize after, or
    perf_counter on the CPU."""
    import torch

    if device.type == "cuda":

        def once_cuda(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) / 1e3

        return once_cuda

    def once_cpu(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return once_cpu


def time_methods(fns: dict[str, Callable[[], object]], device, warmup: int, iters: int) -> dict[str, list[float]]:
    """Warm each method up, then time them in interleaved rounds (op, copy, ..., op, copy, ...): a
    machine whose speed drifts (other processes, clocks) then affects every method alike, and the
    ratios stay fair."""
    import torch

    once = _time_once(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            times[name].append(once(fn))
    return times


def _sizes(min_mib: float, max_mib: float, factor: int) -> list[float]:
    """min_mib, min_mib * factor, ... up to max_mib (needs min_mib > 0 and factor >= 2: check_args)."""
    if not (min_mib > 0 and factor >= 2):
        raise ValueError(f"bench-op: sizes need min_mib > 0 and factor >= 2, got {min_mib}, {factor}")
    sizes, s = [], float(min_mib)
    while s <= max_mib * (1 + 1e-9):
        sizes.append(s)
        s *= factor
    return sizes


def plan(args) -> list[tuple[float, list[int], int]]:
    """(target MiB, cache shape, num_tokens) of every size, from the arguments alone."""
    itemsize = ITEMSIZE[args.dtype]
    rows = args.batch * args.repeats
    out = []
    for mib in _sizes(args.min_mib, args.max_mib, args.factor):
        shape = cache_shape(int(mib * MiB), rows, args.kv_heads, args.head_dim, itemsize)
        max_tokens = shape[4]
        out.append((mib, shape, max(1, min(max_tokens, round(max_tokens * args.prompt_frac)))))
    return out


def peak_bytes(shape: list[int], num_tokens: int, itemsize: int, methods: Sequence[str], check: bool) -> int:
    """The most memory one size holds at once (an upper bound): the cache, the copy method's source and
    destination, repeat_interleave's output, and the op-vs-loop check's three copies of the prompt rows."""
    layers, two, rows, heads, _, head_dim = shape
    cache = math.prod(shape) * itemsize
    row_bytes = layers * two * heads * num_tokens * head_dim * itemsize
    total = cache
    if "copy" in methods:
        total += 2 * (rows - 1) * row_bytes
    if "interleave" in methods:
        total += rows * row_bytes
    if check and cache <= 64 * MiB:
        total += 3 * rows * row_bytes
    return total


def check_args(args) -> None:
    """The checks argparse cannot make one flag at a time, before any work (no torch needed)."""
    if args.min_mib > args.max_mib:
        raise CLIError(f"--min-mib {args.min_mib:.10g} is more than --max-mib {args.max_mib:.10g}")
    count = math.floor(math.log(args.max_mib / args.min_mib, args.factor) + 1e-9) + 1
    if count > MAX_SIZES:
        raise CLIError(f"--min-mib {args.min_mib:.10g} to --max-mib {args.max_mib:.10g} by --factor {args.factor} makes "
                       f"{count} sizes; at most {MAX_SIZES}: raise --min-mib or --factor")
    check_output_file(args.output, "--output")
    sizes = plan(args)
    _, shape, _ = sizes[-1]
    actual = math.prod(shape) * ITEMSIZE[args.dtype]
    if actual > 2 * args.max_mib * MiB:
        raise CLIError(f"--batch {args.batch} x --repeats {args.repeats} rows of --kv-heads {args.kv_heads} x "
                       f"--head-dim {args.head_dim} make the smallest possible cache {shape} {actual / MiB:.0f} MiB, "
                       f"more than --max-mib {args.max_mib:.10g}: lower them or raise --max-mib")
    if args.device == "cpu":
        check_memory(args, sizes, available_memory_bytes(), "available here")


def check_memory(args, sizes, have: int | None, where: str) -> None:
    """Refuse a plan whose largest size cannot fit in `have` bytes (None: unknown, not checked)."""
    if have is None:
        return
    _, shape, num_tokens = max(sizes, key=lambda s: math.prod(s[1]))
    need = peak_bytes(shape, num_tokens, ITEMSIZE[args.dtype], args.methods, not args.no_check)
    if need > have:
        raise CLIError(f"--max-mib {args.max_mib:.10g}: the largest size (cache {shape}) needs about {gib(need)} with "
                       f"--methods {','.join(args.methods)}, more than the {gib(have)} {where}; lower --max-mib")


def _check(cache, batch: int, repeats: int, num_tokens: int) -> None:
    """The op and the reverse loop give the same bytes (on a small copy of the prompt region)."""
    import torch

    import torchkvops

    region = cache[..., : batch * repeats, :, :num_tokens, :].clone()
    a, b = region.clone(), region.clone()
    torchkvops.repeat_kv_cache_(a, batch, repeats, num_tokens)
    for r in reversed(range(1, batch * repeats)):
        b[..., r, :, :, :].copy_(b[..., r // repeats, :, :, :])
    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
        raise AssertionError("repeat_kv_cache_ disagrees with the reverse copy loop")


def run(args: Sequence[str] | argparse.Namespace | None = None,
        on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Run the benchmark (args: parsed, or an argument list to parse); one dict per cache size.
    on_row(rows so far) is called after each size."""
    if not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    from .cli import load_library
    from .cli_launch import resolve_device

    load_library()
    import torch

    import torchkvops

    device = resolve_device(args.device)
    sizes = plan(args)
    if device.type == "cuda":
        check_memory(args, sizes, torch.cuda.mem_get_info(device)[0], f"free on {device}")
    else:  # (already checked at parse time when --device cpu was given)
        check_memory(args, sizes, available_memory_bytes(), "available here")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, DTYPE_NAMES[args.dtype])
    itemsize = torch.empty((), dtype=dtype).element_size()
    methods = args.methods
    batch, repeats = args.batch, args.repeats
    rows = batch * repeats

    results = []
    for _mib, shape, num_tokens in sizes:
        layers, _, _, heads, max_tokens, head_dim = shape
        # Pre-touch: every page of every buffer is written before any timing.
        cache = torch.empty(shape, dtype=dtype, device=device).normal_()
        row_bytes = layers * 2 * heads * num_tokens * head_dim * itemsize  # one row's prompt positions
        moved = (rows - 1) * row_bytes  # bytes written (and as many read)
        total = 2 * moved
        row = {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(),
            "dtype": args.dtype,
            "shape": shape,
            "cache_mib": cache.nbytes / MiB,
            "batch": batch,
            "repeats": repeats,
            "num_tokens": num_tokens,
            "bytes": total,
            "warmup": args.warmup,
            "iters": args.iters,
        }
        if not args.no_check and cache.nbytes <= 64 * MiB:
            _check(cache, batch, repeats, num_tokens)

        fns: dict[str, Callable[[], object]] = {}
        src = dst = None
        if "op" in methods:
            fns["op"] = lambda: torchkvops.repeat_kv_cache_(cache, batch, repeats, num_tokens)
        if "copy" in methods:
            numel = moved // itemsize
            src = torch.empty(numel, dtype=dtype, device=device).normal_()
            dst = torch.zeros(numel, dtype=dtype, device=device)
            fns["copy"] = lambda: dst.copy_(src)
        if "interleave" in methods:
            fns["interleave"] = lambda: cache[..., :batch, :, :num_tokens, :].repeat_interleave(repeats, dim=-4)
        if "loop" in methods:

            def loop():
                for r in reversed(range(1, rows)):
                    cache[..., r, :, :num_tokens, :].copy_(cache[..., r // repeats, :, :num_tokens, :])

            fns["loop"] = loop

        for name, times in time_methods(fns, device, args.warmup, args.iters).items():
            med = statistics.median(times)
            row[f"{name}_s"] = med
            row[f"{name}_gbps"] = total / med / 1e9
            row[f"{name}_best_gbps"] = total / min(times) / 1e9
        if "op" in fns and "copy" in fns:
            row["op_over_copy"] = row["op_gbps"] / row["copy_gbps"]
        results.append(row)
        if on_row is not None:
            on_row(results)
        fns.clear()
        cache = src = dst = None  # free this size's buffers before the next size allocates
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def format_table(results: list[dict]) -> str:
    def f(r, key, fmt="{:.1f}"):
        return fmt.format(r[key]) if key in r else "-"

    lines = [
        "| cache MiB | shape [L,2,rows,H,T,D] | T used | MB read+written | op GB/s | copy GB/s | op/copy "
        "| repeat_interleave GB/s | reverse loop GB/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        size = r["cache_mib"]
        lines.append(
            f"| {size:.0f} | {r['shape']} | {r['num_tokens']} | {r['bytes'] / 1e6:.1f} | {f(r, 'op_gbps')} "
            f"| {f(r, 'copy_gbps')} | {f(r, 'op_over_copy', '{:.2f}')} | {f(r, 'interleave_gbps')} "
            f"| {f(r, 'loop_gbps')} |"
        )
    return "\n".join(lines)


def execute(args: argparse.Namespace) -> int:
    """`torchkvops bench-op`: run, print the table, write --output (after every size, atomically)."""
    from .atomic_write import write_json_atomic

    done: list[dict] = []

    def save(rows: list[dict]) -> None:
        done[:] = rows
        if args.output:
            write_json_atomic(args.output, rows)

    try:
        results = run(args, on_row=save)
    except KeyboardInterrupt:
        kept = f"; their rows are in {args.output}" if args.output and done else ""
        print(f"torchkvops: interrupted after {len(done)} size(s){kept}", file=sys.stderr)
        return 130
    r0 = results[0] if results else {}
    print(
        f"repeat_kv_cache_ bandwidth: device={r0.get('device_name', args.device)} dtype={args.dtype} "
        f"B={args.batch} N={args.repeats} threads={r0.get('threads', '-')} "
        f"warmup={args.warmup} iters={args.iters} (median); GB/s = (read + written bytes) / time / 1e9"
    )
    print(format_table(results))
    if args.output:
        print(f"wrote {args.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The same as `torchkvops bench-op ARGS` (benchmarks/bench_repeat_kv_cache.py calls this)."""
    from .cli import main as cli_main

    return cli_main(["bench-op", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
