"""`torchkvops bench`: the A/B matrix of torchkvops.bench.matrix from the command line: its arguments, the
checks made before any work, and the run, which resolves the device, checks the sizes against the
model's config and the memory free, builds the model, writes the JSON header, runs the matrix
(rewriting --output after every case), then prints a table per case and draws the plot.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

from .arguments import DEFAULT_MODES, LENGTH_PROFILE_NAMES, MODE_NAMES, add_model_group
from .checks import (
    CLIError,
    check_bench_kv_memory,
    check_max_rows,
    check_output_dir,
    check_output_file,
    check_plot_path,
    check_positions,
    check_token_memory,
    length_sigma,
    model_source,
    non_negative_int,
    positive_int,
    temperature,
    top_p,
)
from .launch import say, set_threads, start_processes
from .model import eos_id, load_config, load_model, pad_id, resolve_dtype, special_ids, vocab_size

__all__ = ["NAME", "HELP", "DESCRIPTION", "EPILOG", "add_arguments", "check_args", "execute"]

NAME = "bench"
HELP = "the A/B matrix: the rollout's modes vs HF generate, interleaved"
DESCRIPTION = (
    "Time the rollout's modes (expanded prefill, shared prefill with the KV copied or kept once as a shared "
    "prefix) and HF generate (default or static cache) over a matrix of batch sizes, samples per prompt, "
    "prompt and response lengths. The modes run interleaved (A B C A B C ...) and are timed by one clock; "
    "the table gives decode ms per step and the bandwidth it achieves (weights + KV read per step), on CUDA "
    "also as a fraction of a copy_ roofline measured in the same run."
)
EPILOG = (
    "Each case runs (warmup + iterations) calls per mode, plus one call for the peak memory and one for "
    "--trace. After the first call, bench prints the number of calls and an estimate of the run's time on "
    "stderr. Under torchrun every process runs every case with its own --batch-sizes prompts (global batch "
    "= B x processes)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_group(p)
    _add_matrix_group(p)
    _add_output_group(p)


def _add_matrix_group(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("matrix")
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


def _add_output_group(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("timing and output")
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


def check_args(args) -> None:
    """The checks argparse cannot make one flag at a time, before any work (no torch needed)."""
    check_max_rows(args, max(args.samples_per_prompt))
    if args.max_kv_tokens is not None and "paged" not in args.modes:
        raise CLIError(
            f"--max-kv-tokens {args.max_kv_tokens} applies to the paged mode only (the layout whose blocks it "
            f"counts), and --modes has none ({' '.join(args.modes)}): add paged"
        )
    if args.model:
        model_source(args.model)
    check_output_file(args.output, "--output")
    check_plot_path(args.plot)
    check_output_dir(args.trace, "--trace")
    if args.length_profile != "fixed" and args.temperature == 0:
        raise CLIError(
            f"--length-profile {args.length_profile} needs sampling (--temperature > 0): greedy decoding would "
            "pick the EOS token never or always"
        )
    b, n, p, r = (
        max(args.batch_sizes),
        max(args.samples_per_prompt),
        max(args.prompt_lengths),
        max(args.response_lengths),
    )
    check_token_memory(
        b,
        n,
        p,
        r,
        f"the largest case (B={b} N={n} P={p} R={r})",
        "lower --batch-sizes, --samples-per-prompt, --prompt-lengths or --response-lengths",
    )


def execute(args) -> int:
    """`torchkvops bench`: the model and the cases, the JSON header, the matrix run (--output rewritten after
    every case), then a table per case, the plot and the traces. 1 when a case failed, 130 interrupted."""
    from ..bench import world as bench_world

    device = start_processes(args.device)
    set_threads(args)
    world = bench_world.World()
    dtype_name, dtype = resolve_dtype(args.dtype, device)
    modes = list(dict.fromkeys(args.modes))
    cases, model, tokenizer, model_desc = _load(args, device, dtype, modes)
    settings, roofline = _settings(args, device)
    header = _header(args, model, model_desc, dtype_name, device, world, settings, roofline, cases, modes)
    _announce(args, header, cases, modes, settings, device, world, roofline)
    results: list[dict | None] = [None] * len(cases)
    interrupted = _run(args, model, tokenizer, cases, modes, settings, world, header, results)
    if interrupted:
        return interrupted
    return _report(args, header, cases, results, world)


def _load(args, device, dtype, modes: list[str]):
    """The cases, checked against the model's config and the memory, then the model with its response
    lengths installed: (cases, model, tokenizer, model_desc)."""
    from ..bench import cases as bench_cases
    from ..bench import lengths

    cases = bench_cases.plan_cases(
        args.batch_sizes, args.samples_per_prompt, args.prompt_lengths, args.response_lengths
    )
    model_config, source = load_config(args)
    longest = max(cases, key=lambda c: c.prompt_length + c.response_length)
    check_positions(
        model_config,
        longest.prompt_length + longest.response_length,
        f"case {longest.name}: --prompt-lengths {longest.prompt_length} + --response-lengths {longest.response_length}",
        "lower them",
    )
    check_bench_kv_memory(model_config, device, dtype, cases, modes)
    if args.trace:
        try:
            os.makedirs(args.trace, exist_ok=True)
        except OSError as e:
            raise CLIError(f"--trace {args.trace}: cannot create the folder: {e}") from None
    model, tokenizer, model_desc = load_model(args, model_config, source, device, dtype)
    try:
        lengths.install(
            model, args.length_profile, eos_id(model, tokenizer), args.temperature, args.mean_length, args.length_sigma
        )
    except ValueError as e:
        raise CLIError(f"--length-profile {args.length_profile}: {e}") from None
    return cases, model, tokenizer, model_desc


def _settings(args, device):
    """What every case runs with, and the copy_ roofline (CUDA only, measured before any case on this
    process's device): (Settings, roofline or None)."""
    from ..bench import cases as bench_cases
    from ..bench import metrics

    roofline = metrics.copy_roofline(device)
    settings = bench_cases.Settings(
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        compile=args.compile,
        warmup=args.warmup,
        iterations=args.iterations,
        trace_dir=args.trace,
        mismatch=args.mismatch,
        max_rows=args.max_rows,
        max_kv_tokens=args.max_kv_tokens,
        roofline_gbps=roofline["copy_roofline_gbps"] if roofline else None,
    )
    return settings, roofline


def _mode_descriptions(model, compile: bool) -> dict[str, str]:
    """Each mode as the call it times, for the JSON header."""
    from ..bench import lengths

    compiled = ", compiled" if compile else ""
    eos = lengths.eos_id(model)
    stop = "eos_token_id=[]" if eos is None else f"eos_token_id=[{eos}]"
    return {
        "expanded": f"Rollout(shared_prefill=False, {stop}){compiled}",
        "shared": f"Rollout(shared_prefill=True, kv_sharing='copy', {stop}){compiled}",
        "prefix": f"Rollout(shared_prefill=True, kv_sharing='prefix', {stop}){compiled}",
        "paged": f"Rollout(shared_prefill=True, kv_sharing='paged', {stop}){compiled}",
        "shared-nocompact": f"Rollout(shared_prefill=True, kv_sharing='copy', {stop}, "
        f"compact_finished_rows=False){compiled}",
        "prefix-nocompact": f"Rollout(shared_prefill=True, kv_sharing='prefix', {stop}, "
        f"compact_finished_rows=False){compiled}",
        "hf-generate": "model.generate, default (dynamic) cache, eager (--compile does not apply), "
        + (
            "max_new_tokens=min_new_tokens=R, eos_token_id=None (no EOS, as the rollout's eos_token_id=[])"
            if eos is None
            else f"max_new_tokens=R, eos_token_id={eos}"
        )
        + ", top_k=0",
        "hf-static": "model.generate(cache_implementation='static'), otherwise as hf-generate, run as Hugging Face "
        "runs it: on CUDA transformers compiles its decode step (torch.compile, mode 'reduce-overhead') "
        "in the first call of each new shape, so the warm-up calls include that compilation (with "
        "--warmup 0 the first timed call does); on the CPU it does not compile. transformers sizes the "
        "static cache to the longest max length of this process's earlier calls, so a case run after a "
        "longer one gets a larger cache",
    }


def _header(args, model, model_desc, dtype_name, device, world, settings, roofline, cases, modes) -> dict:
    """The JSON document's header: the machine, the versions, the model, how each figure is measured."""
    import torch
    import transformers

    from .. import __version__
    from ..bench import cases as bench_cases
    from ..bench import lengths, matrix, metrics, mismatch, report, runners, stats
    from ..bench import world as bench_world

    traffic = metrics.Traffic.of(model, settings.roofline_gbps)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    rank_devices = world.device_description(device, device_name)
    if roofline is not None and world.size > 1:
        rooflines = world.gather_records([roofline], ["copy_roofline_gbps"])
        roofline["rank_copy_roofline_gbps"] = [rows[0]["copy_roofline_gbps"] for rows in rooflines]
    descriptions = _mode_descriptions(model, args.compile)
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
        "timing": matrix.TIMING_NOTE,
        "decode_ms_per_step_method": runners.DECODE_STEP_NOTE,
        "bytes_per_step": {
            "weight_bytes": traffic.weight_bytes,
            "kv_bytes_per_token": traffic.kv_bytes_per_token,
            "formula": metrics.BYTES_NOTE,
        },
        "roofline": roofline,
        "peak_memory_method": "cuda_allocator" if device.type == "cuda" else "cpu_profiler",
        "peak_memory_note": metrics.PEAK_NOTE[device.type],
        "sampling": "greedy" if settings.greedy else f"temperature={args.temperature} top_p={args.top_p} top_k=0",
        "length_profile": lengths.describe(args.length_profile, args.mean_length, args.length_sigma),
        "modes": {m: descriptions[m] for m in modes},
        "file_note": report.FILE_NOTE,
        "median_stages_note": stats.MEDIAN_STAGES_NOTE,
        "tokens_agree_note": stats.TOKENS_AGREE_NOTE,
        "flags": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "cases_requested": [c.name for c in cases],
        "cases_run_order": [cases[i].name for i in bench_cases.run_order(cases)],
    }
    if world.size > 1:
        header["world_note"] = bench_world.WORLD_NOTE
    if args.mismatch:
        header["mismatch_note"] = mismatch.MISMATCH_NOTE
    return header


def _announce(args, header, cases, modes, settings, device, world, roofline) -> None:
    """One line of what is about to run (and a warning for a compiled run without warm-up)."""
    from ..bench import matrix

    per_mode = matrix.calls_per_mode(settings, device)
    where = (
        f"{world.size} processes ({world.backend}), each on {device.type} with its own --batch-sizes prompts"
        if world.size > 1
        else f"{header['device_name']} ({device})"
    )
    say(
        f"bench: {len(cases)} case(s) x {len(modes)} mode(s) x {per_mode} calls on {where}, {header['dtype']}, "
        f"{header['sampling']}, {args.length_profile} lengths, warmup {args.warmup}, {args.iterations} timed "
        f"iteration{'s' if args.iterations != 1 else ''}, modes interleaved"
        + (f"; copy_ roofline {roofline['copy_roofline_gbps']:.0f} GB/s" if roofline else "")
    )
    if args.compile and args.warmup == 0 and world.is_main:
        print(
            "torchkvops: warning: --compile with --warmup 0: the first timed calls compile, and their time counts "
            "in the results (give --warmup 1 or more)",
            file=sys.stderr,
        )


def _save(args, header, cases, results, world, status: str) -> None:
    from ..bench import report
    from .atomic_write import write_json_atomic

    if args.output and world.is_main:
        write_json_atomic(args.output, report.results_document(header, cases, results, status))


def _run(args, model, tokenizer, cases, modes, settings, world, header, results: list) -> int | None:
    """The matrix, each case's result stored in `results` as it ends and --output rewritten; None when
    every case ran, 130 when the run was interrupted (the finished cases shown and saved)."""
    from ..bench import matrix

    def save_during_run() -> None:
        """A write that fails mid-run (the folder removed, the disk full) is reported and retried after
        the next case; the results so far stay in memory and the run goes on."""
        try:
            _save(args, header, cases, results, world, "partial")
        except OSError as e:
            print(
                f"torchkvops: warning: cannot write --output {args.output} ({e.strerror or e}); "
                "trying again after the next case",
                file=sys.stderr,
            )

    save_during_run()  # the header at once: a run that dies before its first case still leaves a record

    def case_done(i: int, result: dict) -> None:
        results[i] = result
        save_during_run()

    try:
        with matrix.recompile_headroom(args.compile or "hf-static" in modes):
            matrix.run_matrix(
                model,
                cases,
                modes,
                settings,
                vocab_size=vocab_size(model, tokenizer),
                special_ids=special_ids(model, tokenizer),
                pad_token_id=pad_id(model, tokenizer),
                progress=not args.no_progress,
                on_case=case_done,
                world=world,
            )
    except KeyboardInterrupt:
        finished = [r for r in results if r is not None]
        for result in finished:
            _show_case(result, args.iterations, args.wide)
        _save(args, header, cases, results, world, "interrupted")
        kept = f"; {len(finished)} finished case(s) are in {args.output}" if args.output and finished else ""
        if world.is_main:
            print(f"torchkvops: interrupted after {len(finished)} of {len(cases)} case(s){kept}", file=sys.stderr)
        return 130
    return None


def _report(args, header, cases, results: list[dict], world) -> int:
    """The tables (shown even if the last write fails), the JSON, the plot, the traces; 1 if a case failed."""
    from ..bench import report

    for result in results:
        _show_case(result, args.iterations, args.wide)
    _save(args, header, cases, results, world, "complete")
    failed = [r["case"] for r in results if r["error"]]
    if args.output:
        say(f"\nwrote {args.output}")
    if args.plot and world.is_main:
        report.plot_stage_times(results, args.plot, f"{header['model']}, {header['dtype']}, {header['device_name']}")
        say(f"wrote {args.plot}")
    if args.trace:
        say(
            f"wrote Chrome traces to {os.path.join(args.trace, '')} (open in chrome://tracing or "
            "https://ui.perfetto.dev)"
        )
    if failed:
        if world.is_main:
            print(
                f"torchkvops: {len(failed)} case(s) failed: {', '.join(failed)} (errors in the table"
                f"{' and the JSON' if args.output else ''})",
                file=sys.stderr,
            )
        return 1
    return 0


def _show_case(result: dict, iterations: int, wide: bool = False) -> None:
    from ..bench import report

    say()
    say(report.format_case_table(result, iterations, wide))
    note = report.format_spread_note(result)
    if note:
        say(note)
    if result.get("mismatch"):
        say()
        say(report.format_mismatch_table(result))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
