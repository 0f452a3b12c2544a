"""`torchkvops bench-train`: forward + backward of completion log-probabilities, the plain forward against
`torchkvops.patch_forward`'s shared-prefix one (torchkvops.bench.train), from the command line: its
arguments, the checks made before any work, and the run."""

from __future__ import annotations

import argparse
import sys

from .arguments import add_shape_arguments, check_shape_positions, run_header, shape_device_and_dtype
from .checks import check_output_file, int_in
from .launch import add_threads_argument

__all__ = ["NAME", "HELP", "DESCRIPTION", "EPILOG", "add_arguments", "check_args", "execute"]

NAME = "bench-train"
HELP = "shared-prefix vs plain forward + backward (patch_forward)"
DESCRIPTION = (
    "Forward + backward of the completion log-probabilities of G completions per prompt (a GRPO loss "
    "pass), the plain forward against torchkvops.patch_forward's shared-prefix forward, interleaved "
    "(A B A B ...), over a matrix of prompt lengths P, completion lengths C and group sizes G."
)
EPILOG = (
    "Per case: time (median of --iterations steps per mode, after --warmup), activations held for backward, "
    "peak memory of one more step per mode, and the shared step's max relative difference from the plain "
    "one's gradients. Models have random weights, train mode, dropout off."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shape_arguments(p)
    p.add_argument("--prompts", type=int_in(1), default=1, help="prompts B per step (rows = B x G)")
    p.add_argument("--prompt-lengths", type=int_in(1), nargs="+", default=[1024], metavar="P", help="prompt tokens")
    p.add_argument(
        "--completion-lengths", type=int_in(1), nargs="+", default=[128], metavar="C", help="completion tokens per row"
    )
    p.add_argument("--group-sizes", type=int_in(2), nargs="+", default=[8], metavar="G", help="completions per prompt")
    p.add_argument("--warmup", type=int_in(0), default=1, help="untimed steps per case and mode")
    p.add_argument("--iterations", type=int_in(1), default=3, help="timed steps per case and mode (median reported)")
    add_threads_argument(p)
    p.add_argument("--seed", type=int_in(0), default=0, help="weights and token ids")
    p.add_argument("--output", metavar="FILE.json", help="also write every case's results as JSON, after each case")


def check_args(args) -> None:
    """The checks argparse cannot make one flag at a time, before any work (no torch needed)."""
    longest = max(args.prompt_lengths) + max(args.completion_lengths)
    check_shape_positions(args, longest, "--prompt-lengths + --completion-lengths")
    check_output_file(args.output, "--output")


def execute(args: argparse.Namespace) -> int:
    import torch

    from ..bench.train import NOTES, cases, format_table, measure_case, train_model
    from .atomic_write import write_json_atomic

    device, dtype = shape_device_and_dtype(args)
    model = train_model(args.model_shape, device, dtype, args.seed)
    header = run_header(args, device, NOTES)
    results = []
    for case in cases(args.prompts, args.prompt_lengths, args.completion_lengths, args.group_sizes):
        print(
            f"P={case.prompt_length} C={case.completion_length} G={case.group} B={case.prompts} ...",
            file=sys.stderr,
            flush=True,
        )
        results.append(measure_case(model, case, args.iterations, args.warmup, args.seed))
        if args.output:
            write_json_atomic(args.output, {"header": header, "results": results})
    print(
        f"bench-train: {args.model_shape} {args.dtype} on {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.iterations} steps after {args.warmup} warm-up"
    )
    print(format_table(results))
    if args.output:
        print(f"wrote {args.output}")
    return 0
