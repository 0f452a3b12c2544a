"""The `torchkvops` command line (also `python -m torchkvops`).

  torchkvops rollout   generate N samples per prompt and print them (or write JSONL)
  torchkvops bench     the A/B matrix: expanded vs shared prefill vs HF generate (torchkvops.bench)
  torchkvops bench-op  the repeat_kv_cache_ bandwidth table (torchkvops.bench_op)
  torchkvops           with no arguments: a short default `bench` (about a minute on a small CPU)

Without --model the model is built in memory from a named shape with random weights (nothing is
downloaded). With --model, a local Hugging Face checkpoint (and its tokenizer) is loaded offline.
Bad input ends with one line on stderr, `torchkvops: error: ...`, and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["main", "build_parser", "CLIError", "DEFAULT_BENCH_ARGS"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The bare `torchkvops`: measured at 38 s on a shared 2-core CPU, model build included (5 iterations: 59 s).
DEFAULT_BENCH_ARGS = ["--model-shape", "opt-125m", "--batch-sizes", "1", "--samples-per-prompt", "4",
                      "--prompt-lengths", "128", "--response-lengths", "16", "--warmup", "1", "--iterations", "3"]
PLOT_HINT = "pip install matplotlib  (or: pip install torchkvops[plot])"


class CLIError(Exception):
    """Bad input: printed as one line, exit code 2."""


# --- argument types ------------------------------------------------------------------------------
def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


positive_int, non_negative_int = _int_at_least(1), _int_at_least(0)


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return v


def temperature(text: str) -> float:
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 is greedy), got {v}")
    return v


def top_p(text: str) -> float:
    v = _float(text)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v}")
    return v


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the usage block
        where = self.prog.removeprefix("torchkvops").strip()
        self.exit(2, f"torchkvops: error: {where + ': ' if where else ''}{message} (see {self.prog} --help)\n")


def _model_args(p: argparse.ArgumentParser) -> None:
    from .models import MODEL_SHAPES

    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PATH_OR_NAME",
                   help="a local Hugging Face checkpoint folder (or a name already in the local cache); loaded "
                        "offline. Default: a model built from --model-shape with random weights")
    g.add_argument("--model-shape", choices=list(MODEL_SHAPES), default="opt-125m",
                   help="shape of the random-weight model used without --model (default: %(default)s)")
    g.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: fp32 on CPU, bf16 on CUDA")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    g.add_argument("--compile", action="store_true", help="torch.compile the rollout's prefill and decode")
    g.add_argument("--seed", type=non_negative_int, default=0, help="sampling and prompt seed (default: 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torchkvops", description=__doc__.split("\n\n")[0],
                     epilog="With no command: a short default `bench` (" + " ".join(DEFAULT_BENCH_ARGS) + ").")
    sub = parser.add_subparsers(dest="command", metavar="{rollout,bench,bench-op}", parser_class=_Parser)

    r = sub.add_parser("rollout", help="generate N samples for each prompt and print them",
                       description="Generate N samples for each prompt and print them.")
    src = r.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable; needs --model)")
    src.add_argument("--prompts", metavar="FILE",
                     help="prompts, one per line, or JSONL with a \"prompt\" field (needs --model)")
    src.add_argument("--prompt-length", type=positive_int, default=16,
                     help="without text prompts: synthetic prompts of this many random token ids (default: 16)")
    src.add_argument("--num-prompts", type=positive_int, default=2,
                     help="without text prompts: how many synthetic prompts (default: 2)")
    _model_args(r)
    gen = r.add_argument_group("generation")
    gen.add_argument("-n", "--samples-per-prompt", type=positive_int, default=4, help="N (default: 4)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32, help="(default: 32)")
    gen.add_argument("--temperature", type=temperature, default=1.0, help="0 is greedy (default: 1.0)")
    gen.add_argument("--top-k", type=non_negative_int, default=0, help="0 is off (default: 0)")
    gen.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1] (default: 1.0)")
    gen.add_argument("--no-shared-prefill", action="store_true",
                     help="the expanded baseline: prefill every prompt N times")
    r.add_argument("--output", metavar="FILE.jsonl", help="also write one JSON record per sample")
    r.set_defaults(func=cmd_rollout)

    b = sub.add_parser("bench", help="the A/B matrix: expanded vs shared prefill vs HF generate",
                       description="Time expanded prefill, shared prefill and HF generate over a matrix of "
                                   "batch sizes, samples per prompt, prompt and response lengths.")
    _model_args(b)
    m = b.add_argument_group("matrix")
    m.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1], metavar="B")
    m.add_argument("--samples-per-prompt", type=positive_int, nargs="+", default=[4], metavar="N")
    m.add_argument("--prompt-lengths", type=positive_int, nargs="+", default=[128], metavar="P")
    m.add_argument("--response-lengths", type=positive_int, nargs="+", default=[16], metavar="R")
    m.add_argument("--modes", nargs="+", choices=["expanded", "shared", "hf-generate"],
                   default=["expanded", "shared", "hf-generate"])
    m.add_argument("--temperature", type=temperature, default=1.0, help="0 is greedy (default: 1.0)")
    m.add_argument("--top-p", type=top_p, default=1.0, help="in (0, 1] (default: 1.0)")
    t = b.add_argument_group("timing and output")
    t.add_argument("--warmup", type=non_negative_int, default=5, help="untimed calls per case and mode (default: 5)")
    t.add_argument("--iterations", type=positive_int, default=20, help="timed calls per case and mode (default: 20)")
    t.add_argument("--output", metavar="FILE.json", help="write the header and every case's results as JSON")
    t.add_argument("--plot", metavar="FILE.png", help="a PNG of stacked stage times (needs matplotlib)")
    t.add_argument("--trace", metavar="DIR", help="one extra call per case and mode under torch.profiler, "
                                                  "written as a Chrome trace DIR/<case>_<mode>.json")
    t.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    b.set_defaults(func=cmd_bench)

    sub.add_parser("bench-op", help="the repeat_kv_cache_ bandwidth table (see: torchkvops bench-op --help)",
                   add_help=False)
    return parser


# --- device, dtype, model ------------------------------------------------------------------------
def resolve_device(text: str | None) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise CLIError(f"--device {text!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(f"--device {text}: no CUDA GPU is available here (torch {torch.__version__}, "
                           f"built for CUDA {torch.version.cuda or 'none'})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CLIError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise CLIError(f"--device {text}: only cpu and cuda are supported")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> tuple[str, torch.dtype]:
    if name is None:
        name = "fp32" if device.type == "cpu" else "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    dtype = DTYPES[name]
    try:  # the models need matmul in this dtype on this device
        a = torch.ones(8, 8, dtype=dtype, device=device)
        (a @ a).sum().item()
    except RuntimeError as e:
        raise CLIError(f"--dtype {name} is not supported for matmul on {device}: {' '.join(str(e).split())}") from None
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise CLIError(f"--dtype bf16: {torch.cuda.get_device_name(device)} has no native bf16; use fp16")
    if device.type == "cpu" and dtype == torch.float16:
        print("torchkvops: note: fp16 on CPU works but is slow on most CPUs; fp32 or bf16 are faster",
              file=sys.stderr)
    return name, dtype


def load_model(args, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer or None, description). Without --model: random weights of --model-shape."""
    if not args.model:
        from .models import build_model

        model = build_model(args.model_shape, dtype, device, seed=0)  # --seed changes prompts and sampling only
        print(f"model: {args.model_shape} shape with RANDOM weights (built in memory, nothing downloaded); "
              "its tokens are not meaningful text")
        return model, None, f"{args.model_shape} (random weights)"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr is for errors
    path = Path(args.model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CLIError(f"--model {args.model}: is a file, not a checkpoint folder")
        if not (path / "config.json").is_file():
            raise CLIError(f"--model {args.model}: not a Hugging Face checkpoint (no config.json in the folder)")
        source, is_name = str(path), False
    elif args.model.startswith((".", "/", "~")) or args.model.count("/") > 1 or os.sep != "/" and os.sep in args.model:
        raise CLIError(f"--model {args.model}: no such folder")
    else:
        source, is_name = args.model, True  # a hub name: only from the local cache
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True)
    except OSError as e:
        if is_name:  # a name: transformers' message is about the network, say it plainly
            raise CLIError(f"--model {args.model}: no such folder, and no such model in the local Hugging Face "
                           "cache (offline: nothing is downloaded)") from None
        raise CLIError(f"--model {args.model}: cannot load a causal LM: {' '.join(str(e).split())}") from None
    except (ValueError, TypeError, KeyError) as e:
        raise CLIError(f"--model {args.model}: cannot load a causal LM: {' '.join(str(e).split())}") from None
    model = model.to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, padding_side="left")
    except (OSError, ValueError, TypeError, KeyError):
        tokenizer = None
    if tokenizer is not None and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    params = sum(p.numel() for p in model.parameters())
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M" if params >= 1e6 else f"{params / 1e3:.1f}k"
    print(f"model: {args.model} ({type(model).__name__}, {size} parameters"
          f"{'' if tokenizer is not None else ', no tokenizer'})")
    return model, tokenizer, str(args.model)


def special_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
            v = getattr(cfg, attr, None)
            ids.update([v] if isinstance(v, int) else [i for i in (v or []) if isinstance(i, int)])
    if tokenizer is not None:
        ids.update(tokenizer.all_special_ids)
    return ids


def vocab_size(model, tokenizer) -> int:
    n = model.get_input_embeddings().num_embeddings
    return min(n, len(tokenizer)) if tokenizer is not None else n


def pad_id(model, tokenizer) -> int:
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    from .hf import ModelAdapter

    adapter = ModelAdapter(model)
    return adapter.pad_id(None, adapter.eos_ids(None))


def check_length(model, total: int, hint: str) -> None:
    from .hf import ModelAdapter

    try:
        ModelAdapter(model).check_length(total)
    except ValueError as e:
        raise CLIError(f"{str(e).removeprefix('torchkvops: ')}; {hint}") from None


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
    from .rollout import Rollout, RolloutConfig

    texts = list(args.prompt or []) + (read_prompts(args.prompts) if args.prompts else [])
    if texts and not args.model:
        raise CLIError("--prompt/--prompts need --model (a checkpoint with a tokenizer); without --model, "
                       "use --prompt-length for synthetic prompts")
    device = resolve_device(args.device)
    _, dtype = resolve_dtype(args.dtype, device)
    config = RolloutConfig(samples_per_prompt=args.samples_per_prompt, max_new_tokens=args.max_new_tokens,
                           shared_prefill=not args.no_shared_prefill, enable_profiling=True, compile=args.compile,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    model, tokenizer, _ = load_model(args, device, dtype)
    if texts:
        if tokenizer is None:
            raise CLIError(f"--model {args.model}: has no tokenizer, so text prompts cannot be encoded; "
                           "use --prompt-length for synthetic prompts")
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
        if input_ids.shape[1] == 0:
            raise CLIError("the prompts encode to no tokens")
        config.pad_token_id = tokenizer.pad_token_id
    else:
        from .bench import Case, synthetic_prompts

        case = Case(args.num_prompts, args.samples_per_prompt, args.prompt_length, args.max_new_tokens)
        input_ids = synthetic_prompts(case, vocab_size(model, tokenizer), special_ids(model, tokenizer), args.seed,
                                      torch.device("cpu"))
        attention_mask = torch.ones_like(input_ids)
        print(f"prompts: {args.num_prompts} synthetic prompts of {args.prompt_length} random token ids (seed {args.seed})")
    check_length(model, input_ids.shape[1] + args.max_new_tokens,
                 f"the longest prompt has {input_ids.shape[1]} tokens: shorten it or lower --max-new-tokens")
    rollout = Rollout(model, config)
    out = rollout.generate(input_ids, attention_mask)
    profile = rollout.get_last_profile()

    n = args.samples_per_prompt
    records = []
    responses, mask = out.responses.cpu(), out.response_mask.cpu()
    for i in range(input_ids.shape[0]):
        prompt_ids = input_ids[i][attention_mask[i].bool()].tolist()
        prompt_text = texts[i] if texts else None
        print(f"\n=== prompt {i}: " + (repr(prompt_text) if texts else f"{len(prompt_ids)} token ids {_ids(prompt_ids)}"))
        for j in range(n):
            row = i * n + j
            ids = responses[row][mask[row].bool()].tolist()
            text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None
            print(f"--- sample {j} ({len(ids)} tokens): " + (repr(text) if text is not None else _ids(ids)))
            records.append({"prompt_index": i, "sample_index": j, "prompt": prompt_text,
                            "prompt_token_ids": prompt_ids, "token_ids": ids, "text": text})
    print(f"\n{input_ids.shape[0]} prompts x {n} samples, {profile.generated_tokens} tokens in "
          f"{profile.total_ms:.1f} ms ({profile.tokens_per_second:.1f} tokens/s; prefill {profile.prefill_ms:.1f} ms, "
          f"kv_expand {profile.kv_expand_ms:.2f} ms, decode {profile.decode_ms:.1f} ms; "
          f"{'expanded' if args.no_shared_prefill else 'shared'} prefill)")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
        print(f"wrote {len(records)} records to {args.output}")
    return 0


def _ids(ids: list[int], limit: int = 24) -> str:
    return str(ids) if len(ids) <= limit else str(ids[:limit])[:-1] + f", ... ({len(ids) - limit} more)]"


# --- bench ---------------------------------------------------------------------------------------
def _check_output_path(path: str | None, flag: str) -> None:
    if path is not None:
        parent = Path(path).expanduser().resolve().parent
        if not parent.is_dir():
            raise CLIError(f"{flag} {path}: the folder {parent} does not exist")


def cmd_bench(args) -> int:
    from . import __version__
    from . import bench

    if args.plot:  # at startup, not after minutes of benchmarking
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise CLIError(f"--plot needs matplotlib, which is not installed: {PLOT_HINT}") from None
    _check_output_path(args.output, "--output")
    _check_output_path(args.plot, "--plot")
    if args.trace:
        try:
            os.makedirs(args.trace, exist_ok=True)
        except OSError as e:
            raise CLIError(f"--trace {args.trace}: cannot create the folder: {e}") from None
    device = resolve_device(args.device)
    dtype_name, dtype = resolve_dtype(args.dtype, device)
    modes = list(dict.fromkeys(args.modes))
    cases = bench.plan_cases(args.batch_sizes, args.samples_per_prompt, args.prompt_lengths, args.response_lengths)
    model, tokenizer, model_desc = load_model(args, device, dtype)
    longest = max(cases, key=lambda c: c.prompt_length + c.response_length)
    check_length(model, longest.prompt_length + longest.response_length,
                 f"case {longest.name}: lower --prompt-lengths or --response-lengths")

    settings = bench.Settings(temperature=args.temperature, top_p=args.top_p, seed=args.seed, compile=args.compile,
                              warmup=args.warmup, iterations=args.iterations, trace_dir=args.trace)
    import transformers

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
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
        "peak_memory_method": "cuda_allocator" if device.type == "cuda" else "cpu_profiler",
        "peak_memory_note": ("torch.cuda.max_memory_allocated over each timed call (weights included)"
                             if device.type == "cuda" else
                             "one extra call under torch.profiler(profile_memory=True): peak of the running sum of "
                             "its [memory] events, i.e. memory held beyond what was allocated when the call began "
                             "(weights excluded)"),
        "sampling": "greedy" if settings.greedy else f"temperature={args.temperature} top_p={args.top_p} top_k=0",
        "modes": {
            "expanded": "Rollout(shared_prefill=False, eos_token_id=[])" + (", compiled" if args.compile else ""),
            "shared": "Rollout(shared_prefill=True, eos_token_id=[])" + (", compiled" if args.compile else ""),
            "hf-generate": "model.generate, eager (--compile does not apply), max_new_tokens=min_new_tokens=R, "
                           "eos_token_id=None (no EOS, as the rollout's eos_token_id=[]), top_k=0",
        },
        "flags": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "cases_requested": [c.name for c in cases],
        "cases_run_order": [cases[i].name for i in bench.run_order(cases)],
    }
    print(f"bench: {len(cases)} case(s) x {len(modes)} mode(s) on {device_name} ({device}), {dtype_name}, "
          f"{header['sampling']}, warmup {args.warmup}, {args.iterations} timed iterations")
    with bench.recompile_headroom(args.compile):
        results = bench.run_matrix(model, cases, modes, settings, vocab_size=vocab_size(model, tokenizer),
                                   special_ids=special_ids(model, tokenizer), pad_token_id=pad_id(model, tokenizer),
                                   progress=not args.no_progress)
    for result in results:
        print()
        print(bench.format_case_table(result, args.iterations))
    failed = [r["case"] for r in results if r["error"]]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump({"header": header, "cases": results}, fh, indent=2)
        print(f"\nwrote {args.output}")
    if args.plot:
        bench.plot_stage_times(results, args.plot, f"{model_desc}, {dtype_name}, {device_name}")
        print(f"wrote {args.plot}")
    if args.trace:
        print(f"wrote Chrome traces to {args.trace}/ (open in chrome://tracing or https://ui.perfetto.dev)")
    if failed:
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


def cmd_bench_op(argv: Sequence[str]) -> int:
    try:
        from . import bench_op
    except ImportError as e:
        raise CLIError(f"bench-op is not available in this install: {e}") from None
    try:
        return bench_op.main(list(argv), prog="torchkvops bench-op")
    except SystemExit as e:  # bench_op stops with SystemExit("bench-op: ...") on bad input
        if isinstance(e.code, str):
            raise CLIError(e.code.removeprefix("bench-op: ")) from None
        raise


# --- entry point ---------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv:
            print("torchkvops: no command given; running the short default benchmark:\n"
                  "  torchkvops bench " + " ".join(DEFAULT_BENCH_ARGS) + "\n"
                  "(torchkvops --help lists the commands: rollout, bench, bench-op)")
            argv = ["bench", *DEFAULT_BENCH_ARGS]
        if argv[0] == "bench-op":
            return cmd_bench_op(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return args.func(args)
    except CLIError as e:
        print(f"torchkvops: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError, torch.OutOfMemoryError) as e:
        if os.environ.get("TORCHKVOPS_DEBUG"):
            raise
        print(f"torchkvops: error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("torchkvops: interrupted", file=sys.stderr)
        return 130
