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

This module holds the parser, built from COMMANDS, and the entry point (main). Each command is a module
of its own that owns its parser, its checks and its run: NAME, HELP, DESCRIPTION, EPILOG,
add_arguments(parser), check_args(args) (raises CLIError) and execute(args) -> exit code:
  rollout  bench  bench_op  bench_train  bench_turns
What they share: arguments (the model group, the shape arguments, the names they choose from), checks
(the argument types and the checks made before the work), launch (alone or under torchrun: the process
group, the device, --threads, the shards, say()), model (the dtype, the config, the model and tokenizer).
The measurements themselves are the benchmark harness's (torchkvops/bench/). Nothing that the parser
imports loads torch or transformers.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import bench, bench_op, bench_train, bench_turns, rollout
from .checks import CLIError
from .launch import RunError, current_rank, current_world_size, stop_processes, threads_for_this_machine

__all__ = [
    "main",
    "build_parser",
    "parse_args",
    "COMMANDS",
    "DEFAULT_BENCH_ARGS",
]

# The bare `torchkvops`: 45 s on this project's 2-core CPU with --threads 1 (threads_for_this_machine's
# choice there), model build included (2026-12-07; the README says so).
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
# The commands, in the order --help lists them.
COMMANDS = (rollout, bench, bench_op, bench_train, bench_turns)


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
        self.commands: dict[str, _Parser] = {}  # each command's subparser, by its name
        self.checks: dict = {}  # each command's check_args, by its name

    def error(self, message: str):  # one line, not the usage block
        where = self.prog.removeprefix("torchkvops").strip()
        self.exit(2, f"torchkvops: error: {where + ': ' if where else ''}{message} (see {self.prog} --help)\n")


def build_parser() -> _Parser:
    parser = _Parser(
        prog="torchkvops",
        description=__doc__.split("\n\n")[0],
        epilog="With no command: a short default `bench` (" + " ".join(DEFAULT_BENCH_ARGS) + ").",
    )
    names = ",".join(command.NAME for command in COMMANDS)
    sub = parser.add_subparsers(dest="command", metavar="{" + names + "}", parser_class=_Parser)
    for command in COMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP, description=command.DESCRIPTION, epilog=command.EPILOG)
        command.add_arguments(p)
        p.set_defaults(func=command.execute)
        parser.commands[command.NAME] = p
        parser.checks[command.NAME] = command.check_args
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
            parser.checks[args.command](args)
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
                f"(torchkvops --help lists the commands: {', '.join(c.NAME for c in COMMANDS)})"
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
