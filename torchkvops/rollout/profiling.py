"""Stage timing for rollouts: `RolloutProfile` and the timer that fills it.

Every stage is always wrapped in `torch.profiler.record_function("torchkvops.<stage>")`, so a user's
own profiler trace shows it. Timing is on only when asked: CUDA events recorded at stage boundaries
and read after one synchronize at the end (perf_counter on CPU, where work is synchronous).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch

__all__ = ["RolloutProfile", "Clock", "StageTimer", "STAGES"]

# A call's stages, in order. "prompt_expansion" is the stage before the prefill: the expanded baseline
# repeats its prompts there, and a shared prefill finds a prefix common to every prompt (rollout.prompts);
# its name is DeepSpeed's profile key (`prompt_expansion_ms`, which torchkvops.deepspeed reports), kept.
STAGES = ("prompt_expansion", "prefill", "kv_expand", "decode", "post_processing")


@dataclasses.dataclass
class RolloutProfile:
    """Where one `Rollout.generate()` call spent its time. Times in milliseconds."""

    prompt_expansion_ms: float
    prefill_ms: float
    kv_expand_ms: float
    decode_ms: float
    generation_ms: float  # prefill + kv_expand + decode
    post_processing_ms: float
    total_ms: float  # the whole call, first stage to last
    generated_tokens: int  # real response tokens (response_mask ones)
    tokens_per_second: float  # generated_tokens / total time
    decode_steps: int
    batch_size: int
    samples_per_prompt: int
    prompt_length: int
    response_length: int
    peak_memory_bytes: int | None  # the accelerator's peak during the call; None on CPU
    # Bytes of KV storage the call used: prompt and response KV (either layout), and the compacted batch's
    # (which decodes in its own views, so that every row's KV stays for Rollout.extend).
    kv_cache_bytes: int
    # Bytes of KV storage the cache holds after the call: its allocations are kept across calls while big
    # enough, so this is at least kv_cache_bytes, and more after an earlier, larger call (a longer row, more
    # rows) or a widening (the decode buffer grows as rows grow, up to what max_new_tokens needs).
    kv_allocated_bytes: int = 0
    # Row-steps: one per row and sampled token position. Computed: the rows each token position was sampled
    # for (the batch shrinks with compact_finished_rows); useful: those that produced a token of a response
    # (up to and including its EOS: generated_tokens). useful_fraction = useful / computed.
    computed_row_steps: int = 0
    useful_row_steps: int = 0
    # Token positions this call's prefill computed (prompts, or with `Rollout.extend` each row's appended
    # tokens and last token, padding included), and positions whose KV came from an earlier call.
    prefill_tokens: int = 0
    reused_tokens: int = 0
    # RolloutConfig.max_rows: prompts admitted after the start, into rows that others' samples freed.
    refills: int = 0
    # RolloutConfig.max_kv_tokens: samples preempted when the budget ran short (each restarted from its prompt,
    # with the same tokens).
    preemptions: int = 0
    # A sharded model's weights gathered once for the call (patch_generate's gather_weights, hf.sharded):
    # the gather's milliseconds and the bytes of the weights it gathered (0: none was gathered).
    gather_ms: float = 0.0
    gathered_bytes: int = 0
    # PEFT LoRA merged into the weights for the call (merge_lora, models.lora): the merge's milliseconds and
    # the LoRA layers merged (0: none).
    merge_ms: float = 0.0
    merged_lora_layers: int = 0

    @classmethod
    def from_stages(cls, ms: dict[str, float], generated: int, **counts) -> RolloutProfile:
        """A call's profile from its stage times (StageTimer.elapsed_ms; a stage the call did not run
        counts 0) and counts (generated_tokens, and the other integer fields by name)."""
        stage = {name: ms.get(name, 0.0) for name in ("prompt_expansion", "prefill", "kv_expand", "decode")}
        return cls(
            prompt_expansion_ms=stage["prompt_expansion"],
            prefill_ms=stage["prefill"],
            kv_expand_ms=stage["kv_expand"],
            decode_ms=stage["decode"],
            generation_ms=stage["prefill"] + stage["kv_expand"] + stage["decode"],
            post_processing_ms=ms["post_processing"],
            total_ms=ms["total"],
            generated_tokens=generated,
            tokens_per_second=generated / (ms["total"] / 1e3) if ms["total"] > 0 else 0.0,
            useful_row_steps=generated,
            **counts,
        )

    @property
    def useful_fraction(self) -> float:
        return self.useful_row_steps / self.computed_row_steps if self.computed_row_steps else 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Clock:
    """The one clock of the library: a rollout's stage timer and the benchmark harness time with it. CUDA
    events recorded on the device's current stream (a model on cuda:1: that device's stream, not the
    current device's) and read after a synchronize; time.perf_counter on the CPU, where the work is
    synchronous."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def wait(self) -> None:
        """Host sync (CUDA): the marks recorded so far can be read."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


class StageTimer:
    """Marks stage boundaries with the Clock; `enabled=False` makes it record nothing and never synchronize."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled
        self.clock = Clock(device)
        self.is_cuda = self.clock.cuda
        self._marks: list[tuple[str, object, object]] = []  # (stage, start, end)

    def start(self) -> None:
        if self.enabled and self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(f"torchkvops.{name}"):
            start = self.clock.mark() if self.enabled else None
            yield
            if self.enabled:
                self._marks.append((name, start, self.clock.mark()))

    def elapsed_ms(self) -> dict[str, float]:
        """Milliseconds per stage (0 for stages not run) and `total`, from the first start to the
        last end. Synchronizes once, on CUDA."""
        self.clock.wait()
        span = self.clock.ms
        out = dict.fromkeys(STAGES, 0.0)
        for name, start, end in self._marks:
            out[name] += span(start, end)
        out["total"] = span(self._marks[0][1], self._marks[-1][2]) if self._marks else 0.0
        return out

    def peak_memory_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.is_cuda else None
