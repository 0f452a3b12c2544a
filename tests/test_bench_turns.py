"""`torchkvops bench-turns` (torchkvops.bench.turns): one small multi-turn case end to end, the counts
it reports (prefill tokens with and without reuse, from the case's sizes), and the argument checks."""

import json
import os
import subprocess
import sys
from pathlib import Path

from timeouts import TIMEOUT

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )  # this checkout's torchkvops
    return subprocess.run(
        [sys.executable, "-m", "torchkvops", "bench-turns", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_one_case_end_to_end(tmp_path):
    output = tmp_path / "turns.json"
    b, n, p, k, r, t = 2, 3, 40, 3, 4, 6
    proc = run(
        *("--model-shape", "tiny", "--device", "cpu", "--prompts", str(b), "--samples-per-prompt", str(n)),
        *("--prompt-length", str(p), "--turns", str(k), "--response-length", str(r), "--append-length", str(t)),
        *("--iterations", "1", "--warmup", "0", "--threads", "1", "--output", str(output)),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(output.read_text())["result"]
    modes = result["modes"]
    rows = b * n
    # reuse: the prompts once, then each row's appended tokens and its last token per turn
    assert [turn["prefill_tokens"] for turn in modes["reuse"]["turns"]] == [b * p] + [rows * (t + 1)] * (k - 1)
    assert all(turn["reused_tokens"] > 0 for turn in modes["reuse"]["turns"][1:])
    # without reuse, every turn's prefill is every row's whole history
    histories = [rows * (p + turn * (r + t)) for turn in range(1, k)]
    assert [turn["prefill_tokens"] for turn in modes["no-reuse"]["turns"]] == [b * p, *histories]
    assert [turn["prefill_tokens"] for turn in modes["hf"]["turns"]] == [rows * p, *histories]
    ratio = (b * p + (k - 1) * rows * (t + 1)) / (b * p + (k - 1) * rows * t)
    assert abs(result["prefill_tokens_over_prompts_and_appended"] - ratio) < 1e-9
    assert "speedup_over_hf" in result and "reuse" in proc.stdout


def test_lengths_past_the_models_positions_fail_before_any_work():
    proc = run("--model-shape", "gpt2", "--prompt-length", "900", "--turns", "3", "--response-length", "32")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("torchkvops: error:")
    assert "reach 1124 tokens, more than the gpt2 shape's 1024 positions" in proc.stderr
