"""How a bench's results are shown and kept: a Markdown table per case, a PNG of stacked stage times,
and the --output JSON document. The numbers themselves come from stats.py.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Sequence

from .cases import STAGE_FIELDS, Case
from .stats import stage_breakdown

__all__ = [
    "FILE_NOTE",
    "TABLE_WIDTH",
    "WIDE_ONLY",
    "results_document",
    "format_case_table",
    "format_mismatch_table",
    "format_spread_note",
    "plot_segments",
    "plot_stage_times",
]

FILE_NOTE = (
    "status: 'partial' while the run goes on (rewritten after every case; a file left 'partial' is from a "
    "run that died), 'interrupted' after Ctrl-C, 'complete' at the end. cases: the finished cases in the "
    "requested order; cases_pending: those not finished."
)


# --- the JSON document ---------------------------------------------------------------------------
def results_document(header: dict, cases: Sequence[Case], results: Sequence[dict | None], status: str) -> dict:
    """The --output JSON: the header, the finished cases in the requested order, the names of the
    others, and the run's status ("partial", "interrupted" or "complete"; see FILE_NOTE)."""
    return {
        "status": status,
        "header": header,
        "cases": [r for r in results if r is not None],
        "cases_pending": [c.name for c, r in zip(cases, results) if r is None],
    }


# --- the table -----------------------------------------------------------------------------------
def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


TABLE_WIDTH = 120  # the default table and its notes fit a terminal this wide (tests/test_cli.py checks it)
# The columns only `bench --wide` shows (the JSON has every figure): the stages besides prefill (with them
# the stages add up to the total), peak memory, the useful fraction and the ratio to expanded's total.
WIDE_ONLY = ("kv_expand ms", "decode ms", "other ms", "peak MiB", "useful", "total / expanded")


def _wrap(text: str, width: int = TABLE_WIDTH) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


def format_case_table(result: dict, iterations: int, wide: bool = False) -> str:
    """One case as a Markdown table: per mode, the figures of the median-total iteration
    (stage_breakdown): prefill and total ms, decode ms per step, the bandwidth it achieves (and the
    fraction of the copy_ roofline, on CUDA), tokens/s and KV storage. Its lines fit TABLE_WIDTH
    columns; with wide=True it also shows WIDE_ONLY: the other stages (which add up to the total shown),
    peak memory, the useful fraction and the total relative to expanded's."""
    roofline = any(
        (e.get("median_stages") or {}).get("roofline_fraction") is not None for e in result["modes"].values()
    )
    world = result.get("world_size", 1)
    lines = [line for text in _case_notes(result, iterations, wide, roofline) for line in _wrap(text)]
    cols = ["mode", "prefill ms", "kv_expand ms", "decode ms", "other ms", "total ms", "decode ms/step", "GB/s"]
    cols += ["% of roofline"] if roofline else []
    cols += ["tokens/s" if world == 1 else "global tokens/s", "KV MiB", "peak MiB", "useful", "total / expanded"]
    keep = [wide or c not in WIDE_ONLY for c in cols]
    lines += ["| " + " | ".join(c for c, k in zip(cols, keep) if k) + " |", "|---" + "|---:" * (sum(keep) - 1) + "|"]
    base = result["modes"].get("expanded")
    base_split = (base.get("median_stages") or stage_breakdown(base)) if base and not base["error"] else None
    base_total = base_split["total_ms"] if base_split else None
    for mode, e in result["modes"].items():
        if e["error"]:
            lines.append(f"| {mode} | failed: {e['error']} |")
            continue
        cells = _mode_cells(mode, e, base_total, roofline)
        lines.append("| " + " | ".join(c for c, k in zip(cells, keep) if k) + " |")
    if result["error"] and not result["modes"]:
        lines.append(f"| (case) | failed: {result['error']} |")
    return "\n".join(lines + _tokens_agree_lines(result))


def _case_notes(result: dict, iterations: int, wide: bool, roofline: bool) -> list[str]:
    """The case's line and the notes that say what the table's figures are."""
    counts = {len(e["iterations"]) for e in result["modes"].values() if e["iterations"]} or {iterations}
    n = max(counts)
    which = "of the median-total iteration" if n % 2 else "of the two middle iterations by total (their mean)"
    rows = result["batch_size"] * result["samples_per_prompt"]
    world = result.get("world_size", 1)
    case = (
        f"{result['case']}: B={result['batch_size']} N={result['samples_per_prompt']} "
        f"P={result['prompt_length']} R={result['response_length']} (rows {rows}), "
        f"{_plural(n, 'timed iteration')}, modes ran interleaved, timed by one clock"
    )
    if wide:
        notes = [
            f"times {which}, so the stages add up to the total (median); other = prompt expansion + "
            "post-processing + time between stages",
            "useful = generated tokens / row-steps computed (each row's sampled positions, summed; the batch "
            "shrinks as rows end unless compaction is off); decode ms/step, GB/s (weights + KV read per decode "
            "step / decode ms per step)"
            + (", % of the copy_ roofline" if roofline else "")
            + " and KV MiB (KV storage used) are of the same iteration(s)",
        ]
    else:
        notes = [
            f"figures {which}; GB/s = (weights + KV read per decode step) / decode ms per step",
            "KV MiB = KV storage; "
            + ("% of roofline: of the copy_ roofline measured at the start of the run; " if roofline else "")
            + "--wide adds the other stages (which add up to the total), peak MiB, useful, total / expanded",
        ]
    if world > 1:
        notes.append(
            f"data-parallel over {world} processes: B is per process (global batch "
            f"{result['batch_size'] * world} prompts); times are the slowest process's in each iteration, "
            "tokens/s counts every process's tokens (global)"
        )
    return [case, *notes]


def _cell(v, fmt="{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _mib(v):
    return None if v is None else v / 2**20


def _mode_cells(mode: str, e: dict, base_total: float | None, roofline: bool) -> list[str]:
    """A mode's row, every column (the caller keeps the ones shown)."""
    split = e.get("median_stages") or stage_breakdown(e)
    other = None
    if "other_ms" in split:
        other = split["other_ms"] + (split.get("prompt_expansion_ms") or 0.0) + (split.get("post_processing_ms") or 0.0)
    total = split["total_ms"]
    ratio = total / base_total if base_total else None
    fraction = split.get("roofline_fraction")
    cells = [
        mode,
        _cell(split.get("prefill_ms")),
        _cell(split.get("kv_expand_ms"), "{:.2f}"),
        _cell(split.get("decode_ms")),
        _cell(other),
        _cell(total),
        _cell(split.get("decode_ms_per_step"), "{:.2f}"),
        _cell(split.get("achieved_gbps"), "{:.2f}"),
    ]
    cells += [_cell(None if fraction is None else 100 * fraction)] if roofline else []
    return cells + [
        _cell(split["tokens_per_second"]),
        _cell(_mib(split.get("kv_cache_bytes")), "{:.2f}"),
        _cell(_mib(e["peak_memory_bytes"])),
        _cell(split.get("useful_fraction"), "{:.2f}"),
        _cell(ratio, "{:.2f}"),
    ]


def _tokens_agree_lines(result: dict) -> list[str]:
    """Whether the modes sampled the same tokens, pair by pair, with the notes on pairs not comparable."""
    agree = result.get("tokens_agree") or {}
    if not agree.get("pairs"):
        return []
    parts = [
        f"{k}: {'same' if v else 'DIFFERENT' if v is False else 'not comparable'}" for k, v in agree["pairs"].items()
    ]
    lines = _wrap("tokens: " + ", ".join(parts))
    for note in dict.fromkeys(agree.get("notes", {}).values()):
        lines += ["  " + line for line in _wrap(f"({note})", TABLE_WIDTH - 2)]
    return lines


# A mode's timed rounds may differ by this fraction of their median before the note says they disagree.
SPREAD_LIMIT = 0.25


def format_spread_note(result: dict, limit: float = SPREAD_LIMIT) -> str | None:
    """A note when a case's interleaved rounds disagree too much for its modes to be compared: a mode whose
    totals spread (max - min) more than `limit` of their median, or two modes whose totals' ranges overlap
    while their medians differ by more than `limit` of the smaller one's (an ordering the rounds do not
    agree on). None when the rounds agree (or there are fewer than 2 of a mode). Lines of TABLE_WIDTH."""
    totals = {m: [it["total_ms"] for it in e["iterations"]] for m, e in result["modes"].items()}
    totals = {m: t for m, t in totals.items() if len(t) >= 2}
    noisy = []
    for mode, t in totals.items():
        median = statistics.median(t)
        if median > 0 and (max(t) - min(t)) / median > limit:
            noisy.append(f"{mode} {min(t):,.0f}-{max(t):,.0f} ms")
    modes = list(totals)
    crossed = []
    for i, a in enumerate(modes):
        for b in modes[i + 1 :]:
            ta, tb = totals[a], totals[b]
            ma, mb = statistics.median(ta), statistics.median(tb)
            overlap = min(max(ta), max(tb)) >= max(min(ta), min(tb))
            if overlap and abs(ma - mb) > limit * min(ma, mb):
                crossed.append(f"{a} and {b}")
    if not noisy and not crossed:
        return None
    parts = []
    if noisy:
        parts.append(f"rounds spread more than {limit:.0%} of their median ({'; '.join(noisy)})")
    if crossed:
        parts.append(f"the rounds do not agree on the order of {', '.join(crossed)}")
    note = (
        f"note: {' and '.join(parts)}: this machine's noise is larger than what the table compares "
        "(another job on its cores?); rerun with more --iterations, --threads 1, or on a quiet machine"
    )
    return "\n".join(_wrap(note))  # (the table's width)


def format_mismatch_table(result: dict) -> str:
    """A case's rollout-vs-trainer mismatch (bench --mismatch) as a Markdown table, or "" without it."""
    engines = result.get("mismatch")
    if not engines:
        return ""
    lines = [
        f"{result['case']}: log-probabilities against a trainer's forward over the same sequences "
        "(|delta| = |engine - trainer|; k3 estimates KL(engine || trainer))",
        "| engine | tokens | mean abs delta | max abs delta | k3 KL |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in engines.items():
        if "error" in m:
            lines.append(f"| {name} | failed: {m['error']} |")
            continue
        lines.append(
            f"| {name} | {m['tokens']} | {m['mean_abs_delta']:.3g} | {m['max_abs_delta']:.3g} | {m['k3_kl']:.3g} |"
        )
    return "\n".join(lines)


# --- the plot ------------------------------------------------------------------------------------
def plot_segments(entry: dict) -> list[tuple[str, float]]:
    """The (label, ms) segments stacked for one mode in the plot: the median-total iteration's stages
    and "other" (they add up to its total_ms, the table's total), or ("total (not split)", total_ms)
    for a mode that reports no stages. [] for a failed mode."""
    split = entry.get("median_stages") or (None if entry.get("error") else stage_breakdown(entry))
    if split is None:
        return []
    if "other_ms" not in split:
        return [("total (not split)", split["total_ms"])]
    return [(f.removesuffix("_ms"), split[f]) for f in STAGE_FIELDS if f in split] + [("other", split["other_ms"])]


def plot_stage_times(results: Sequence[dict], path: str, title: str) -> None:
    """A PNG of stacked stage times per mode (bars) and case (panels): plot_segments, i.e. the stages
    of the median-total iteration, whose bar tops are the table's median totals. A mode that reports
    only its total is drawn hatched."""
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
                    ax.bar(
                        x,
                        v,
                        bottom=bottom,
                        color=colors[label],
                        hatch="//" if label == "total (not split)" else None,
                        label=label if label not in labelled else None,
                    )
                    labelled.add(label)
                    bottom += v
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.set_title(result["case"], fontsize=9)
        ax.set_ylabel("ms, median-total iteration", fontsize=8)
    for ax in list(axes.flat)[len(results) :]:
        ax.axis("off")
    fig.suptitle(f"{title}\nstages of the median-total iteration: bar height = the table's median total", fontsize=9)
    fig.legend(loc="lower center", ncol=7, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)
