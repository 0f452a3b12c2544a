"""`torchkvops bench-turns`: multi-turn rollouts, each row's KV kept across turns (`Rollout.extend`)
against re-prefilling every turn's history (torchkvops.bench.turns), from the command line: its
arguments, the checks made before any work, and the run."""

from __future__ import annotations

import argparse
import sys

from .arguments import add_shape_arguments, check_shape_positions, run_header, shape_device_and_dtype
from .checks import CLIError, check_output_file, int_in
from .launch import add_threads_argument

__all__ = ["NAME", "HELP", "DESCRIPTION", "EPILOG", "add_arguments", "check_args", "execute"]

NAME = "bench-turns"
HELP = "multi-turn rollouts: the KV kept across turns (Rollout.extend) vs re-prefilled"
MODES = ("reuse", "no-reuse", "hf")  # torchkvops.bench.turns.MODES, spelled out so that parsing needs no torch
DESCRIPTION = (
    "An agent's multi-turn rollout: B prompts x N samples, K turns of R generated tokens, T tokens appended "
    "to every row after each turn but the last (a tool's answer). reuse: one Rollout, generate then extend "
    "(each row's KV kept); no-reuse: each turn a new rollout over the full histories; hf: HF generate on the "
    "full histories each turn (TRL's tool loop without vLLM). Interleaved (A B C A B C ...)."
)
EPILOG = (
    "Per turn and mode: prefill tokens, prefill ms, decode ms, the turn's ms (median of --iterations rounds "
    "after --warmup); then the whole rollout, the prefill tokens with reuse over (B x P + appended tokens), "
    "and the speedups of reuse. Models have random weights; sampling at --temperature, no EOS (every mode "
    "generates R tokens per row and turn)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shape_arguments(p)
    p.add_argument("--prompts", type=int_in(1), default=1, help="prompts B")
    p.add_argument("--samples-per-prompt", type=int_in(1), default=4, help="samples N per prompt (rows = B x N)")
    p.add_argument("--prompt-length", type=int_in(1), default=512, help="prompt tokens P")
    p.add_argument("--turns", type=int_in(1), default=4, help="turns K (generate calls per row)")
    p.add_argument("--response-length", type=int_in(1), default=32, help="tokens R generated per row and turn")
    p.add_argument("--append-length", type=int_in(0), default=64, help="tokens T appended per row after a turn")
    p.add_argument(
        "--append-profile",
        choices=["fixed", "uniform"],
        default="fixed",
        help="fixed: every row appends T tokens; uniform: each row a length drawn from [1, T] (tool answers of "
        "different lengths)",
    )
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="the modes, in this order")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--warmup", type=int_in(0), default=1, help="untimed rounds")
    p.add_argument("--iterations", type=int_in(1), default=3, help="timed rounds (medians reported)")
    add_threads_argument(p)
    p.add_argument("--seed", type=int_in(0), default=0, help="weights, prompts, appended tokens and sampling")
    p.add_argument("--output", metavar="FILE.json", help="also write the results as JSON")


def check_args(args) -> None:
    """The checks argparse cannot make one flag at a time, before any work (no torch needed)."""
    longest = args.prompt_length + args.turns * args.response_length + (args.turns - 1) * args.append_length
    check_shape_positions(
        args, longest, "--prompt-length + --turns x --response-length + (--turns - 1) x --append-length"
    )
    if not 0 <= args.temperature < float("inf"):
        raise CLIError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    check_output_file(args.output, "--output")


def execute(args: argparse.Namespace) -> int:
    import torch

    from ..bench.turns import NOTES, TurnsCase, format_table, measure
    from ..models import build_model
    from .atomic_write import write_json_atomic

    device, dtype = shape_device_and_dtype(args)
    model = build_model(args.model_shape, dtype, device, args.seed)
    case = TurnsCase(
        args.prompts,
        args.samples_per_prompt,
        args.prompt_length,
        args.turns,
        args.response_length,
        args.append_length,
        args.append_profile,
    )
    print(
        f"B={case.prompts} N={case.samples} P={case.prompt_length} K={case.turns} "
        f"R={case.response_length} T={case.append_length} ...",
        file=sys.stderr,
        flush=True,
    )
    result = measure(model, case, args.modes, args.iterations, args.warmup, args.temperature, args.seed)
    header = run_header(args, device, NOTES, temperature=args.temperature)
    print(
        f"bench-turns: {args.model_shape} {args.dtype} on {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.iterations} rounds after {args.warmup} warm-up"
    )
    print(format_table(result))
    if args.output:
        write_json_atomic(args.output, {"header": header, "result": result})
        print(f"wrote {args.output}")
    return 0
