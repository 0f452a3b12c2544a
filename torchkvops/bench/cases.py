"""What a bench run is made of: the modes it compares, its cases (B, N, P, R) and the order they run
in, each case's synthetic prompts, the settings of a run, and the fields of every timed call's record.

The modes themselves are described in torchkvops.bench.matrix; nothing here runs a model.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ..rollout.profiling import RolloutProfile

__all__ = [
    "MODES",
    "DEFAULT_MODES",
    "ROLLOUT_MODES",
    "HF_MODES",
    "PROFILE_FIELDS",
    "ITERATION_FIELDS",
    "BOOKKEEPING_FIELDS",
    "SUMMARY_FIELDS",
    "INT_FIELDS",
    "STAGE_FIELDS",
    "PER_STEP_FIELDS",
    "Case",
    "plan_cases",
    "run_order",
    "synthetic_prompts",
    "Settings",
]


# --- the modes, and the fields of a timed call's record ------------------------------------------
MODES = ("expanded", "shared", "prefix", "paged", "hf-generate", "hf-static", "shared-nocompact", "prefix-nocompact")
DEFAULT_MODES = ("expanded", "shared", "prefix", "hf-generate")
ROLLOUT_MODES = ("expanded", "shared", "prefix", "paged", "shared-nocompact", "prefix-nocompact")
HF_MODES = ("hf-generate", "hf-static")
PROFILE_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutProfile))
# Each timed call's record: the rollout's profile fields (total_ms and tokens_per_second from the outer
# clock), then what the bench derives or adds.
ITERATION_FIELDS = PROFILE_FIELDS + (
    "rollout_total_ms",
    "decode_ms_per_step",
    "kv_bytes_per_step",
    "weight_bytes",
    "achieved_gbps",
    "roofline_fraction",
    "useful_fraction",
    "round",
    "started_ms",
)
# The interleaved order's bookkeeping: recorded, not summarized.
BOOKKEEPING_FIELDS = ("round", "started_ms")
SUMMARY_FIELDS = tuple(f for f in ITERATION_FIELDS if f not in BOOKKEEPING_FIELDS)
# The fields that are whole numbers (World.gather_records sends records as float64 and turns these back).
INT_FIELDS = {
    "generated_tokens",
    "decode_steps",
    "batch_size",
    "samples_per_prompt",
    "prompt_length",
    "response_length",
    "peak_memory_bytes",
    "kv_cache_bytes",
    "weight_bytes",
    "round",
    "computed_row_steps",
    "useful_row_steps",
}
STAGE_FIELDS = ("prompt_expansion_ms", "prefill_ms", "kv_expand_ms", "decode_ms", "post_processing_ms")
PER_STEP_FIELDS = (
    "decode_ms_per_step",
    "kv_bytes_per_step",
    "weight_bytes",
    "achieved_gbps",
    "roofline_fraction",
    "kv_cache_bytes",
    "useful_fraction",
)


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


def plan_cases(
    batch_sizes: Iterable[int],
    samples_per_prompt: Iterable[int],
    prompt_lengths: Iterable[int],
    response_lengths: Iterable[int],
) -> list[Case]:
    """Every combination, in the requested order (duplicates dropped)."""
    cases = [Case(*c) for c in itertools.product(batch_sizes, samples_per_prompt, prompt_lengths, response_lengths)]
    return list(dict.fromkeys(cases))


def run_order(cases: Sequence[Case]) -> list[int]:
    """Indices of `cases` in the order they run: most rows (B*N) first, then longest P+R; ties keep
    the requested order."""
    return sorted(
        range(len(cases)), key=lambda i: (-cases[i].rows, -(cases[i].prompt_length + cases[i].response_length))
    )


# --- inputs --------------------------------------------------------------------------------------
def synthetic_prompts(
    case: Case, vocab_size: int, special_ids: Iterable[int], seed: int, device: torch.device, shard: int = 0
) -> Tensor:
    """[B, P] random token ids, none of them special, the same for a given seed, prompt shape (B, P) and
    shard (a data-parallel process's rank: each process its own prompts; shard 0 is the single-process
    set). Not keyed by N or R: cases that differ only in their budget decode the same prompts, so that a
    length profile whose lengths do not follow R (eos-rate) gives the same rows the same tokens at every
    budget that holds them."""
    special = {int(i) for i in special_ids if i is not None and 0 <= int(i) < vocab_size}
    allowed = torch.tensor([i for i in range(vocab_size) if i not in special], dtype=torch.long)
    if allowed.numel() == 0:
        raise ValueError("synthetic_prompts: every token id of the vocabulary is special")
    key = f"{seed}:B{case.batch_size}_P{case.prompt_length}" + (f":{shard}" if shard else "")
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    idx = torch.randint(allowed.numel(), (case.batch_size, case.prompt_length), generator=gen)
    return allowed[idx].to(device)


# --- settings ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Settings:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    compile: bool = False
    warmup: int = 5
    iterations: int = 20
    trace_dir: str | None = None
    roofline_gbps: float | None = None  # copy_roofline's, to report each mode's fraction of (CUDA)
    mismatch: bool = False  # also measure each case's rollout-vs-trainer log-probability mismatch (mismatch.py)
    max_rows: int | None = None  # the rollout modes' RolloutConfig.max_rows (HF generate: every row at once)
    max_kv_tokens: int | None = None  # the paged mode's RolloutConfig.max_kv_tokens (the others: no bound)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
