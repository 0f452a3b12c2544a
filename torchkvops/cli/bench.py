"""`torchkvops bench`: the A/B matrix of torchkvops.bench.matrix from the command line. Resolves the device,
checks the sizes against the model's config and the memory free, builds the model, writes the JSON
header, runs the matrix (rewriting --output after every case), then prints a table per case and
draws the plot.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from .checks import CLIError, check_bench_kv_memory, check_positions
from .launch import say, set_threads, start_processes
from .model import eos_id, load_config, load_model, pad_id, resolve_dtype, special_ids, vocab_size

__all__ = ["cmd_bench"]


def cmd_bench(args) -> int:
    import torch

    from .. import __version__
    from ..bench import cases as bench_cases
    from ..bench import lengths, matrix, metrics, mismatch, report, runners, stats
    from ..bench import world as bench_world
    from .atomic_write import write_json_atomic

    device = start_processes(args.device)
    set_threads(args)
    world = bench_world.World()
    dtype_name, dtype = resolve_dtype(args.dtype, device)
    modes = list(dict.fromkeys(args.modes))
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

    roofline = metrics.copy_roofline(device)  # CUDA only: measured before any case, on this process's device
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
    traffic = metrics.Traffic.of(model, settings.roofline_gbps)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    rank_devices = world.device_description(device, device_name)
    if roofline is not None and world.size > 1:
        rooflines = world.gather_records([roofline], ["copy_roofline_gbps"])
        roofline["rank_copy_roofline_gbps"] = [rows[0]["copy_roofline_gbps"] for rows in rooflines]
    import transformers

    compiled = ", compiled" if args.compile else ""
    eos = lengths.eos_id(model)
    stop = "eos_token_id=[]" if eos is None else f"eos_token_id=[{eos}]"
    descriptions = {
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
    per_mode = matrix.calls_per_mode(settings, device)
    where = (
        f"{world.size} processes ({world.backend}), each on {device.type} with its own --batch-sizes prompts"
        if world.size > 1
        else f"{device_name} ({device})"
    )
    say(
        f"bench: {len(cases)} case(s) x {len(modes)} mode(s) x {per_mode} calls on {where}, {dtype_name}, "
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

    results: list[dict | None] = [None] * len(cases)

    def save(status: str) -> None:
        if args.output and world.is_main:
            write_json_atomic(args.output, report.results_document(header, cases, results, status))

    def save_during_run() -> None:
        """A write that fails mid-run (the folder removed, the disk full) is reported and retried after
        the next case; the results so far stay in memory and the run goes on."""
        try:
            save("partial")
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
        save("interrupted")
        kept = f"; {len(finished)} finished case(s) are in {args.output}" if args.output and finished else ""
        if world.is_main:
            print(f"torchkvops: interrupted after {len(finished)} of {len(cases)} case(s){kept}", file=sys.stderr)
        return 130
    for result in results:  # the tables first: they are shown even if the last write fails
        _show_case(result, args.iterations, args.wide)
    save("complete")
    failed = [r["case"] for r in results if r["error"]]
    if args.output:
        say(f"\nwrote {args.output}")
    if args.plot and world.is_main:
        report.plot_stage_times(results, args.plot, f"{model_desc}, {dtype_name}, {device_name}")
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
