"""The A/B matrix behind `torchkvops bench`: expanded prefill vs shared prefill vs Hugging Face generate.

For every case (batch size B, samples per prompt N, prompt length P, response length R) each mode
generates exactly R tokens for the same synthetic prompts:

  expanded     Rollout(shared_prefill=False): the prompts are repeated N times, then prefilled
  shared       Rollout(shared_prefill=True): each prompt is prefilled once, its KV expanded N times
  hf-generate  model.generate(num_return_sequences=N) (greedy: the prompts repeat_interleave'd N times)

Warm-up calls are excluded; the rollout's own profile gives the stage times of every timed call,
hf-generate is timed as a whole with a device synchronize around perf_counter. Cases run largest
B*N first (the allocator then serves the smaller ones from what the first reserved, and an
out-of-memory shows up at once), but the results keep the requested order.

Peak memory: on CUDA the allocator's peak over each timed call (weights included); on the CPU one
extra call under torch.profiler(profile_memory=True), whose "[memory]" events (+bytes on allocation,
-bytes on free) are summed in time order; the peak of that running sum is the most memory the call
held at once beyond what was allocated when it began (weights excluded; the rollout's KV buffer is
released before that call so that its allocation is counted, as hf-generate's cache is).

Stage times shown in the table and the plot are those of the median-total iteration (for an even
count, the mean of the two middle ones), so that they add up to the median total shown beside them;
per-field medians (in the JSON's "summary") need not add up.

The JSON (--output) is rewritten after every case, through a temporary file renamed into place: an
interrupted or crashed run leaves the cases that finished, and never a half-written file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import itertools
import json
import math
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from .profiling import RolloutProfile
from .rollout import Rollout, RolloutConfig

__all__ = [
    "MODES", "PROFILE_FIELDS", "Case", "plan_cases", "run_order", "summarize", "summarize_profiles",
    "tokens_sha256", "synthetic_prompts", "cpu_peak_memory_bytes", "token_agreement", "run_matrix",
    "stage_breakdown", "plot_segments", "format_case_table", "plot_stage_times", "write_json_atomic",
    "write_text_atomic", "results_document", "calls_per_mode", "estimate_seconds",
]

MODES = ("expanded", "shared", "hf-generate")
PROFILE_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutProfile))
STAGE_FIELDS = ("prompt_expansion_ms", "prefill_ms", "kv_expand_ms", "decode_ms", "post_processing_ms")
NOT_COMPARABLE = ("not comparable: hf-generate samples with torch's generator, the rollout with its own "
                  "counter-based sampler, so sampled tokens cannot match even when both are right; only greedy "
                  "tokens (--temperature 0) can be compared across them")
TOKENS_AGREE_NOTE = ("tokens_agree.pairs: true when two modes generated identical token ids, false when they "
                     "differ although they should not (greedy, or expanded vs shared with the same seed), null when "
                     "they are not comparable (sampling with hf-generate: see tokens_agree.notes)")
MEDIAN_STAGES_NOTE = ("median_stages: the stage times of the iteration whose total_ms is the median (for an even "
                      "count, the mean of the two middle iterations), with other_ms = total_ms - the stages (time "
                      "between them); they add up to summary.total_ms.p50, which the per-field medians of summary "
                      "need not do. The table and the plot show these.")
FILE_NOTE = ("status: 'partial' while the run goes on (rewritten after every case; a file left 'partial' is from a "
             "run that died), 'interrupted' after Ctrl-C, 'complete' at the end. cases: the finished cases in the "
             "requested order; cases_pending: those not finished.")


# --- files ---------------------------------------------------------------------------------------
def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to path through a temporary file in the same folder renamed into place: readers
    see the old file or the new one, never half of one; on failure the old file stays. (A symlink is
    followed: the file it points to is replaced, the link stays.)"""
    path = os.path.realpath(os.fspath(path))
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(path):  # keep the permissions of the file it replaces
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """json.dumps(obj) first (an unserializable object changes nothing on disk), then write_text_atomic."""
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def results_document(header: dict, cases: Sequence["Case"], results: Sequence[dict | None], status: str) -> dict:
    """The --output JSON: the header, the finished cases in the requested order, the names of the
    others, and the run's status ("partial", "interrupted" or "complete"; see FILE_NOTE)."""
    return {"status": status, "header": header, "cases": [r for r in results if r is not None],
            "cases_pending": [c.name for c, r in zip(cases, results) if r is None]}


# --- the matrix ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    batch_size: int
    samples_per_prompt: int
    prompt_length: int
    response_length: int

    @property
    def name(self) -> str:
        return f"B{self.batch_size}_N{self.samples_per_prompt}_P{self.prompt_length}_R{self.response_length}"

    @property
    def rows(self) -> int:
        return self.batch_size * self.samples_per_prompt


def plan_cases(batch_sizes: Iterable[int], samples_per_prompt: Iterable[int], prompt_lengths: Iterable[int],
               response_lengths: Iterable[int]) -> list[Case]:
    """Every combination, in the requested order (duplicates dropped)."""
    cases = [Case(*c) for c in itertools.product(batch_sizes, samples_per_prompt, prompt_lengths, response_lengths)]
    return list(dict.fromkeys(cases))


def run_order(cases: Sequence[Case]) -> list[int]:
    """Indices of `cases` in the order they run: most rows (B*N) first, then longest P+R; ties keep
    the requested order."""
    return sorted(range(len(cases)), key=lambda i: (-cases[i].rows, -(cases[i].prompt_length + cases[i].response_length)))


# --- statistics ----------------------------------------------------------------------------------
def summarize(values: Sequence[float | int | None]) -> dict | None:
    """mean, p50 (the median) and p95 (nearest rank: the value at rank ceil(0.95 n) of the sorted
    values). None when every value is None; a mix of None and numbers is an error."""
    values = list(values)
    if not values:
        raise ValueError("summarize: no values")
    nones = sum(v is None for v in values)
    if nones == len(values):
        return None
    if nones:
        raise ValueError(f"summarize: {nones} of {len(values)} values are None and the others are numbers")
    s = sorted(values)
    n = len(s)
    mid = n // 2
    p50 = s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2
    return {"mean": math.fsum(s) / n, "p50": p50, "p95": s[math.ceil(0.95 * n) - 1]}


def summarize_profiles(profiles: Sequence[dict]) -> dict[str, dict | None]:
    """summarize() of every field of the per-iteration profiles."""
    return {field: summarize([p[field] for p in profiles]) for field in profiles[0]}


def tokens_sha256(responses: Tensor) -> str:
    """sha256 of the responses' bytes as int64 (row-major, host byte order)."""
    return hashlib.sha256(responses.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()


def token_agreement(hashes: dict[str, str | None], greedy: bool) -> dict:
    """For each pair of modes that ran: True/False when their tokens should be identical (greedy, or
    shared vs expanded with the same seed), None when they are not comparable."""
    pairs, notes = {}, {}
    modes = [m for m in hashes if hashes[m] is not None]
    for a, b in itertools.combinations(modes, 2):
        key = f"{a} vs {b}"
        if greedy or {a, b} <= {"expanded", "shared"}:
            pairs[key] = hashes[a] == hashes[b]
        else:
            pairs[key] = None
            notes[key] = NOT_COMPARABLE
    compared = [v for v in pairs.values() if v is not None]
    return {"pairs": pairs, "notes": notes, "all_agree": all(compared) if compared else None}


# --- inputs --------------------------------------------------------------------------------------
def synthetic_prompts(case: Case, vocab_size: int, special_ids: Iterable[int], seed: int,
                      device: torch.device) -> Tensor:
    """[B, P] random token ids, none of them special, the same for a given seed and case."""
    special = {int(i) for i in special_ids if i is not None and 0 <= int(i) < vocab_size}
    allowed = torch.tensor([i for i in range(vocab_size) if i not in special], dtype=torch.long)
    if allowed.numel() == 0:
        raise ValueError("synthetic_prompts: every token id of the vocabulary is special")
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{case.name}".encode()))
    idx = torch.randint(allowed.numel(), (case.batch_size, case.prompt_length), generator=gen)
    return allowed[idx].to(device)


# --- the modes -----------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Settings:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    compile: bool = False
    warmup: int = 5
    iterations: int = 20
    trace_dir: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class _RolloutMode:
    def __init__(self, model: nn.Module, case: Case, shared: bool, s: Settings, prompts: Tensor):
        self.prompts = prompts
        self.rollout = Rollout(model, RolloutConfig(
            samples_per_prompt=case.samples_per_prompt, max_new_tokens=case.response_length, shared_prefill=shared,
            enable_profiling=True, compile=s.compile, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
            eos_token_id=[],  # never stop early: every mode generates exactly R tokens
        ))

    def __call__(self) -> tuple[dict, Tensor]:
        out = self.rollout.generate(self.prompts)
        return self.rollout.get_last_profile().to_dict(), out.responses

    def free(self) -> None:
        self.rollout.release()


class _HFGenerateMode:
    """model.generate timed as a whole; only total_ms and throughput are known."""

    def __init__(self, model: nn.Module, case: Case, s: Settings, prompts: Tensor, pad_token_id: int):
        self.model, self.case, self.s = model, case, s
        self.device = prompts.device
        n = case.samples_per_prompt
        self.kwargs = dict(max_new_tokens=case.response_length, min_new_tokens=case.response_length,
                           pad_token_id=pad_token_id, use_cache=True,
                           # No EOS at all, as the rollout's eos_token_id=[]: with an EOS, min_new_tokens
                           # would mask its logit and greedy tokens could differ from the rollout's.
                           eos_token_id=None)
        if s.greedy:
            # HF refuses greedy search with num_return_sequences > 1: repeat the prompts instead
            # (repeat_interleave, the rollout's row order).
            self.input_ids = prompts.repeat_interleave(n, dim=0)
            self.kwargs.update(do_sample=False)
        else:
            self.input_ids = prompts
            self.kwargs.update(do_sample=True, num_return_sequences=n, temperature=s.temperature, top_p=s.top_p,
                               top_k=0)  # top_k=0: off, as in the rollout (HF's default is 50)
        self.attention_mask = torch.ones_like(self.input_ids)

    def __call__(self) -> tuple[dict, Tensor]:
        torch.manual_seed(self.s.seed)
        cuda = self.device.type == "cuda"
        _sync(self.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(self.input_ids, attention_mask=self.attention_mask, **self.kwargs)
        _sync(self.device)
        ms = (time.perf_counter() - t0) * 1e3
        c = self.case
        responses = out[:, c.prompt_length:]
        if tuple(responses.shape) != (c.rows, c.response_length):
            raise RuntimeError(f"hf-generate returned responses of shape {tuple(responses.shape)}, "
                               f"expected {(c.rows, c.response_length)}")
        profile = dict.fromkeys(PROFILE_FIELDS)  # the stages it cannot report stay None
        profile.update(total_ms=ms, generated_tokens=responses.numel(),
                       tokens_per_second=responses.numel() / (ms / 1e3) if ms > 0 else 0.0,
                       batch_size=c.batch_size, samples_per_prompt=c.samples_per_prompt,
                       prompt_length=c.prompt_length, response_length=responses.shape[1],
                       peak_memory_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else None)
        return profile, responses

    def free(self) -> None:
        pass


# --- memory and traces ---------------------------------------------------------------------------
@contextlib.contextmanager
def _profiling(prof):
    """Run the body under `prof`. The profiler's native library prints "profiler_start/stop" (and on
    CPU-only machines "gpuGetDeviceCount failed") to the process's stderr whatever KINETO_LOG_LEVEL
    says, so stderr's file descriptor points at /dev/null while it starts and stops, and only then:
    the body's own errors still show."""

    def quietly(action):
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 2)
                action()
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    quietly(prof.start)
    try:
        yield prof
    finally:
        quietly(prof.stop)


def cpu_peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Run fn once under the profiler with profile_memory=True and return the peak of the running
    sum of its CPU "[memory]" events (+bytes allocated, -bytes freed) in time order.

    The raw kineto events are read: `prof.events()` folds allocations made inside an op into that op
    and keeps as "[memory]" only those made outside any op (checked on torch 2.14)."""
    from torch.autograd.profiler_util import MEMORY_EVENT_NAME
    from torch.profiler import ProfilerActivity, profile

    with _profiling(profile(activities=[ProfilerActivity.CPU], profile_memory=True)) as prof:
        fn()
    cpu_types = {torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.MKLDNN, torch.autograd.DeviceType.IDEEP}
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == MEMORY_EVENT_NAME and e.device_type() in cpu_types]
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return peak


def export_trace(fn: Callable[[], object], path: str, device: torch.device) -> None:
    """Run fn once under torch.profiler and write a Chrome trace (the torchkvops.* stages show as
    user annotations)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _profiling(profile(activities=activities)) as prof:
        fn()
        _sync(device)
    prof.export_chrome_trace(path)


# --- running -------------------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def calls_per_mode(s: "Settings", device: torch.device) -> int:
    """Calls each case runs per mode: warm-up, timed, one for the CPU peak memory, one for --trace."""
    return s.warmup + s.iterations + (device.type != "cuda") + (s.trace_dir is not None)


def estimate_seconds(first_call_s: float, cases: Sequence[Case], order: Sequence[int], n_modes: int,
                     per_mode: int) -> float:
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


def _run_mode(mode: str, model, case: Case, prompts: Tensor, s: Settings, pad_token_id: int,
              device: torch.device, tick: Callable[[int], None]) -> dict:
    calls = calls_per_mode(s, device)
    entry = {"mode": mode, "error": None, "iterations": [], "summary": None, "median_stages": None,
             "peak_memory_bytes": None,
             "peak_memory_method": "cuda_allocator" if device.type == "cuda" else "cpu_profiler",
             "tokens_sha256": None, "trace": None}
    done = 0
    runner = None
    try:
        if mode == "hf-generate":
            runner = _HFGenerateMode(model, case, s, prompts, pad_token_id)
        else:
            runner = _RolloutMode(model, case, mode == "shared", s, prompts)
        for _ in range(s.warmup):
            runner()
            done += 1
            tick(1)
        responses = None
        for _ in range(s.iterations):
            profile, responses = runner()
            entry["iterations"].append(profile)
            done += 1
            tick(1)
        entry["summary"] = summarize_profiles(entry["iterations"])
        entry["median_stages"] = stage_breakdown(entry)
        entry["tokens_sha256"] = tokens_sha256(responses)
        if device.type == "cuda":
            entry["peak_memory_bytes"] = max(p["peak_memory_bytes"] for p in entry["iterations"])
        else:
            runner.free()  # so that the measured call allocates its KV buffer, as hf-generate does
            entry["peak_memory_bytes"] = cpu_peak_memory_bytes(runner)
            done += 1
            tick(1)
        if s.trace_dir is not None:
            path = os.path.join(s.trace_dir, f"{case.name}_{mode}.json")
            export_trace(runner, path, device)
            entry["trace"] = path
            done += 1
            tick(1)
    except Exception as e:  # noqa: BLE001 - a failed case is a result; the run goes on
        entry["error"] = _one_line(e)
        tick(calls - done)
    finally:
        if runner is not None:
            runner.free()
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return entry


def run_matrix(model: nn.Module, cases: Sequence[Case], modes: Sequence[str], settings: Settings, *,
               vocab_size: int, special_ids: Iterable[int], pad_token_id: int,
               progress: bool = True, on_case: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Run every case and mode; one result per case, in the requested order. on_case(i, result) is
    called as soon as case i (its index in `cases`) has finished. After the first call, one line on
    stderr gives the number of calls and an estimate of the run's time (see estimate_seconds)."""
    device = next(model.parameters()).device
    special_ids = list(special_ids)
    if settings.trace_dir is not None:
        os.makedirs(settings.trace_dir, exist_ok=True)
    per_mode = calls_per_mode(settings, device)
    total_calls = len(cases) * len(modes) * per_mode
    order = run_order(cases)
    bar = _progress_bar(total_calls, progress)
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
            bar.write(f"bench: {total_calls} calls in all ({len(cases)} case(s) x {len(modes)} mode(s) x {per_mode}); "
                      f"the first took {first:.1f} s, so the run may take about {_duration(est)} (rough: later cases "
                      f"scaled by rows x (P+R); first calls pay one-time costs, so it is often less)")

    try:
        for k, i in enumerate(order):
            case = cases[i]
            result = {"case": case.name, **dataclasses.asdict(case), "run_order": k, "error": None, "modes": {}}
            try:
                prompts = synthetic_prompts(case, vocab_size, special_ids, settings.seed, device)
            except Exception as e:  # noqa: BLE001
                result["error"] = _one_line(e)
                bar.update(len(modes) * per_mode)
                prompts = None
            if prompts is not None:
                for mode in modes:
                    bar.set_description(f"{case.name} {mode}")
                    result["modes"][mode] = _run_mode(mode, model, case, prompts, settings, pad_token_id,
                                                      device, tick)
            hashes = {m: e["tokens_sha256"] for m, e in result["modes"].items()}
            result["tokens_agree"] = token_agreement(hashes, settings.greedy)
            failed = [m for m, e in result["modes"].items() if e["error"]]
            if failed and not result["error"]:
                result["error"] = "; ".join(f"{m}: {result['modes'][m]['error']}" for m in failed)
            results[i] = result
            if on_case is not None:
                on_case(i, result)
    finally:
        bar.close()
    return results


class _NoBar:
    def update(self, n=1):
        pass

    def write(self, text):
        print(text, file=sys.stderr, flush=True)

    def set_description(self, desc):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with transformers; without it, no bar
        return _NoBar()
    bar = tqdm(total=total, unit="call", leave=False, dynamic_ncols=True)
    bar.write = lambda text: tqdm.write(text, file=sys.stderr)  # above the bar, not through it
    return bar


# --- output --------------------------------------------------------------------------------------
def _median(entry: dict, field: str):
    s = (entry.get("summary") or {}).get(field)
    return None if s is None else s["p50"]


def stage_breakdown(entry: dict) -> dict | None:
    """Stage times that add up to the median total (MEDIAN_STAGES_NOTE): those of the iteration whose
    total_ms is the median, or for an even count the mean of the two middle iterations (the median
    total is their mean), plus other_ms = total_ms - the stages. Keys: "iterations" (the indices
    used), "total_ms", "tokens_per_second" (generated tokens / total), and, for modes that report
    stages, every STAGE_FIELDS field and "other_ms". None when the mode has no iterations."""
    its = entry.get("iterations") or []
    if not its:
        return None
    order = sorted(range(len(its)), key=lambda i: its[i]["total_ms"])
    n = len(order)
    middle = [order[n // 2]] if n % 2 else [order[n // 2 - 1], order[n // 2]]

    def mean(field: str) -> float:
        return sum(its[i][field] for i in middle) / len(middle)

    out = {"iterations": middle, "total_ms": mean("total_ms")}
    out["tokens_per_second"] = mean("generated_tokens") / (out["total_ms"] / 1e3) if out["total_ms"] > 0 else 0.0
    if all(its[i].get(f) is not None for i in middle for f in STAGE_FIELDS):
        for f in STAGE_FIELDS:
            out[f] = mean(f)
        out["other_ms"] = out["total_ms"] - math.fsum(out[f] for f in STAGE_FIELDS)
    return out


def plot_segments(entry: dict) -> list[tuple[str, float]]:
    """The (label, ms) segments stacked for one mode in the plot: the median-total iteration's stages
    and "other" (they add up to its total_ms, the table's total), or ("total (not split)", total_ms)
    for a mode that reports no stages. [] for a failed mode."""
    split = entry.get("median_stages") or (None if entry.get("error") else stage_breakdown(entry))
    if split is None:
        return []
    if "other_ms" not in split:
        return [("total (not split)", split["total_ms"])]
    return [(f.removesuffix("_ms"), split[f]) for f in STAGE_FIELDS + ("other_ms",)]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_case_table(result: dict, iterations: int) -> str:
    """One case as a Markdown table: per mode, the stage times of the median-total iteration
    (stage_breakdown), which add up to the total shown."""
    counts = {len(e["iterations"]) for e in result["modes"].values() if e["iterations"]} or {iterations}
    n = max(counts)
    which = ("of the median-total iteration" if n % 2 else "of the two middle iterations by total (their mean)")
    head = (f"{result['case']}: B={result['batch_size']} N={result['samples_per_prompt']} "
            f"P={result['prompt_length']} R={result['response_length']} (rows {result['batch_size'] * result['samples_per_prompt']}), "
            f"{_plural(n, 'timed iteration')}: times {which}, so the stages add up to the total (median); "
            f"other = prompt expansion + post-processing + time between stages")
    lines = [head, "| mode | prefill ms | kv_expand ms | decode ms | other ms | total ms | tokens/s | peak MiB "
                   "| total / expanded |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = result["modes"].get("expanded")
    base_split = (base.get("median_stages") or stage_breakdown(base)) if base and not base["error"] else None
    base_total = base_split["total_ms"] if base_split else None

    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    for mode, e in result["modes"].items():
        if e["error"]:
            lines.append(f"| {mode} | failed: {e['error']} |")
            continue
        split = e.get("median_stages") or stage_breakdown(e)
        other = None
        if "other_ms" in split:
            other = split["other_ms"] + split["prompt_expansion_ms"] + split["post_processing_ms"]
        total = split["total_ms"]
        peak = e["peak_memory_bytes"]
        ratio = total / base_total if base_total else None
        lines.append(
            f"| {mode} | {f(split.get('prefill_ms'))} | {f(split.get('kv_expand_ms'), '{:.2f}')} "
            f"| {f(split.get('decode_ms'))} | {f(other)} | {f(total)} | {f(split['tokens_per_second'])} "
            f"| {f(None if peak is None else peak / 2**20)} | {f(ratio, '{:.2f}')} |")
    if result["error"] and not result["modes"]:
        lines.append(f"| (case) | failed: {result['error']} |")
    agree = result.get("tokens_agree") or {}
    if agree.get("pairs"):
        parts = [f"{k}: {'same' if v else 'DIFFERENT' if v is False else 'not comparable'}"
                 for k, v in agree["pairs"].items()]
        lines.append("tokens: " + ", ".join(parts))
        if None in agree["pairs"].values():
            lines.append(f"  ({NOT_COMPARABLE})")
    return "\n".join(lines)


def plot_stage_times(results: Sequence[dict], path: str, title: str) -> None:
    """A PNG of stacked stage times per mode (bars) and case (panels): plot_segments, i.e. the stages
    of the median-total iteration, whose bar tops are the table's median totals. hf-generate reports
    only its total, drawn hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r["modes"]]
    n = max(1, len(results))
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.8 * rows), squeeze=False)
    labels = [f.removesuffix("_ms") for f in STAGE_FIELDS] + ["other", "total (not split)"]
    colors = dict(zip(labels, ("#bbbbbb", "#4c72b0", "#dd8452", "#55a868", "#8172b2", "#937860", "#c44e52")))
    labelled = set()
    for ax, result in zip(axes.flat, results):
        names = list(result["modes"])
        for x, mode in enumerate(names):
            segments = plot_segments(result["modes"][mode])
            if not segments:
                ax.text(x, 0, "failed", ha="center", va="bottom", rotation=90, fontsize=8)
                continue
            bottom = 0.0
            for label, v in segments:
                if v > 0:
                    ax.bar(x, v, bottom=bottom, color=colors[label],
                           hatch="//" if label == "total (not split)" else None,
                           label=label if label not in labelled else None)
                    labelled.add(label)
                    bottom += v
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_title(result["case"], fontsize=9)
        ax.set_ylabel("ms, median-total iteration", fontsize=8)
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    fig.suptitle(f"{title}\nstages of the median-total iteration: bar height = the table's median total", fontsize=9)
    fig.legend(loc="lower center", ncol=7, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
