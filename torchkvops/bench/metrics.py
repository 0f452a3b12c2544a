"""How a bench call is measured: the one clock every call is timed with, the bytes a decode step reads
and the copy_ roofline they are compared with, a call's peak memory, and a Chrome trace of a call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import os
import sys
import tempfile
from collections.abc import Callable

import torch
from torch import nn

from ..models.adapter import CacheSpec, ModelAdapter
from ..rollout.profiling import Clock
from .stats import summarize

__all__ = [
    "saved_tensor_bytes",
    "BYTES_NOTE",
    "ROOFLINE_NOTE",
    "PEAK_NOTE",
    "UNKNOWN_BLOCK",
    "model_weight_bytes",
    "kv_bytes_per_token",
    "Traffic",
    "copy_roofline",
    "cpu_peak_memory_bytes",
    "peak_memory_bytes",
    "export_trace",
]

BYTES_NOTE = (
    "bytes read per decode step, a model of the useful traffic (not what kernels read over padding or masked "
    "positions): weight_bytes = bytes of the model's unique parameters and buffers (tied weights once, by "
    "storage; the input embedding counted in full); kv_bytes_per_token = layers x 2 x kv_heads x head_dim x "
    "dtype bytes; decode step t = 1..S (S = decode_steps) attends to P + t keys per row, averaged over the "
    "steps: t_avg = (S + 1) / 2. kv_bytes_per_step: expanded, shared, hf-generate, hf-static: rows x "
    "kv_bytes_per_token x (P + t_avg); prefix: (B x P + rows x t_avg) x kv_bytes_per_token, with rows = "
    "B x N; a hybrid adds rows x state_bytes_per_row (its recurrent layers' states, read every step). "
    "With the batch compacted as rows end (compact_finished_rows), kv_bytes_per_step is scaled by the "
    "mean fraction of the rows decoded, computed_row_steps / (rows x (S + 1)) (approximate: rows "
    "and prompts leave at different steps). achieved_gbps = (weight_bytes + kv_bytes_per_step) / "
    "decode_ms_per_step / 1e6 (GB/s, 1e9 bytes); roofline_fraction = achieved_gbps / copy_roofline_gbps (CUDA only)"
)
ROOFLINE_NOTE = (
    "CUDA only: at the start of the run, dst.copy_(src) device to device on two buffers of `bytes` each "
    "(1 GiB, less when memory is short), timed with CUDA events; copy_roofline_gbps = 2 x bytes (read "
    "+ write) / the median of `repeats` timed copies"
)
PEAK_NOTE = {
    "cuda": "torch.cuda.max_memory_allocated over one extra call per mode after the timed rounds, every "
    "mode's buffers released first (weights included)",
    "cpu": "one extra call per mode after the timed rounds, every mode's buffers released first, under "
    "torch.profiler(profile_memory=True): peak of the running sum of its [memory] events, i.e. "
    "memory held beyond what was allocated when the call began (weights excluded). Blocks "
    "allocated before the call and freed in it (a rollout's previous decode state) are not "
    "subtracted, so the peak can exceed the true one by at most their size",
}


# --- bytes and the roofline (timed by the one clock, torchkvops.rollout.profiling.Clock) -------------
def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's unique parameters and buffers, counted once per storage (tied weights once)."""
    storages: dict[tuple, int] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        s = t.untyped_storage()
        key = (t.device, s.data_ptr())
        storages[key] = max(storages.get(key, 0), s.nbytes())
    return sum(storages.values())


def cache_spec(model: nn.Module) -> CacheSpec:
    """The rollout's cache groups for the model (a hybrid's recurrent layers found by the adapter's probe);
    for a model the rollout refuses, every layer as attention, from its config."""
    try:
        return ModelAdapter(model).cache_spec
    except (ValueError, TypeError):
        return CacheSpec.from_config(model.config)


def kv_bytes_per_token(model: nn.Module) -> int:
    """layers x (K, V) x kv_heads x head_dim x the bytes of the model's dtype, summed over the KV cache's
    attention groups."""
    return cache_spec(model).values_per_token * next(model.parameters()).element_size()


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What a decode step reads (BYTES_NOTE), and the roofline to compare it with (None on the CPU)."""

    weight_bytes: int
    kv_bytes_per_token: int
    roofline_gbps: float | None = None
    state_bytes_per_row: int = 0  # a hybrid's recurrent states, read by every row at every step

    @classmethod
    def of(cls, model: nn.Module, roofline_gbps: float | None = None) -> Traffic:
        spec, size = cache_spec(model), next(model.parameters()).element_size()  # (one probe of a hybrid)
        return cls(model_weight_bytes(model), spec.values_per_token * size, roofline_gbps, spec.values_per_row * size)

    def kv_bytes_per_step(self, mode: str, batch: int, samples: int, prompt_len: int, steps: int) -> float | None:
        """KV bytes one decode step attends to, averaged over steps t = 1..steps (P + t keys per row)."""
        if steps <= 0:
            return None
        t_avg = (steps + 1) / 2
        rows = batch * samples
        states = rows * self.state_bytes_per_row
        if mode == "prefix":  # the prompt once per prompt, each row's own response keys
            return float(self.kv_bytes_per_token * (batch * prompt_len + rows * t_avg) + states)
        return float(self.kv_bytes_per_token * rows * (prompt_len + t_avg) + states)

    def annotate(self, mode: str, profile: dict) -> dict:
        """Add decode_ms_per_step, kv_bytes_per_step, weight_bytes, achieved_gbps, roofline_fraction."""
        steps, decode_ms = profile.get("decode_steps") or 0, profile.get("decode_ms")
        per_step = decode_ms / steps if steps > 0 and decode_ms is not None else None
        kv = self.kv_bytes_per_step(
            mode.removesuffix("-nocompact"),
            profile["batch_size"],
            profile["samples_per_prompt"],
            profile["prompt_length"],
            steps,
        )
        computed = profile.get("computed_row_steps")
        if kv is not None and computed:  # a compacted batch decodes fewer rows (BYTES_NOTE)
            kv *= computed / (profile["batch_size"] * profile["samples_per_prompt"] * (steps + 1))
        gbps = (self.weight_bytes + kv) / per_step / 1e6 if per_step and kv is not None else None
        fraction = gbps / self.roofline_gbps if gbps is not None and self.roofline_gbps else None
        profile.update(
            decode_ms_per_step=per_step,
            kv_bytes_per_step=kv,
            weight_bytes=self.weight_bytes,
            achieved_gbps=gbps,
            roofline_fraction=fraction,
        )
        return profile


def copy_roofline(device: torch.device, max_bytes: int = 1 << 30, repeats: int = 7) -> dict | None:
    """ROOFLINE_NOTE: device-to-device dst.copy_(src) bandwidth, on CUDA only (None elsewhere)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = min(max_bytes, free // 4) // (1 << 20) * (1 << 20)  # two buffers, and room to spare
    if nbytes <= 0:
        return None
    clock = Clock(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        start = clock.mark()
        dst.copy_(src)
        end = clock.mark()
        clock.wait()
        times.append(clock.ms(start, end))
    del src, dst
    torch.cuda.empty_cache()
    ms = summarize(times)["p50"]
    return {
        "copy_roofline_gbps": 2 * nbytes / ms / 1e6,
        "bytes": nbytes,
        "median_ms": ms,
        "repeats": repeats,
        "note": ROOFLINE_NOTE,
    }


# --- memory and traces ---------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


# What torch's CPU allocator prints (once per 1000 times, first time included) when a block allocated before
# a memory profile started is freed during it: the free of a block it has no size for is not recorded.
UNKNOWN_BLOCK = "Memory block of unknown size was allocated before the profiling started"


@contextlib.contextmanager
def _without(line_text: str):
    """Run the body with the process's stderr (file descriptor 2, where torch's C++ warnings go) caught in
    a temporary file, then write what it caught to stderr, less the lines that contain line_text: so
    the body's own output still shows (after the body), all but that one warning."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [
                line
                for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                if line_text not in line
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def saved_tensor_bytes(fn: Callable[[], object], exclude: frozenset[int] = frozenset()) -> int:
    """Bytes of the tensors autograd saves for backward while fn() runs: each storage once, those whose
    data_ptr is in `exclude` (say the parameters') left out. fn's result is dropped."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def cpu_peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Run fn once under the profiler with profile_memory=True and return the peak of the running
    sum of its CPU "[memory]" events (+bytes allocated, -bytes freed) in time order.

    A block allocated before the profile started and freed in it has no event (PEAK_NOTE says what that
    does to the peak); torch's allocator warns about it on stderr, in the middle of the bench's progress
    bar, and that line alone is dropped from what fn writes to stderr (UNKNOWN_BLOCK, _without).

    The raw kineto events are read: `prof.events()` folds allocations made inside an op into that op
    and keeps as "[memory]" only those made outside any op (checked on torch 2.14)."""
    from torch.autograd.profiler_util import MEMORY_EVENT_NAME
    from torch.profiler import ProfilerActivity, profile

    with _profiling(profile(activities=[ProfilerActivity.CPU], profile_memory=True)) as prof, _without(UNKNOWN_BLOCK):
        fn()
    cpu_types = {torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.MKLDNN, torch.autograd.DeviceType.IDEEP}
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == MEMORY_EVENT_NAME and e.device_type() in cpu_types
    ]
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return peak


def peak_memory_bytes(runner, device: torch.device) -> int:
    """PEAK_NOTE: one call, every mode's buffers already released by the caller."""
    gc.collect()  # garbage of earlier calls is freed now, not inside the measured call
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        runner.run()
        _sync(device)
        return torch.cuda.max_memory_allocated(device)
    return cpu_peak_memory_bytes(runner.run)


def export_trace(fn: Callable[[], object], path: str, device: torch.device) -> None:
    """Run fn once under torch.profiler and write a Chrome trace (the torchkvops.* stages show as
    user annotations)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _profiling(profile(activities=activities)) as prof:
        fn()
        _sync(device)
    prof.export_chrome_trace(path)
