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

The measurement; `torchkvops bench-op` (torchkvops/cli/bench_op.py) is its command line, and
`python benchmarks/bench_repeat_kv_cache.py ...` runs that command.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

# No torch at import time: the command line plans sizes and checks them before loading it.

DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4}
METHODS = {
    "op": "torchkvops.repeat_kv_cache_(cache, batch, repeats, num_tokens), in place",
    "copy": "dst.copy_(src) of the same bytes between two preallocated tensors: the roofline",
    "interleave": "repeat_interleave of the prompt rows (allocates its output)",
    "loop": "a reverse Python loop of row copies, in place",
}
MiB = 1 << 20


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


def add_device_arguments(parser) -> None:
    """--device (CUDA where there is one) and --threads, as every operator benchmark takes them; read back by
    `device_from`."""
    import torch

    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")


def device_from(args):
    """`add_device_arguments`' device (SystemExit where CUDA is asked for and there is none), torch's threads
    set from --threads first."""
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA GPU is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    return device


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


def measure(args, device, on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Time every size of plan(args) on `device` (the library loaded, the arguments checked); one dict
    per cache size. on_row(rows so far) is called after each size."""
    import torch

    import torchkvops

    sizes = plan(args)
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
