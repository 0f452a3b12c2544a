"""The A/B matrix behind `torchkvops bench`: the rollout's modes against Hugging Face generate.

For every case (batch size B, samples per prompt N, prompt length P, response length R) each mode
generates up to R tokens for the same synthetic prompts (exactly R with the default --length-profile
fixed; torchkvops.bench.lengths):

  expanded     Rollout(shared_prefill=False): the prompts are repeated N times, then prefilled
  shared       Rollout(shared_prefill=True, kv_sharing="copy"): each prompt is prefilled once into blocks
               of the pool its N rows share by reference (each row a copy of the partly filled last block);
               each row reads its prompt through its own block table
  prefix       Rollout(shared_prefill=True, kv_sharing="prefix"): the same blocks; a prompt's whole blocks
               are read once a step for its N rows' stacked queries
  paged        Rollout(shared_prefill=True, kv_sharing="paged"): the same blocks, read as "prefix" reads them
               when the prompt is long (PagedLayout.stacked_tokens), else as "copy"
  shared-nocompact, prefix-nocompact
               shared and prefix with RolloutConfig(compact_finished_rows=False): every row is decoded
               until the last one ends (the same tokens; with fixed lengths no row ends early anyway)
  hf-generate  model.generate(num_return_sequences=N) (greedy: the prompts repeat_interleave'd N times)
  hf-static    the same with cache_implementation="static", as Hugging Face runs it: on CUDA it compiles
               its decode step (torch.compile, mode "reduce-overhead") in the first call of each shape,
               which is a warm-up call; on the CPU it does not compile (its auto-compile is for accelerators)

Timing (TIMING_NOTE): per case, each mode's warm-up calls, then `iterations` rounds that each run every
mode once in turn (A B C A B C ...), so that the modes see the same machine state; every call's total_ms
is measured by one outer clock around the whole call: CUDA events on the current stream and a
synchronize on CUDA, time.perf_counter on the CPU. The rollout's own profile still gives each call's
stage split; Hugging Face's prefill and decode are read from forward pre-hooks (DECODE_STEP_NOTE). Per
decode step: the bytes of weights and KV read and the bandwidth achieved (BYTES_NOTE), on CUDA also as
a fraction of a `copy_` roofline measured at the start of the same run (ROOFLINE_NOTE). The rollout
modes' KV buffers stay allocated through a case's rounds (as in a training loop), so they are held at
once. Cases run largest B*N first (an out-of-memory shows up at once), but the results keep the
requested order.

Peak memory: after the timed rounds, one extra call per mode with every mode's buffers released first.
On CUDA the allocator's peak over that call (weights included); on the CPU that call runs under
torch.profiler(profile_memory=True), whose "[memory]" events (+bytes on allocation, -bytes on free) are
summed in time order; the peak of that running sum is the most memory the call held at once beyond
what was allocated when it began (weights excluded; the mode's KV buffer is allocated in the call, as
hf-generate's cache is).

Stage times shown in the table and the plot are those of the median-total iteration (for an even
count, the mean of the two middle ones), so that they add up to the median total shown beside them;
per-field medians (in the JSON's "summary") need not add up.

Data-parallel (WORLD_NOTE): under torch.distributed every process runs every case on its own B
prompts, in lockstep: after every call the processes exchange a status, so that a call that fails on
one of them fails the mode on all of them instead of leaving the others waiting. The per-iteration
profiles are then all_gather'ed as float vectors; the results report, per iteration, the slowest
process's profile (the straggler is what a trainer waits for) and the tokens of all processes.

The JSON (--output) is rewritten after every case, through a temporary file renamed into place: an
interrupted or crashed run leaves the cases that finished, and never a half-written file.

This module runs the matrix: the cases one after another, each case's modes interleaved (run_matrix).
Each other part has a module of its own:
  cases    the modes, the cases and their run order, synthetic prompts, settings, record fields
  runners  one call of a mode, timed (DECODE_STEP_NOTE)
  metrics  the clock, the bytes per decode step, the copy_ roofline, peak memory, traces
           (BYTES_NOTE, ROOFLINE_NOTE, PEAK_NOTE)
  stats    summaries, the median-total iteration's stages, token agreement (MEDIAN_STAGES_NOTE,
           TOKENS_AGREE_NOTE)
  world    the processes, and how their records become one (WORLD_NOTE)
  report   the table, the plot and the JSON document (FILE_NOTE); torchkvops.cli.atomic_write writes the files
  mismatch with --mismatch, each case's rollout-vs-trainer log-probability mismatch (MISMATCH_NOTE)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from ..rollout.profiling import Clock
from .cases import ITERATION_FIELDS, SUMMARY_FIELDS, Case, Settings, run_order, synthetic_prompts
from .metrics import Traffic, export_trace, peak_memory_bytes
from .mismatch import measure_mismatch
from .runners import make_runner, timed_call
from .stats import stage_breakdown, summarize_profiles, token_agreement, tokens_sha256
from .world import World, merge_ranks

__all__ = ["TIMING_NOTE", "run_matrix", "calls_per_mode", "estimate_seconds", "recompile_headroom"]


TIMING_NOTE = (
    "interleaved: per case, each mode's warm-up calls, then `iterations` rounds that each run every mode "
    "once, in the --modes order (A B C A B C ...). total_ms of every call is measured around the whole "
    "call by one clock: CUDA events on the current stream, read after a synchronize (CUDA), "
    "time.perf_counter (CPU); tokens_per_second = generated_tokens / that total. The stage times of the "
    "rollout modes come from the rollout's own profile (rollout_total_ms: its first stage to its last); "
    "iterations[].round and started_ms (from the case's first timed call) record the order."
)


# --- running -------------------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def calls_per_mode(s: Settings, device: torch.device) -> int:
    """Calls each case runs per mode: warm-up, timed, one for the peak memory, one for --trace."""
    return s.warmup + s.iterations + 1 + (s.trace_dir is not None)


def estimate_seconds(
    first_call_s: float, cases: Sequence[Case], order: Sequence[int], n_modes: int, per_mode: int
) -> float:
    """The whole run's time from its first call (of the first case run): every call is assumed to take
    first_call_s scaled by its case's rows x (prompt + response length). Rough: the first call also
    pays one-time costs (allocation, and compilation with --compile), and modes differ."""

    def work(c: Case) -> int:
        return c.rows * (c.prompt_length + c.response_length)

    first = work(cases[order[0]])
    return first_call_s * n_modes * per_mode * sum(work(c) for c in cases) / first


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _new_entry(mode: str, device: torch.device) -> dict:
    return {
        "mode": mode,
        "error": None,
        "iterations": [],
        "summary": None,
        "median_stages": None,
        "peak_memory_bytes": None,
        "peak_memory_method": "cuda_allocator" if device.type == "cuda" else "cpu_profiler",
        "tokens_sha256": None,
        "trace": None,
    }


def _run_case(
    model: nn.Module,
    case: Case,
    modes: Sequence[str],
    prompts: Tensor,
    s: Settings,
    traffic: Traffic,
    pad_token_id: int,
    device: torch.device,
    world: World,
    tick: Callable[[int], None],
    label: Callable[[str], None] = lambda text: None,
) -> dict[str, dict]:
    """Every mode of one case, interleaved (TIMING_NOTE); one entry per mode. Every step below (making
    a runner, each call) is followed by a status exchange, so that all processes agree on which modes
    still run and take the same collective steps."""
    run = _CaseRun(case, modes, s, device, world, tick, label)
    try:
        run.make_runners(model, prompts, pad_token_id)
        run.warm_up()
        run.timed_rounds(traffic)
        run.peaks_and_traces()
    finally:
        run.close()
    for m in run.live():
        run.entries[m]["tokens_sha256"] = tokens_sha256(run.last[m])
    _combine(run.entries, modes, world)
    return run.entries


class _CaseRun:
    """One case's modes as they run: each mode's entry, runner, calls done and last responses. A mode
    whose step fails on any process is out (its remaining calls ticked at once), on every process."""

    def __init__(self, case, modes, s: Settings, device, world: World, tick, label):
        self.case, self.modes, self.s, self.device, self.world = case, modes, s, device, world
        self.tick, self.label = tick, label
        self.clock = Clock(device)
        self.calls = calls_per_mode(s, device)
        self.entries = {m: _new_entry(m, device) for m in modes}
        self.runners: dict[str, object] = {}
        self.done = dict.fromkeys(modes, 0)
        self.last: dict[str, Tensor] = {}

    def live(self) -> list[str]:
        return [m for m in self.modes if self.entries[m]["error"] is None]

    def step(self, mode: str, fn: Callable[[], object], counted: bool = True) -> bool:
        self.label(f"{self.case.name} {mode}")
        error = None
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failed mode is a result; the run goes on
            error = _one_line(e)
        failed = self.world.failures(error)
        if failed:
            self.entries[mode]["error"] = self.world.describe(failed)
            self.tick(self.calls - self.done[mode])
            self.done[mode] = self.calls
            runner = self.runners.pop(mode, None)
            if runner is not None:
                runner.close()
            return False
        if counted:
            self.done[mode] += 1
            self.tick(1)
        return True

    def make_runners(self, model, prompts, pad_token_id) -> None:
        for m in self.modes:
            self.step(
                m,
                lambda m=m: self.runners.__setitem__(
                    m, make_runner(m, model, self.case, self.s, prompts, pad_token_id, self.clock)
                ),
                counted=False,
            )

    def warm_up(self) -> None:
        for m in self.live():
            for _ in range(self.s.warmup):
                if not self.step(m, lambda m=m: self.runners[m].run()):
                    break

    def timed_rounds(self, traffic: Traffic) -> None:
        t0 = time.perf_counter()

        def timed(mode: str, k: int) -> None:
            started = (time.perf_counter() - t0) * 1e3
            profile, responses = timed_call(self.runners[mode], self.clock)
            record = dict.fromkeys(ITERATION_FIELDS)
            record.update(profile, round=k, started_ms=started)
            self.entries[mode]["iterations"].append(traffic.annotate(mode, record))
            self.last[mode] = responses

        for k in range(self.s.iterations):  # the rounds: A B C, A B C, ...
            for m in self.live():
                self.step(m, lambda m=m, k=k: timed(m, k))

    def peaks_and_traces(self) -> None:
        """One call a mode for its peak memory (every runner's buffers freed first), and one for --trace."""
        for m in self.live():
            for runner in self.runners.values():
                runner.free()
            peak = lambda m=m: self.entries[m].__setitem__(  # noqa: E731
                "peak_memory_bytes", peak_memory_bytes(self.runners[m], self.device)
            )
            if not self.step(m, peak):
                continue
            if self.s.trace_dir is not None:
                suffix = f"_rank{self.world.rank}" if self.world.size > 1 else ""
                path = os.path.join(self.s.trace_dir, f"{self.case.name}_{m}{suffix}.json")
                if self.step(m, lambda m=m, path=path: export_trace(self.runners[m].run, path, self.device)):
                    self.entries[m]["trace"] = path
            if m in self.runners:
                self.runners[m].free()

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
        self.runners.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _combine(entries: dict[str, dict], modes: Sequence[str], world: World) -> None:
    """Summaries of each mode that ran; under torch.distributed, of every process's iterations merged
    (WORLD_NOTE). Every process takes the same collective steps (the live modes are agreed)."""
    for m in modes:
        e = entries[m]
        if e["error"] is not None:
            continue
        if world.size > 1:
            per_rank = world.gather_records(e["iterations"], ITERATION_FIELDS)
            e["iterations"] = merge_ranks(per_rank)
            e["ranks"] = per_rank
            peaks = world.gather_records([{"peak_memory_bytes": e["peak_memory_bytes"]}], ["peak_memory_bytes"])
            e["rank_peak_memory_bytes"] = [rows[0]["peak_memory_bytes"] for rows in peaks]
            known = [p for p in e["rank_peak_memory_bytes"] if p is not None]
            e["peak_memory_bytes"] = max(known) if known else None
        e["summary"] = summarize_profiles(e["iterations"], SUMMARY_FIELDS)
        e["median_stages"] = stage_breakdown(e)


def run_matrix(
    model: nn.Module,
    cases: Sequence[Case],
    modes: Sequence[str],
    settings: Settings,
    *,
    vocab_size: int,
    special_ids: Iterable[int],
    pad_token_id: int,
    progress: bool = True,
    on_case: Callable[[int, dict], None] | None = None,
    world: World | None = None,
) -> list[dict]:
    """Run every case and mode; one result per case, in the requested order. on_case(i, result) is
    called as soon as case i (its index in `cases`) has finished. After the first call, one line on
    stderr gives the number of calls and an estimate of the run's time (see estimate_seconds). Under
    torch.distributed (world), every process must call it with the same arguments; only the first
    process shows progress."""
    world = world or World()
    device = next(model.parameters()).device
    special_ids = list(special_ids)
    if settings.trace_dir is not None:
        os.makedirs(settings.trace_dir, exist_ok=True)
    traffic = Traffic.of(model, settings.roofline_gbps)
    per_mode = calls_per_mode(settings, device)
    total_calls = len(cases) * len(modes) * per_mode
    order = run_order(cases)
    bar = _progress_bar(total_calls, progress and world.is_main, quiet=not world.is_main)
    results: list[dict | None] = [None] * len(cases)
    start = time.perf_counter()
    estimated = False

    def tick(n: int) -> None:
        nonlocal estimated
        bar.update(n)
        if not estimated and n == 1:  # the first call that ran (a failed mode ticks all its calls at once)
            estimated = True
            first = time.perf_counter() - start
            est = estimate_seconds(first, cases, order, len(modes), per_mode)
            bar.write(
                f"bench: {total_calls} calls in all ({len(cases)} case(s) x {len(modes)} mode(s) x {per_mode}); "
                f"the first took {first:.1f} s, so the run may take about {_duration(est)} (rough: later cases "
                f"scaled by rows x (P+R); first calls pay one-time costs, so it is often less)"
            )

    try:
        for k, i in enumerate(order):
            case = cases[i]
            result = _one_case(
                model,
                case,
                k,
                modes,
                settings,
                traffic,
                vocab_size,
                special_ids,
                pad_token_id,
                device,
                world,
                bar,
                tick,
            )
            results[i] = result
            if on_case is not None:
                on_case(i, result)
    finally:
        bar.close()
    return results


def _one_case(
    model, case, k, modes, settings, traffic, vocab_size, special_ids, pad_token_id, device, world, bar, tick
) -> dict:
    """A case's result: its prompts (this process's shard), every mode, the mismatch if asked for, and
    whether the modes sampled the same tokens."""
    result = {"case": case.name, **dataclasses.asdict(case), "run_order": k, "error": None, "modes": {}}
    if world.size > 1:
        result["world_size"] = world.size
    prompts = None
    error = None
    try:
        prompts = synthetic_prompts(case, vocab_size, special_ids, settings.seed, device, shard=world.rank)
    except Exception as e:  # noqa: BLE001
        error = _one_line(e)
    failed = world.failures(error)
    if failed:
        result["error"] = world.describe(failed)
        bar.update(len(modes) * calls_per_mode(settings, device))
    else:
        result["modes"] = _run_case(
            model, case, modes, prompts, settings, traffic, pad_token_id, device, world, tick, bar.set_description
        )
        if settings.mismatch:  # after the timed calls, so that it does not disturb them
            bar.set_description(f"{case.name} mismatch")
            result["mismatch"] = measure_mismatch(model, case, modes, settings, prompts, pad_token_id)
    hashes = {m: e["tokens_sha256"] for m, e in result["modes"].items()}
    agree = token_agreement(hashes, settings.greedy)
    agree["pairs"] = world.combine_agreement(agree["pairs"])
    compared = [v for v in agree["pairs"].values() if v is not None]
    agree["all_agree"] = all(compared) if compared else None
    result["tokens_agree"] = agree
    failed_modes = [m for m, e in result["modes"].items() if e["error"]]
    if failed_modes and not result["error"]:
        result["error"] = "; ".join(f"{m}: {result['modes'][m]['error']}" for m in failed_modes)
    return result


class _NoBar:
    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def update(self, n=1):
        pass

    def write(self, text):
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    def set_description(self, desc):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool, quiet: bool = False):
    if not enabled or not sys.stderr.isatty():  # (a log is not a terminal: a bar there is one endless line)
        return _NoBar(quiet)
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with transformers; without it, no bar
        return _NoBar()
    bar = tqdm(total=total, unit="call", leave=False, dynamic_ncols=True)
    bar.write = lambda text: tqdm.write(text, file=sys.stderr)  # above the bar, not through it
    return bar


# --- compilation ---------------------------------------------------------------------------------
@contextlib.contextmanager
def recompile_headroom(enabled: bool, limit: int = 64):
    """Every case and mode compiles its own rollout; raise dynamo's per-function recompile limit."""
    if not enabled:
        yield
        return
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    old = getattr(cfg, name)
    setattr(cfg, name, max(old, limit))
    try:
        yield
    finally:
        setattr(cfg, name, old)
