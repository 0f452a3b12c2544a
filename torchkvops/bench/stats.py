"""The numbers a bench draws from its timed calls: each field's summary (mean, median, p95), the stage
times of the median-total iteration (they add up to the median total), and whether two modes'
tokens agree.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .cases import HF_MODES, PER_STEP_FIELDS, ROLLOUT_MODES, STAGE_FIELDS

__all__ = [
    "NOT_COMPARABLE",
    "HF_NOT_COMPARED",
    "TOKENS_AGREE_NOTE",
    "MEDIAN_STAGES_NOTE",
    "summarize",
    "summarize_profiles",
    "stage_breakdown",
    "tokens_sha256",
    "token_agreement",
]

NOT_COMPARABLE = (
    "not comparable: Hugging Face samples with torch's generator, the rollout with its own "
    "counter-based sampler, so sampled tokens cannot match even when both are right; only greedy "
    "tokens (--temperature 0) can be compared across them"
)
HF_NOT_COMPARED = (
    "not compared under sampling: the static cache runs other attention kernels (compiled ones on "
    "CUDA) and torch.multinomial's pick depends on every probability's rounding; compare them with "
    "--temperature 0"
)
TOKENS_AGREE_NOTE = (
    "tokens_agree.pairs: true when two modes generated identical token ids, false when they "
    "differ although they should not (greedy; or two rollout modes, expanded / shared / prefix, "
    "which sample with the same sampler and the same per-row keys), null when they are not "
    "comparable (sampling with a Hugging Face mode: see tokens_agree.notes). Under "
    "torch.distributed: false if they differ on any process"
)
MEDIAN_STAGES_NOTE = (
    "median_stages: the stage times of the iteration whose total_ms is the median (for an even "
    "count, the mean of the two middle iterations), with other_ms = total_ms - the stages (time "
    "between them); they add up to summary.total_ms.p50, which the per-field medians of summary "
    "need not do. decode_ms_per_step, achieved_gbps, roofline_fraction and kv_cache_bytes there "
    "are of the same iteration(s). The table and the plot show these."
)


# --- summaries -----------------------------------------------------------------------------------
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


def summarize_profiles(profiles: Sequence[dict], fields: Sequence[str] | None = None) -> dict[str, dict | None]:
    """summarize() of the given fields (default: every field) of the per-iteration profiles."""
    return {field: summarize([p[field] for p in profiles]) for field in (fields or profiles[0])}


def stage_breakdown(entry: dict) -> dict | None:
    """Stage times that add up to the median total (MEDIAN_STAGES_NOTE): those of the iteration whose
    total_ms is the median, or for an even count the mean of the two middle iterations (the median
    total is their mean), plus other_ms = total_ms - the stages. Keys: "iterations" (the indices
    used), "total_ms", "tokens_per_second" (generated tokens / total), the stage fields the mode
    reports (all of STAGE_FIELDS for the rollout modes, prefill_ms and decode_ms for Hugging Face's)
    with "other_ms", and PER_STEP_FIELDS of the same iteration(s) (None when not measured). None when
    the mode has no iterations."""
    its = entry.get("iterations") or []
    if not its:
        return None
    order = sorted(range(len(its)), key=lambda i: its[i]["total_ms"])
    n = len(order)
    middle = [order[n // 2]] if n % 2 else [order[n // 2 - 1], order[n // 2]]

    def mean(field: str) -> float | None:
        values = [its[i].get(field) for i in middle]
        if any(v is None for v in values):
            return None
        return values[0] if len(values) == 1 else sum(values) / len(values)

    out = {"iterations": middle, "total_ms": mean("total_ms")}
    out["tokens_per_second"] = mean("generated_tokens") / (out["total_ms"] / 1e3) if out["total_ms"] > 0 else 0.0
    stages = {f: mean(f) for f in STAGE_FIELDS if mean(f) is not None}
    if stages:
        out.update(stages)
        out["other_ms"] = out["total_ms"] - math.fsum(stages.values())
    for f in PER_STEP_FIELDS:
        out[f] = mean(f)
    return out


# --- token agreement -----------------------------------------------------------------------------
def tokens_sha256(responses: Tensor) -> str:
    """sha256 of the responses' bytes as int64 (row-major, host byte order)."""
    return hashlib.sha256(responses.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()


def _not_comparable(a: str, b: str, greedy: bool) -> str | None:
    """Why two modes' tokens cannot be compared, or None when they must agree: greedy, or two rollout
    modes (the same sampler and the same per-row keys, however the prompt KV is prefilled or shared)."""
    if greedy or (a in ROLLOUT_MODES and b in ROLLOUT_MODES):
        return None
    return HF_NOT_COMPARED if a in HF_MODES and b in HF_MODES else NOT_COMPARABLE


def token_agreement(hashes: dict[str, str | None], greedy: bool) -> dict:
    """For each pair of modes that ran: True/False when their tokens should be identical (greedy, or two
    rollout modes with the same seed), None when they are not comparable (a note says why)."""
    pairs, notes = {}, {}
    modes = [m for m in hashes if hashes[m] is not None]
    for a, b in itertools.combinations(modes, 2):
        key = f"{a} vs {b}"
        why = _not_comparable(a, b, greedy)
        if why is None:
            pairs[key] = hashes[a] == hashes[b]
        else:
            pairs[key] = None
            notes[key] = why
    compared = [v for v in pairs.values() if v is not None]
    return {"pairs": pairs, "notes": notes, "all_agree": all(compared) if compared else None}
