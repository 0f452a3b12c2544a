"""The `torchkvops` command line (also `python -m torchkvops`).

  torchkvops rollout   generate N samples per prompt and print them (or write JSONL)
  torchkvops bench     the A/B matrix: the rollout's modes vs HF generate, interleaved (torchkvops.bench)
  torchkvops bench-op  the repeat_kv_cache_ bandwidth table (torchkvops.bench_op)
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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

from .cli_checks import (CHECKS, CLIError, check_bench_kv_memory, check_kv_memory, check_positions, device_name, int_in,
                         non_negative_int, positive_int, temperature, top_p)
from .cli_launch import (RunError, current_rank, current_world_size, say, shard_bounds, start_processes,
                         stop_processes)
from .cli_model import DTYPE_NAMES, load_config, load_model, pad_id, resolve_dtype, special_ids, vocab_size

__all__ = ["main", "build_parser", "parse_args", "DEFAULT_BENCH_ARGS", "MODEL_SHAPE_NAMES", "MODE_NAMES",
           "DEFAULT_MODES"]

# The names of torchkvops.models.MODEL_SHAPES, spelled out so that parsing needs no transformers
# (tests/test_cli.py checks that the two agree).
MODEL_SHAPE_NAMES = ("tiny", "llama-small", "opt-125m", "gpt2", "qwen3-0.6b", "opt-6.7b")
# torchkvops.bench_cases.MODES and DEFAULT_MODES, spelled out for the same reason (checked by the same test).
MODE_NAMES = ("expanded", "shared", "prefix", "hf-generate", "hf-static")
DEFAULT_MODES = ("expanded", "shared", "prefix", "hf-generate")
# The bare `torchkvops`: measured at 38 s on a shared 2-core CPU, model build included (5 iterations: 59 s);
# with the four default modes (prefix added), 28 s on the same CPU, less loaded (2026-11-30).
DEFAULT_BENCH_ARGS = ["--model-shape", "opt-125m", "--batch-sizes", "1", "--samples-per-prompt", "4",
                      "--prompt-lengths", "128", "--response-lengths", "16", "--warmup", "1", "--iterations", "3"]
MAX_SEED = 2**63 - 1


# --- parser --------------------------------------------------------------------------------------
class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default unless its help already speaks of one (and not None / False).
    (argparse prints no help line at all for an option without help text: every option has one.)"""

    def _get_help_string(self, action):
        help = action.help or ""
        default = action.default
        if (action.option_strings and "default" not in help and default is not None and default is not False
                and default is not argparse.SUPPRESS):
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
    g.add_argument("--model", metavar="PATH_OR_NAME",
                   help="a local Hugging Face checkpoint folder (or a name already in the local cache); loaded "
                        "offline. Default: a model built from --model-shape with random weights")
    g.add_argument("--model-shape", choices=MODEL_SHAPE_NAMES, default="opt-125m",
                   help="shape of the random-weight model used without --model")
    g.add_argument("--dtype", choices=list(DTYPE_NAMES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    g.add_argument("--device", type=device_name, default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    g.add_argument("--compile", action="store_true", help="torch.compile the rollout's prefill and decode")
    g.add_argument("--seed", type=int_in(0, MAX_SEED, " (2**63 - 1)"), default=0, help="sampling and prompt seed")


def build_parser() -> _Parser:
    from . import bench_op

    parser = _Parser(prog="torchkvops", description=__doc__.split("\n\n")[0],
                     epilog="With no command: a short default `bench` (" + " ".join(DEFAULT_BENCH_ARGS) + ").")
    sub = parser.add_subparsers(dest="command", metavar="{rollout,bench,bench-op}", parser_class=_Parser)

    r = sub.add_parser("rollout", help="generate N samples for each prompt and print them",
                       description="Generate N samples for each prompt and print them. Under torchrun the "
                                   "prompts are split among the processes (a prompt's samples stay together); the "
                                   "samples do not depend on the number of processes.")
    src = r.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable; needs --model)")
    src.add_argument("--prompts", metavar="FILE",
                     help="prompts, one per line, or JSONL with a \"prompt\" field (needs --model)")
    src.add_argument("--prompt-length", type=positive_int, default=16,
                     help="without text prompts: synthetic prompts of this many random token ids")
    src.add_argument("--num-prompts", type=positive_int, default=2,
                     help="without text prompts: how many synthetic prompts")
    _model_args(r)
    gen = r.add_argument_group("generation")
    gen.add_argument("-n", "--samples-per-prompt", type=positive_int, default=4, help="N")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32, help="R, the most tokens per sample")
    gen.add_argument("--temperature", type=temperature, default=1.0, help="0 is greedy")
    gen.add_argument("--top-k", type=non_negative_int, default=0, help="0 is off")
    gen.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1]")
    gen.add_argument("--no-shared-prefill", action="store_true",
                     help="the expanded baseline: prefill every prompt N times")
    r.add_argument("--output", metavar="FILE.jsonl", help="also write one JSON record per sample")
    r.set_defaults(func=cmd_rollout)

    b = sub.add_parser("bench", help="the A/B matrix: the rollout's modes vs HF generate, interleaved",
                       description="Time the rollout's modes (expanded prefill, shared prefill with the KV copied "
                                   "or kept once as a shared prefix) and HF generate (default or static cache) over "
                                   "a matrix of batch sizes, samples per prompt, prompt and response lengths. The "
                                   "modes run interleaved (A B C A B C ...) and are timed by one clock; the table "
                                   "gives decode ms per step and the bandwidth it achieves (weights + KV read per "
                                   "step), on CUDA also as a fraction of a copy_ roofline measured in the same run.",
                       epilog="Each case runs (warmup + iterations) calls per mode, plus one call for the peak "
                              "memory and one for --trace. After the first call, bench prints the number of "
                              "calls and an estimate of the run's time on stderr. Under torchrun every process "
                              "runs every case with its own --batch-sizes prompts (global batch = B x processes).")
    _model_args(b)
    m = b.add_argument_group("matrix")
    m.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1], metavar="B",
                   help="prompts per call (per process under torchrun)")
    m.add_argument("--samples-per-prompt", type=positive_int, nargs="+", default=[4], metavar="N",
                   help="samples per prompt")
    m.add_argument("--prompt-lengths", type=positive_int, nargs="+", default=[128], metavar="P",
                   help="prompt tokens (synthetic random ids)")
    m.add_argument("--response-lengths", type=positive_int, nargs="+", default=[16], metavar="R",
                   help="tokens generated per sample (no early stop)")
    m.add_argument("--modes", nargs="+", choices=list(MODE_NAMES), default=list(DEFAULT_MODES),
                   help="the modes to time, in this order (hf-static: HF generate with its static cache; on CUDA "
                        "HF compiles its decode in the first call, a warm-up call)")
    m.add_argument("--temperature", type=temperature, default=1.0, help="0 is greedy")
    m.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1]")
    t = b.add_argument_group("timing and output")
    t.add_argument("--warmup", type=non_negative_int, default=5, help="untimed calls per case and mode")
    t.add_argument("--iterations", type=positive_int, default=20, help="timed calls per case and mode")
    t.add_argument("--output", metavar="FILE.json",
                   help="write the header and every case's results as JSON, rewritten after each case")
    t.add_argument("--plot", metavar="FILE.png", help="a PNG of stacked stage times (needs matplotlib)")
    t.add_argument("--trace", metavar="DIR", help="one extra call per case and mode under torch.profiler, "
                                                  "written as a Chrome trace DIR/<case>_<mode>.json")
    t.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr (the line with the call count and estimate stays)")
    b.set_defaults(func=cmd_bench)

    o = sub.add_parser("bench-op", help="the repeat_kv_cache_ bandwidth table",
                       description=bench_op.DESCRIPTION, epilog=bench_op.EPILOG)
    bench_op.add_arguments(o)
    o.set_defaults(func=cmd_bench_op)
    parser.commands = {"rollout": r, "bench": b, "bench-op": o}
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
    from . import _load_ops

    _load_ops()


# --- rollout -------------------------------------------------------------------------------------
def read_prompts(path: str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"--prompts {path}: cannot read: {e}") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise CLIError(f"--prompts {path}: no prompts in the file")
    jsonl = path.endswith(".jsonl")
    if not jsonl:
        try:
            jsonl = isinstance(json.loads(numbered[0][1]), dict)
        except ValueError:
            jsonl = False
    if not jsonl:
        return [line for _, line in numbered]
    prompts = []
    for no, line in numbered:
        try:
            record = json.loads(line)
        except ValueError as e:
            raise CLIError(f"--prompts {path}:{no}: not JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise CLIError(f"--prompts {path}:{no}: a JSONL record needs a string \"prompt\" field")
        prompts.append(record["prompt"])
    return prompts


def cmd_rollout(args) -> int:
    import torch

    from .rollout import Rollout, RolloutConfig

    texts = list(args.prompt or []) + (read_prompts(args.prompts) if args.prompts else [])
    device = start_processes(args.device)
    rank, world = current_rank(), current_world_size()
    _, dtype = resolve_dtype(args.dtype, device)
    config = RolloutConfig(samples_per_prompt=args.samples_per_prompt, max_new_tokens=args.max_new_tokens,
                           shared_prefill=not args.no_shared_prefill, enable_profiling=True, compile=args.compile,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    model_config, source = load_config(args)
    n = args.samples_per_prompt
    # Under torchrun a process holds the KV of its own shard only: at most ceil(prompts / processes) prompts.
    most = -(-(len(texts) or args.num_prompts) // world)
    if not texts:
        check_positions(model_config, args.prompt_length + args.max_new_tokens,
                        f"--prompt-length {args.prompt_length} + --max-new-tokens {args.max_new_tokens}",
                        "lower one of them")
        check_kv_memory(model_config, device, dtype, most * n, args.prompt_length + args.max_new_tokens,
                        f"--num-prompts {args.num_prompts} x -n {n}"
                        + (f" over {world} processes" if world > 1 else ""),
                        "lower --num-prompts, --samples-per-prompt, --prompt-length or --max-new-tokens")
    model, tokenizer, _ = load_model(args, model_config, source, device, dtype)
    if texts:
        if tokenizer is None:
            raise CLIError(f"--model {args.model}: has no tokenizer, so text prompts cannot be encoded; "
                           "use --prompt-length for synthetic prompts")
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
        if input_ids.shape[1] == 0:
            raise CLIError("the prompts encode to no tokens")
        config.pad_token_id = tokenizer.pad_token_id
        total = input_ids.shape[1] + args.max_new_tokens
        check_positions(model_config, total, f"the longest prompt's {input_ids.shape[1]} tokens + --max-new-tokens "
                                             f"{args.max_new_tokens}", "shorten it or lower --max-new-tokens")
        check_kv_memory(model_config, device, dtype, most * n, total, f"{len(texts)} prompt(s) x -n {n}",
                        "fewer prompts, a lower --samples-per-prompt or --max-new-tokens")
    else:
        from .bench_cases import Case, synthetic_prompts

        case = Case(args.num_prompts, args.samples_per_prompt, args.prompt_length, args.max_new_tokens)
        input_ids = synthetic_prompts(case, vocab_size(model, tokenizer), special_ids(model, tokenizer), args.seed,
                                      torch.device("cpu"))
        attention_mask = torch.ones_like(input_ids)
        say(f"prompts: {args.num_prompts} synthetic prompts of {args.prompt_length} random token ids (seed {args.seed})")
    rollout = Rollout(model, config)
    # Every process holds every prompt (the same seed, the same files) and generates its contiguous shard.
    shards = shard_bounds(input_ids.shape[0], world)
    if world > 1:
        out = _generate_shard(rollout, input_ids, attention_mask, shards[rank])
    else:
        out = rollout.generate(input_ids, attention_mask)
    profile = rollout.get_last_profile()  # this process's own call (None when its shard was empty)
    kind = "expanded" if args.no_shared_prefill else "shared"
    if rank != 0:
        lo, hi = shards[rank]
        mine = (f"prompts {lo}..{hi - 1} ({hi - lo} x {n} samples), {profile.generated_tokens} tokens in "
                f"{profile.total_ms:.1f} ms ({profile.tokens_per_second:.1f} tokens/s)") if hi > lo else "no prompts"
        print(f"rank {rank}/{world}: {mine}; rank 0 prints the samples")
        return 0

    records = []
    responses, mask = out.responses.cpu(), out.response_mask.cpu()
    owner = [r for r, (lo, hi) in enumerate(shards) for _ in range(lo, hi)]
    for i in range(input_ids.shape[0]):
        prompt_ids = input_ids[i][attention_mask[i].bool()].tolist()
        prompt_text = texts[i] if texts else None
        print(f"\n=== prompt {i}: " + (repr(prompt_text) if texts else f"{len(prompt_ids)} token ids {_ids(prompt_ids)}"))
        for j in range(n):
            row = i * n + j
            ids = responses[row][mask[row].bool()].tolist()
            text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None
            print(f"--- sample {j} ({len(ids)} tokens): " + (repr(text) if text is not None else _ids(ids)))
            records.append({"prompt_index": i, "sample_index": j, "rank": owner[i], "prompt": prompt_text,
                            "prompt_token_ids": prompt_ids, "token_ids": ids, "text": text})
    stages = (f"prefill {profile.prefill_ms:.1f} ms, kv_expand {profile.kv_expand_ms:.2f} ms, decode "
              f"{profile.decode_ms:.1f} ms; {kind} prefill")
    if world > 1:
        import torch.distributed as dist

        lo, hi = shards[0]
        print(f"\n{input_ids.shape[0]} prompts x {n} samples on {world} processes ({dist.get_backend()}), "
              f"{int(mask.sum())} tokens; rank 0's {hi - lo} prompt(s): {profile.generated_tokens} tokens in "
              f"{profile.total_ms:.1f} ms ({profile.tokens_per_second:.1f} tokens/s; {stages})")
    else:
        print(f"\n{input_ids.shape[0]} prompts x {n} samples, {profile.generated_tokens} tokens in "
              f"{profile.total_ms:.1f} ms ({profile.tokens_per_second:.1f} tokens/s; {stages})")
    if args.output:
        from .atomic_write import write_text_atomic

        write_text_atomic(args.output, "".join(json.dumps(rec) + "\n" for rec in records))
        print(f"wrote {len(records)} records to {args.output}")
    return 0


def _generate_shard(rollout, input_ids, attention_mask, bounds: tuple[int, int]):
    """This process's shard through torchkvops.distributed.generate; every process gets every row, in
    rank order (= prompt order). A failure on any process raises on every process: one line each."""
    from . import distributed

    lo, hi = bounds
    ids, mask = (input_ids[lo:hi], attention_mask[lo:hi]) if hi > lo else (None, None)
    try:
        return distributed.generate(rollout, ids, mask, gather=True)
    except RuntimeError as e:  # distributed.generate's own report of a failed process, or a broken group
        if os.environ.get("TORCHKVOPS_DEBUG"):
            raise
        raise RunError(f"[rank {current_rank()}] {' '.join(str(e).split())}") from None


def _ids(ids: list[int], limit: int = 24) -> str:
    return str(ids) if len(ids) <= limit else str(ids[:limit])[:-1] + f", ... ({len(ids) - limit} more)]"


# --- bench ---------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    import torch

    from . import __version__, bench, bench_cases, bench_metrics, bench_report, bench_runners, bench_stats, bench_world
    from .atomic_write import write_json_atomic

    device = start_processes(args.device)
    world = bench_world.World()
    dtype_name, dtype = resolve_dtype(args.dtype, device)
    modes = list(dict.fromkeys(args.modes))
    cases = bench_cases.plan_cases(args.batch_sizes, args.samples_per_prompt, args.prompt_lengths,
                                   args.response_lengths)
    model_config, source = load_config(args)
    longest = max(cases, key=lambda c: c.prompt_length + c.response_length)
    check_positions(model_config, longest.prompt_length + longest.response_length,
                    f"case {longest.name}: --prompt-lengths {longest.prompt_length} + --response-lengths "
                    f"{longest.response_length}", "lower them")
    check_bench_kv_memory(model_config, device, dtype, cases, modes)
    if args.trace:
        try:
            os.makedirs(args.trace, exist_ok=True)
        except OSError as e:
            raise CLIError(f"--trace {args.trace}: cannot create the folder: {e}") from None
    model, tokenizer, model_desc = load_model(args, model_config, source, device, dtype)

    roofline = bench_metrics.copy_roofline(device)  # CUDA only: measured before any case, on this process's device
    settings = bench_cases.Settings(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                    compile=args.compile, warmup=args.warmup, iterations=args.iterations,
                                    trace_dir=args.trace,
                                    roofline_gbps=roofline["copy_roofline_gbps"] if roofline else None)
    traffic = bench_metrics.Traffic.of(model, settings.roofline_gbps)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    rank_devices = world.device_description(device, device_name)
    if roofline is not None and world.size > 1:
        rooflines = world.gather_records([roofline], ["copy_roofline_gbps"])
        roofline["rank_copy_roofline_gbps"] = [rows[0]["copy_roofline_gbps"] for rows in rooflines]
    import transformers

    compiled = ", compiled" if args.compile else ""
    descriptions = {
        "expanded": f"Rollout(shared_prefill=False, eos_token_id=[]){compiled}",
        "shared": f"Rollout(shared_prefill=True, kv_sharing='copy', eos_token_id=[]){compiled}",
        "prefix": f"Rollout(shared_prefill=True, kv_sharing='prefix', eos_token_id=[]){compiled}",
        "hf-generate": "model.generate, default (dynamic) cache, eager (--compile does not apply), "
                       "max_new_tokens=min_new_tokens=R, eos_token_id=None (no EOS, as the rollout's eos_token_id=[]), "
                       "top_k=0",
        "hf-static": "model.generate(cache_implementation='static'), otherwise as hf-generate, run as Hugging Face "
                     "runs it: on CUDA transformers compiles its decode step (torch.compile, mode 'reduce-overhead') "
                     "in the first call of each new shape, so the warm-up calls include that compilation (with "
                     "--warmup 0 the first timed call does); on the CPU it does not compile. transformers sizes the "
                     "static cache to the longest max length of this process's earlier calls, so a case run after a "
                     "longer one gets a larger cache",
    }
    header = {
        "tool": "torchkvops bench",
        "model": model_desc,
        "model_class": type(model).__name__,
        "model_shape": None if args.model else args.model_shape,
        "random_weights": not args.model,
        "dtype": dtype_name,
        "device": str(device),
        "device_name": device_name,
        "cpu_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "torchkvops_version": __version__,
        "python_version": platform.python_version(),
        "world_size": world.size,
        "backend": world.backend,
        "rank_devices": rank_devices,
        "timing": bench.TIMING_NOTE,
        "decode_ms_per_step_method": bench_runners.DECODE_STEP_NOTE,
        "bytes_per_step": {"weight_bytes": traffic.weight_bytes, "kv_bytes_per_token": traffic.kv_bytes_per_token,
                           "formula": bench_metrics.BYTES_NOTE},
        "roofline": roofline,
        "peak_memory_method": "cuda_allocator" if device.type == "cuda" else "cpu_profiler",
        "peak_memory_note": bench_metrics.PEAK_NOTE[device.type],
        "sampling": "greedy" if settings.greedy else f"temperature={args.temperature} top_p={args.top_p} top_k=0",
        "modes": {m: descriptions[m] for m in modes},
        "file_note": bench_report.FILE_NOTE,
        "median_stages_note": bench_stats.MEDIAN_STAGES_NOTE,
        "tokens_agree_note": bench_stats.TOKENS_AGREE_NOTE,
        "flags": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "cases_requested": [c.name for c in cases],
        "cases_run_order": [cases[i].name for i in bench_cases.run_order(cases)],
    }
    if world.size > 1:
        header["world_note"] = bench_world.WORLD_NOTE
    per_mode = bench.calls_per_mode(settings, device)
    where = (f"{world.size} processes ({world.backend}), each on {device.type} with its own --batch-sizes prompts"
             if world.size > 1 else f"{device_name} ({device})")
    say(f"bench: {len(cases)} case(s) x {len(modes)} mode(s) x {per_mode} calls on {where}, {dtype_name}, "
        f"{header['sampling']}, warmup {args.warmup}, {args.iterations} timed "
        f"iteration{'s' if args.iterations != 1 else ''}, modes interleaved"
        + (f"; copy_ roofline {roofline['copy_roofline_gbps']:.0f} GB/s" if roofline else ""))

    results: list[dict | None] = [None] * len(cases)

    def save(status: str) -> None:
        if args.output and world.is_main:
            write_json_atomic(args.output, bench_report.results_document(header, cases, results, status))

    def save_during_run() -> None:
        """A write that fails mid-run (the folder removed, the disk full) is reported and retried after
        the next case; the results so far stay in memory and the run goes on."""
        try:
            save("partial")
        except OSError as e:
            print(f"torchkvops: warning: cannot write --output {args.output} ({e.strerror or e}); "
                  "trying again after the next case", file=sys.stderr)

    save_during_run()  # the header at once: a run that dies before its first case still leaves a record

    def case_done(i: int, result: dict) -> None:
        results[i] = result
        save_during_run()

    try:
        with bench.recompile_headroom(args.compile or "hf-static" in modes):
            bench.run_matrix(model, cases, modes, settings, vocab_size=vocab_size(model, tokenizer),
                             special_ids=special_ids(model, tokenizer), pad_token_id=pad_id(model, tokenizer),
                             progress=not args.no_progress, on_case=case_done, world=world)
    except KeyboardInterrupt:
        finished = [r for r in results if r is not None]
        for result in finished:
            say()
            say(bench_report.format_case_table(result, args.iterations))
        save("interrupted")
        kept = f"; {len(finished)} finished case(s) are in {args.output}" if args.output and finished else ""
        if world.is_main:
            print(f"torchkvops: interrupted after {len(finished)} of {len(cases)} case(s){kept}", file=sys.stderr)
        return 130
    for result in results:  # the tables first: they are shown even if the last write fails
        say()
        say(bench_report.format_case_table(result, args.iterations))
    save("complete")
    failed = [r["case"] for r in results if r["error"]]
    if args.output:
        say(f"\nwrote {args.output}")
    if args.plot and world.is_main:
        bench_report.plot_stage_times(results, args.plot, f"{model_desc}, {dtype_name}, {device_name}")
        say(f"wrote {args.plot}")
    if args.trace:
        say(f"wrote Chrome traces to {os.path.join(args.trace, '')} (open in chrome://tracing or "
            "https://ui.perfetto.dev)")
    if failed:
        if world.is_main:
            print(f"torchkvops: {len(failed)} case(s) failed: {', '.join(failed)} (errors in the table"
                  f"{' and the JSON' if args.output else ''})", file=sys.stderr)
        return 1
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def cmd_bench_op(args) -> int:
    from . import bench_op

    return bench_op.execute(args)


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
            print("torchkvops: no command given; running the short default benchmark:\n"
                  "  torchkvops bench " + " ".join(DEFAULT_BENCH_ARGS) + "\n"
                  "(torchkvops --help lists the commands: rollout, bench, bench-op)")
            argv = ["bench", *DEFAULT_BENCH_ARGS]
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
