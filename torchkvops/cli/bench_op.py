"""`torchkvops bench-op`: the repeat_kv_cache_ bandwidth table (torchkvops.bench.op) from the command line:
its arguments, the checks made before any work, and the run."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from ..bench import op
from ..bench.op import DTYPE_NAMES, ITEMSIZE, METHODS, MiB, format_table, peak_bytes, plan
from .arguments import DEVICE_HELP
from .checks import CLIError, available_memory_bytes, check_output_file, device_name, float_in, gib, int_in
from .launch import add_threads_argument, resolve_device, set_threads

__all__ = ["NAME", "HELP", "DESCRIPTION", "EPILOG", "add_arguments", "check_args", "execute", "run"]

NAME = "bench-op"
HELP = "the repeat_kv_cache_ bandwidth table"
MAX_MIB = 1 << 20  # 1 TiB: a cache size beyond any machine this runs on
MAX_SIZES = 64
DESCRIPTION = op.__doc__.split("\n\n")[0]  # the first paragraph of torchkvops.bench.op's docstring

EPILOG = (
    "methods (--methods, comma-separated):\n"
    + "\n".join(f"  {k:<11} {v}" for k, v in METHODS.items())
    + (
        "\n\nCache sizes: --min-mib, --min-mib * --factor, ... up to --max-mib. GB/s = (bytes read + written) / "
        "median time / 1e9."
    )
)


def methods_list(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(METHODS)}, got {text!r}")
    return list(dict.fromkeys(names))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=device_name, default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="fp16", help="the cache's element type")
    p.add_argument("--batch", type=int_in(1), default=8, help="prompts B (rows [0, B) hold them)")
    p.add_argument("--repeats", type=int_in(2), default=4, help="samples per prompt N (rows = B*N; 1 moves nothing)")
    p.add_argument("--kv-heads", type=int_in(1), default=8, help="KV heads per layer")
    p.add_argument("--head-dim", type=int_in(1), default=128, help="the dimension of each head")
    p.add_argument(
        "--prompt-frac",
        type=float_in(0, 1, lo_open=True),
        default=0.5,
        help="num_tokens = this fraction of max_tokens, in (0, 1]",
    )
    p.add_argument("--min-mib", type=float_in(0, MAX_MIB, lo_open=True), default=1.0, help="smallest cache size in MiB")
    p.add_argument(
        "--max-mib", type=float_in(0, MAX_MIB, lo_open=True), default=1024.0, help="largest cache size in MiB"
    )
    p.add_argument("--factor", type=int_in(2), default=4, help="ratio between successive sizes")
    p.add_argument("--warmup", type=int_in(0), default=3, help="untimed runs per method and size")
    p.add_argument("--iters", type=int_in(1), default=10, help="timed runs per method and size (median reported)")
    add_threads_argument(p)
    p.add_argument(
        "--methods",
        type=methods_list,
        default=",".join(METHODS),
        help=f"comma-separated subset of {', '.join(METHODS)} to time (see below)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the check that op and loop agree")
    p.add_argument(
        "--output", metavar="FILE.json", help="also write the rows as JSON to this file (rewritten after each size)"
    )


def check_args(args) -> None:
    """The checks argparse cannot make one flag at a time, before any work (no torch needed)."""
    if args.min_mib > args.max_mib:
        raise CLIError(f"--min-mib {args.min_mib:.10g} is more than --max-mib {args.max_mib:.10g}")
    count = math.floor(math.log(args.max_mib / args.min_mib, args.factor) + 1e-9) + 1
    if count > MAX_SIZES:
        raise CLIError(
            f"--min-mib {args.min_mib:.10g} to --max-mib {args.max_mib:.10g} by --factor {args.factor} makes "
            f"{count} sizes; at most {MAX_SIZES}: raise --min-mib or --factor"
        )
    check_output_file(args.output, "--output")
    sizes = plan(args)
    _, shape, _ = sizes[-1]
    actual = math.prod(shape) * ITEMSIZE[args.dtype]
    if actual > 2 * args.max_mib * MiB:
        raise CLIError(
            f"--batch {args.batch} x --repeats {args.repeats} rows of --kv-heads {args.kv_heads} x "
            f"--head-dim {args.head_dim} make the smallest possible cache {shape} {actual / MiB:.0f} MiB, "
            f"more than --max-mib {args.max_mib:.10g}: lower them or raise --max-mib"
        )
    if args.device == "cpu":
        check_memory(args, sizes, available_memory_bytes(), "available here")


def check_memory(args, sizes, have: int | None, where: str) -> None:
    """Refuse a plan whose largest size cannot fit in `have` bytes (None: unknown, not checked)."""
    if have is None:
        return
    _, shape, num_tokens = max(sizes, key=lambda s: math.prod(s[1]))
    need = peak_bytes(shape, num_tokens, ITEMSIZE[args.dtype], args.methods, not args.no_check)
    if need > have:
        raise CLIError(
            f"--max-mib {args.max_mib:.10g}: the largest size (cache {shape}) needs about {gib(need)} with "
            f"--methods {','.join(args.methods)}, more than the {gib(have)} {where}; lower --max-mib"
        )


def run(args: argparse.Namespace, on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Run the benchmark (args parsed by torchkvops.cli.main.parse_args); one dict per cache size.
    on_row(rows so far) is called after each size."""
    import torch

    from .. import ops  # noqa: F401  (imports torch and torchkvops._C)
    from ..bench.op import measure

    device = resolve_device(args.device)
    sizes = plan(args)
    if device.type == "cuda":
        check_memory(args, sizes, torch.cuda.mem_get_info(device)[0], f"free on {device}")
    else:  # (already checked at parse time when --device cpu was given)
        check_memory(args, sizes, available_memory_bytes(), "available here")
    set_threads(args)
    return measure(args, device, on_row)


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
