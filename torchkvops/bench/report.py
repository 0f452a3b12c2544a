"""How a bench's results are shown and kept: a Markdown table per case, a PNG of stacked stage times,
and the --output JSON document. The numbers themselves come from stats.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .cases import STAGE_FIELDS, Case
from .stats import stage_breakdown

__all__ = ["FILE_NOTE", "results_document", "format_case_table", "format_mismatch_table", "plot_segments",
           "plot_stage_times"]

FILE_NOTE = ("status: 'partial' while the run goes on (rewritten after every case; a file left 'partial' is from a "
             "run that died), 'interrupted' after Ctrl-C, 'complete' at the end. cases: the finished cases in the "
             "requested order; cases_pending: those not finished.")


# --- the JSON document ---------------------------------------------------------------------------
def results_document(header: dict, cases: Sequence["Case"], results: Sequence[dict | None], status: str) -> dict:
    """The --output JSON: the header, the finished cases in the requested order, the names of the
    others, and the run's status ("partial", "interrupted" or "complete"; see FILE_NOTE)."""
    return {"status": status, "header": header, "cases": [r for r in results if r is not None],
            "cases_pending": [c.name for c, r in zip(cases, results) if r is None]}


# --- the table -----------------------------------------------------------------------------------
def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_case_table(result: dict, iterations: int) -> str:
    """One case as a Markdown table: per mode, the stage times of the median-total iteration
    (stage_breakdown), which add up to the total shown, and that iteration's decode ms per step,
    bandwidth (and fraction of the copy_ roofline, on CUDA) and KV storage."""
    counts = {len(e["iterations"]) for e in result["modes"].values() if e["iterations"]} or {iterations}
    n = max(counts)
    which = ("of the median-total iteration" if n % 2 else "of the two middle iterations by total (their mean)")
    rows = result["batch_size"] * result["samples_per_prompt"]
    head = (f"{result['case']}: B={result['batch_size']} N={result['samples_per_prompt']} "
            f"P={result['prompt_length']} R={result['response_length']} (rows {rows}), "
            f"{_plural(n, 'timed iteration')}: times {which}, so the stages add up to the total (median); "
            f"other = prompt expansion + post-processing + time between stages")
    world = result.get("world_size", 1)
    roofline = any((e.get("median_stages") or {}).get("roofline_fraction") is not None
                   for e in result["modes"].values())
    lines = [head,
             "useful = generated tokens / row-steps computed (each row's sampled positions, summed; the batch "
             "shrinks as rows end unless compaction is off); decode ms/step, GB/s (weights + KV read per decode step "
             "/ decode ms per step)"
             + (", % of the copy_ roofline" if roofline else "") + " and KV MiB (KV storage used) are of the same "
             "iteration(s); modes ran interleaved, timed by one clock"]
    if world > 1:
        lines.append(f"data-parallel over {world} processes: B is per process (global batch "
                     f"{result['batch_size'] * world} prompts); times are the slowest process's in each iteration, "
                     "tokens/s counts every process's tokens (global)")
    cols = ["mode", "prefill ms", "kv_expand ms", "decode ms", "other ms", "total ms", "decode ms/step", "GB/s"]
    cols += ["% of roofline"] if roofline else []
    cols += ["tokens/s" if world == 1 else "global tokens/s", "KV MiB", "peak MiB", "useful", "total / expanded"]
    lines += ["| " + " | ".join(cols) + " |", "|---" + "|---:" * (len(cols) - 1) + "|"]
    base = result["modes"].get("expanded")
    base_split = (base.get("median_stages") or stage_breakdown(base)) if base and not base["error"] else None
    base_total = base_split["total_ms"] if base_split else None

    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    def mib(v):
        return None if v is None else v / 2**20

    for mode, e in result["modes"].items():
        if e["error"]:
            lines.append(f"| {mode} | failed: {e['error']} |")
            continue
        split = e.get("median_stages") or stage_breakdown(e)
        other = None
        if "other_ms" in split:
            other = (split["other_ms"] + (split.get("prompt_expansion_ms") or 0.0)
                     + (split.get("post_processing_ms") or 0.0))
        total = split["total_ms"]
        ratio = total / base_total if base_total else None
        fraction = split.get("roofline_fraction")
        cells = [mode, f(split.get("prefill_ms")), f(split.get("kv_expand_ms"), "{:.2f}"), f(split.get("decode_ms")),
                 f(other), f(total), f(split.get("decode_ms_per_step"), "{:.2f}"),
                 f(split.get("achieved_gbps"), "{:.2f}")]
        cells += [f(None if fraction is None else 100 * fraction)] if roofline else []
        cells += [f(split["tokens_per_second"]), f(mib(split.get("kv_cache_bytes")), "{:.2f}"),
                  f(mib(e["peak_memory_bytes"])), f(split.get("useful_fraction"), "{:.2f}"), f(ratio, "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    if result["error"] and not result["modes"]:
        lines.append(f"| (case) | failed: {result['error']} |")
    agree = result.get("tokens_agree") or {}
    if agree.get("pairs"):
        parts = [f"{k}: {'same' if v else 'DIFFERENT' if v is False else 'not comparable'}"
                 for k, v in agree["pairs"].items()]
        lines.append("tokens: " + ", ".join(parts))
        for note in dict.fromkeys(agree.get("notes", {}).values()):
            lines.append(f"  ({note})")
    return "\n".join(lines)


def format_mismatch_table(result: dict) -> str:
    """A case's rollout-vs-trainer mismatch (bench --mismatch) as a Markdown table, or "" without it."""
    engines = result.get("mismatch")
    if not engines:
        return ""
    lines = [f"{result['case']}: log-probabilities against a trainer's forward over the same sequences "
             "(|delta| = |engine - trainer|; k3 estimates KL(engine || trainer))",
             "| engine | tokens | mean abs delta | max abs delta | k3 KL |", "|---|---:|---:|---:|---:|"]
    for name, m in engines.items():
        if "error" in m:
            lines.append(f"| {name} | failed: {m['error']} |")
            continue
        lines.append(f"| {name} | {m['tokens']} | {m['mean_abs_delta']:.3g} | {m['max_abs_delta']:.3g} | "
                     f"{m['k3_kl']:.3g} |")
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
                    ax.bar(x, v, bottom=bottom, color=colors[label],
                           hatch="//" if label == "total (not split)" else None,
                           label=label if label not in labelled else None)
                    labelled.add(label)
                    bottom += v
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.set_title(result["case"], fontsize=9)
        ax.set_ylabel("ms, median-total iteration", fontsize=8)
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    fig.suptitle(f"{title}\nstages of the median-total iteration: bar height = the table's median total", fontsize=9)
    fig.legend(loc="lower center", ncol=7, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)
