"""The `torchkvops` command line (also `python -m torchkvops`).

  torchkvops rollout   generate N samples per prompt and print them (or write JSONL)
  torchkvops bench     the A/B matrix: the rollout's modes vs HF generate, interleaved (torchkvops.bench.matrix)
  torchkvops bench-op  the repeat_kv_cache_ bandwidth table (torchkvops.bench.op)
  torchkvops bench-train  shared-prefix vs plain forward + backward (torchkvops.bench.train)
  torchkvops bench-turns  multi-turn rollouts: KV kept across turns vs re-prefilled (torchkvops.bench.turns)
  torchkvops           with no arguments: a short default `bench` (about a minute on a small CPU)

Without --model the model is built in memory from a named shape with random weights (nothing is
downloaded). With --model, a local Hugging Face checkpoint (and its tokenizer) is loaded offline.

Order of work: the arguments are parsed and checked first (ranges, sizes against the memory there
is, output paths writable), without importing torch or transformers, so --help and bad input answer
at once; then the library is loaded, the device and dtype resolved, the model's config read and
checked against the sizes, and only then the model built and the work done. Bad input ends with one
line on stderr, `torchkvops: error: ...`, and exit code 2.

Launched by torchrun (its environment: WORLD_SIZE > 1, or TORCHELASTIC_RUN_ID), `rollout` and `bench`
run data-parallel, with no flag needed: each process joins torch.distributed's default group (nccl on
CUDA, each process on cuda:LOCAL_RANK; gloo on the CPU). `rollout` splits the prompts into contiguous
shards (a prompt's N samples stay together) and the first process prints every sample and writes the
one --output file; `bench` runs every case on every process with its own B prompts and the first
process reports the slowest process's times and the global tokens/s. A failure on one process is one
line on every process and a non-zero exit. Without torchrun: one process, as before.

This module holds the parser and the entry point (main). The rest of torchkvops/cli/, each in a module
of its own:
  checks    the argument types and every check made before the work (CLIError)
  launch    alone or under torchrun: the process group, the device, --threads, the shards, say()
  model     the dtype, the config, the model and tokenizer, and the token ids they imply
  rollout   the rollout command          bench  the bench command
  bench_op  the bench-op command (its own arguments, checks and run)
  bench_train  the bench-train command (the same)
  bench_turns  the bench-turns command (the same)
The measurements themselves are the benchmark harness's (torchkvops/bench/). Nothing that the parser
imports loads torch or transformers.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import bench_op, bench_train, bench_turns
from .bench import cmd_bench
from .checks import (
    CLIError,
    check_bench_args,
    check_rollout_args,
    device_name,
    int_in,
    length_sigma,
    non_negative_int,
    positive_int,
    temperature,
    top_p,
)
from .launch import (
    RunError,
    add_threads_argument,
    current_rank,
    current_world_size,
    stop_processes,
    threads_for_this_machine,
)
from .model import DTYPE_NAMES
from .rollout import cmd_rollout

__all__ = [
    "main",
    "build_parser",
    "parse_args",
    "DEFAULT_BENCH_ARGS",
    "MODEL_SHAPE_NAMES",
    "MODE_NAMES",
    "DEFAULT_MODES",
]

# The names of torchkvops.models.MODEL_SHAPES, spelled out so that parsing needs no transformers
# (tests/test_cli.py checks that the two agree).
MODEL_SHAPE_NAMES = (
    "tiny",
    "llama-small",
    "gemma3-small",
    "gpt-oss-small",
    "qwen3.5-small",
    "opt-125m",
    "gpt2",
    "qwen3-0.6b",
    "opt-6.7b",
)
# torchkvops.bench.cases.MODES and DEFAULT_MODES, spelled out for the same reason (checked by the same test).
MODE_NAMES = (
    "expanded",
    "shared",
    "prefix",
    "paged",
    "hf-generate",
    "hf-static",
    "shared-nocompact",
    "prefix-nocompact",
)
# torchkvops.bench.lengths.LENGTH_PROFILES, spelled out for the same reason (checked by the same test).
LENGTH_PROFILE_NAMES = ("fixed", "geometric", "eos-rate", "log-normal")
DEFAULT_MODES = ("expanded", "shared", "prefix", "hf-generate")
# The bare `torchkvops`: measured at 38 s on a shared 2-core CPU, model build included (5 iterations: 59 s);
# with the four default modes (prefix added), 28 s on the same CPU, less loaded (2026-11-30).
DEFAULT_BENCH_ARGS = [
    "--model-shape",
    "opt-125m",
    "--batch-sizes",
    "1",
    "--samples-per-prompt",
    "4",
    "--prompt-lengths",
    "128",
    "--response-lengths",
    "16",
    "--warmup",
    "1",
    "--iterations",
    "3",
]
MAX_SEED = 2**63 - 1


# --- parser --------------------------------------------------------------------------------------
class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default unless its help already speaks of one (and not None / False).
    (argparse prints no help line at all for an option without help text: every option has one.)"""

    def _get_help_string(self, action):
        help = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in help
            and default is not None
            and default is not False
            and default is not argparse.SUPPRESS
        ):
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
            help = f"{help} (default: {shown.replace('%', '%%')})".lstrip()
        return help


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, _Parser] = {}

    def error(self, message: str):  # one line, not the usage block
        where = self.prog.removeprefix("torchkvops").strip()
        self.exit(2, f"torchkvops: error: {where + ': ' if where else ''}{message} (see {self.prog} --help)\n")


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        metavar="PATH_OR_NAME",
        help="a local Hugging Face checkpoint folder (or a name already in the local cache); loaded "
        "offline. Default: a model built from --model-shape with random weights",
    )
    g.add_argument(
        "--model-shape",
        choices=MODEL_SHAPE_NAMES,
        default="opt-125m",
        help="shape of the random-weight model used without --model",
    )
    g.add_argument("--dtype", choices=list(DTYPE_NAMES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    g.add_argument(
        "--device", type=device_name, default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)"
    )
    g.add_argument("--compile", action="store_true", help="torch.compile the rollout's prefill and decode")
    g.add_argument(
        "--max-rows",
        type=int_in(1),
        default=None,
        help="the most sample rows decoded at once (RolloutConfig.max_rows): more are streamed, prompts "
        "admitted as others' rows end; default: every row at once",
    )
    g.add_argument(
        "--max-kv-tokens",
        type=int_in(1),
        default=None,
        help="the most KV tokens the rows hold at once (RolloutConfig.max_kv_tokens, the paged layout; bench: "
        "its paged mode): rows start while blocks are free, the newest preempted when they run short; "
        "default: no bound",
    )
    g.add_argument("--seed", type=int_in(0, MAX_SEED, " (2**63 - 1)"), default=0, help="sampling and prompt seed")
    add_threads_argument(g)


# What each command checks once its arguments are parsed, before any work.
CHECKS = {
    "rollout": check_rollout_args,
    "bench": check_bench_args,
    "bench-op": bench_op.check_args,
    "bench-train": bench_train.check_args,
    "bench-turns": bench_turns.check_args,
}


def build_parser() -> _Parser:
    parser = _Parser(
        prog="torchkvops",
        description=__doc__.split("\n\n")[0],
        epilog="With no command: a short default `bench` (" + " ".join(DEFAULT_BENCH_ARGS) + ").",
    )
    sub = parser.add_subparsers(
        dest="command", metavar="{rollout,bench,bench-op,bench-train,bench-turns}", parser_class=_Parser
    )

    r = sub.add_parser(
        "rollout",
        help="generate N samples for each prompt and print them",
        description="Generate N samples for each prompt and print them. Under torchrun the "
        "prompts are split among the processes (a prompt's samples stay together); the "
        "samples do not depend on the number of processes.",
    )
    src = r.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable; needs --model)")
    src.add_argument(
        "--prompts", metavar="FILE", help='prompts, one per line, or JSONL with a "prompt" field (needs --model)'
    )
    src.add_argument(
        "--prompt-length",
        type=positive_int,
        default=16,
        help="without text prompts: synthetic prompts of this many random token ids",
    )
    src.add_argument(
        "--num-prompts", type=positive_int, default=2, help="without text prompts: how many synthetic prompts"
    )
    _model_args(r)
    gen = r.add_argument_group("generation")
    gen.add_argument("-n", "--samples-per-prompt", type=positive_int, default=4, help="N")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32, help="R, the most tokens per sample")
    gen.add_argument("--temperature", type=temperature, default=1.0, help="0 is greedy")
    gen.add_argument("--top-k", type=non_negative_int, default=0, help="0 is off")
    gen.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1]")
    gen.add_argument(
        "--no-shared-prefill", action="store_true", help="the expanded baseline: prefill every prompt N times"
    )
    r.add_argument("--output", metavar="FILE.jsonl", help="also write one JSON record per sample")
    r.set_defaults(func=cmd_rollout)

    b = sub.add_parser(
        "bench",
        help="the A/B matrix: the rollout's modes vs HF generate, interleaved",
        description="Time the rollout's modes (expanded prefill, shared prefill with the KV copied "
        "or kept once as a shared prefix) and HF generate (default or static cache) over "
        "a matrix of batch sizes, samples per prompt, prompt and response lengths. The "
        "modes run interleaved (A B C A B C ...) and are timed by one clock; the table "
        "gives decode ms per step and the bandwidth it achieves (weights + KV read per "
        "step), on CUDA also as a fraction of a copy_ roofline measured in the same run.",
        epilog="Each case runs (warmup + iterations) calls per mode, plus one call for the peak "
        "memory and one for --trace. After the first call, bench prints the number of "
        "calls and an estimate of the run's time on stderr. Under torchrun every process "
        "runs every case with its own --batch-sizes prompts (global batch = B x processes).",
    )
    _model_args(b)
    m = b.add_argument_group("matrix")
    m.add_argument(
        "--batch-sizes",
        type=positive_int,
        nargs="+",
        default=[1],
        metavar="B",
        help="prompts per call (per process under torchrun)",
    )
    m.add_argument(
        "--samples-per-prompt", type=positive_int, nargs="+", default=[4], metavar="N", help="samples per prompt"
    )
    m.add_argument(
        "--prompt-lengths",
        type=positive_int,
        nargs="+",
        default=[128],
        metavar="P",
        help="prompt tokens (synthetic random ids)",
    )
    m.add_argument(
        "--response-lengths",
        type=positive_int,
        nargs="+",
        default=[16],
        metavar="R",
        help="tokens generated per sample (the most, with --length-profile geometric or eos-rate)",
    )
    m.add_argument(
        "--length-profile",
        choices=list(LENGTH_PROFILE_NAMES),
        default="fixed",
        help="fixed: no EOS, every sample has R tokens; geometric: every row samples EOS with probability "
        "4/R at every step (the random-weight model's EOS logit set so), lengths geometric with mean "
        "R/4, capped at R, as real responses spread (needs --temperature > 0); eos-rate: the same with "
        "mean --mean-length whatever R (a generous budget R: the same rows and tokens at every R); "
        "log-normal: lengths log-normal with mean --mean-length and shape --length-sigma, capped at R (a "
        "heavier tail)",
    )
    m.add_argument(
        "--mean-length",
        type=positive_int,
        default=32,
        metavar="M",
        help="--length-profile eos-rate or log-normal: the mean response length (eos-rate: EOS probability "
        "1/M at every step)",
    )
    m.add_argument(
        "--length-sigma",
        type=length_sigma,
        default=1.0,
        metavar="S",
        help="--length-profile log-normal: the shape of the log-normal (the sigma of log(length)), in (0, 4]",
    )
    m.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODE_NAMES),
        default=list(DEFAULT_MODES),
        help="the modes to time, in this order (hf-static: HF generate with its static cache; on CUDA "
        "HF compiles its decode in the first call, a warm-up call; shared-nocompact and "
        "prefix-nocompact: the rollout with compact_finished_rows=False)",
    )
    m.add_argument("--temperature", type=temperature, default=1.0, help="0 is greedy")
    m.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1]")
    t = b.add_argument_group("timing and output")
    t.add_argument("--warmup", type=non_negative_int, default=5, help="untimed calls per case and mode")
    t.add_argument("--iterations", type=positive_int, default=20, help="timed calls per case and mode")
    t.add_argument(
        "--output",
        metavar="FILE.json",
        help="write the header and every case's results as JSON, rewritten after each case",
    )
    t.add_argument("--plot", metavar="FILE.png", help="a PNG of stacked stage times (needs matplotlib)")
    t.add_argument(
        "--trace",
        metavar="DIR",
        help="one extra call per case and mode under torch.profiler, written as a Chrome trace DIR/<case>_<mode>.json",
    )
    t.add_argument(
        "--wide",
        action="store_true",
        help="the full table: also the kv_expand, decode and other stage times (with them the stages add "
        "up to the total), peak MiB, useful and total / expanded (the default table fits 120 "
        "columns; the JSON has every figure either way)",
    )
    t.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar on stderr (the line with the call count and estimate stays)",
    )
    t.add_argument(
        "--mismatch",
        action="store_true",
        help="after each case's timed calls, measure how far each mode's log-probabilities are from a "
        "trainer's forward over the same sequences (mean and max |delta|, k3 KL), for the rollout "
        "modes (also with a float32 LM head on a half-precision model) and HF generate",
    )
    b.set_defaults(func=cmd_bench)

    o = sub.add_parser(
        "bench-op",
        help="the repeat_kv_cache_ bandwidth table",
        description=bench_op.DESCRIPTION,
        epilog=bench_op.EPILOG,
    )
    bench_op.add_arguments(o)
    o.set_defaults(func=bench_op.execute)
    tr = sub.add_parser(
        "bench-train",
        help="shared-prefix vs plain forward + backward (patch_forward)",
        description=bench_train.DESCRIPTION,
        epilog=bench_train.EPILOG,
    )
    bench_train.add_arguments(tr)
    tr.set_defaults(func=bench_train.execute)
    tu = sub.add_parser(
        "bench-turns",
        help="multi-turn rollouts: the KV kept across turns (Rollout.extend) vs re-prefilled",
        description=bench_turns.DESCRIPTION,
        epilog=bench_turns.EPILOG,
    )
    bench_turns.add_arguments(tu)
    tu.set_defaults(func=bench_turns.execute)
    parser.commands = {"rollout": r, "bench": b, "bench-op": o, "bench-train": tr, "bench-turns": tu}
    return parser


def parse_args(argv: Sequence[str], parser: _Parser | None = None) -> argparse.Namespace:
    """Parse and check argv; bad input exits with code 2 and one line naming the subcommand's help."""
    parser = parser or build_parser()
    args, extras = parser.parse_known_args(argv)
    command = parser.commands.get(args.command)
    if extras:  # a subcommand's unknown flag: point to that subcommand's help, not the top level's
        (command or parser).error(f"unrecognized arguments: {' '.join(extras)}")
    if command is not None:
        try:
            CHECKS[args.command](args)
        except CLIError as e:
            command.error(str(e))
    return args


# --- the library ---------------------------------------------------------------------------------
def load_library() -> None:
    """torch and the compiled ops (deferred while `python -m torchkvops` parses its arguments)."""
    from .. import ops  # noqa: F401  (imports torch and torchkvops._C)


# --- entry point ---------------------------------------------------------------------------------
def _one_line_error(e: BaseException) -> bool:
    """Errors that are the input's or the machine's fault, not a bug: printed as one line."""
    if isinstance(e, (ValueError, TypeError, OSError, MemoryError, ImportError)):  # ImportError: a broken build
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, torch.OutOfMemoryError):
        return True
    # the CPU allocator's failure is a plain RuntimeError: "DefaultCPUAllocator: can't allocate memory"
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)


def error_line(text: str) -> None:
    """One line on stderr in ONE write: under torchrun the processes share stderr, and print's separate
    write of the newline would let another process's line land in the middle."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv:
            threads, why = threads_for_this_machine()
            argv = ["bench", *DEFAULT_BENCH_ARGS, "--threads", str(threads)]
            print(
                "torchkvops: no command given; running the short default benchmark:\n"
                "  torchkvops " + " ".join(argv) + f"\n(--threads {threads}: {why})\n"
                "(torchkvops --help lists the commands: rollout, bench, bench-op, bench-train, bench-turns)"
            )
        parser = build_parser()
        args = parse_args(argv, parser)
        if args.command is None:
            parser.print_help()
            return 2
        load_library()
        return args.func(args)
    except CLIError as e:
        error_line(f"torchkvops: error: {e}")
        return 2
    except RunError as e:
        error_line(f"torchkvops: error: {e}")
        return 1
    except KeyboardInterrupt:
        error_line("torchkvops: interrupted")
        return 130
    except Exception as e:
        if os.environ.get("TORCHKVOPS_DEBUG") or not _one_line_error(e):
            raise
        where = f"[rank {current_rank()}] " if current_world_size() > 1 else ""
        error_line(f"torchkvops: error: {where}{type(e).__name__}: {' '.join(str(e).split())}")
        return 1
    finally:
        stop_processes()
