"""The command line under torchrun (gloo, CPU, 2 processes on 127.0.0.1): `rollout` writes one file with
every sample exactly once, generated on both ranks and equal to a single-process run; `bench` reports
once, with the processes in its header; a failure on one rank is one line on every rank. Plus the
launch helpers, directly. Every launch is bounded by a timeout."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from timeouts import TIMEOUT

from torchkvops.cli import checks as cli_checks
from torchkvops.cli import launch as cli_launch

ROOT = Path(__file__).absolute().parents[1]
ROLLOUT = [
    "rollout",
    "--model-shape",
    "tiny",
    "--device",
    "cpu",
    "--num-prompts",
    "3",
    "-n",
    "2",
    "--max-new-tokens",
    "4",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("TORCHKVOPS_DEBUG", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        e.pop(name, None)
    return e


def torchrun(*args: str, program: list[str] | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node 2 ... -m torchkvops ARGS` (or another program)."""
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]
    target = program if program is not None else ["-m", "torchkvops"]
    return subprocess.run(
        [*launch, *target, *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=TIMEOUT
    )


def single(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchkvops", *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- the helpers, directly -----------------------------------------------------------------------
def test_shards_are_contiguous_and_differ_by_at_most_one():
    assert cli_launch.shard_bounds(3, 2) == [(0, 2), (2, 3)]
    assert cli_launch.shard_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]  # fewer prompts than processes
    for count in range(0, 12):
        for world in range(1, 6):
            bounds = cli_launch.shard_bounds(count, world)
            assert bounds[0][0] == 0 and bounds[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [hi - lo for lo, hi in bounds]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_torchrun_is_detected_from_its_environment():
    assert cli_launch.torchrun_env({}) is None
    assert cli_launch.torchrun_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert cli_launch.torchrun_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}) == {
        "world_size": 2,
        "rank": 1,
        "local_rank": 1,
    }
    # torchrun --nproc-per-node 1 is still torchrun
    assert cli_launch.torchrun_env({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "1", "RANK": "0"})["world_size"] == 1
    with pytest.raises(cli_checks.CLIError, match="RANK='a' is not an integer"):
        cli_launch.torchrun_env({"WORLD_SIZE": "2", "RANK": "a"})
    with pytest.raises(cli_checks.CLIError, match="outside"):
        cli_launch.torchrun_env({"WORLD_SIZE": "2", "RANK": "2"})


# --- under torchrun ------------------------------------------------------------------------------
def test_rollout_under_torchrun_writes_one_file_equal_to_a_single_process_run(tmp_path):
    out = tmp_path / "samples.jsonl"
    proc = torchrun(*ROLLOUT, "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.jsonl"]  # one file, written once
    got = records(out)
    assert sorted((r["prompt_index"], r["sample_index"]) for r in got) == [(i, j) for i in range(3) for j in range(2)]
    # Contiguous shards: prompts 0 and 1 on rank 0, prompt 2 on rank 1.
    assert {r["prompt_index"]: r["rank"] for r in got} == {0: 0, 1: 0, 2: 1}
    assert proc.stdout.count("=== prompt 0:") == 1 and proc.stdout.count("rank 1/2: prompts 2..2") == 1

    ref_out = tmp_path / "single" / "samples.jsonl"
    ref_out.parent.mkdir()
    ref = single(*ROLLOUT, "--output", str(ref_out))
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = records(ref_out)
    assert {r["rank"] for r in expected} == {0}

    def key(r):
        return r["prompt_index"], r["sample_index"]

    # The same seed: the samples do not depend on the number of processes.
    for a, b in zip(sorted(got, key=key), sorted(expected, key=key), strict=True):
        assert key(a) == key(b) and a["prompt_token_ids"] == b["prompt_token_ids"]
        assert a["token_ids"] == b["token_ids"], key(a)


def test_bench_under_torchrun_reports_once_for_every_process(tmp_path):
    out = tmp_path / "bench.json"
    proc = torchrun(
        "bench",
        "--model-shape",
        "tiny",
        "--device",
        "cpu",
        "--batch-sizes",
        "1",
        "--samples-per-prompt",
        "2",
        "--prompt-lengths",
        "8",
        "--response-lengths",
        "4",
        "--modes",
        "shared",
        "hf-generate",
        "--warmup",
        "1",
        "--iterations",
        "1",
        "--no-progress",
        "--output",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("B1_N2_P8_R4: B=1") == 1 and proc.stdout.count("| shared |") == 1  # the table once
    assert "global tokens/s" in proc.stdout and "data-parallel over 2 processes" in proc.stdout
    data = json.loads(out.read_text())
    h = data["header"]
    assert h["world_size"] == 2 and h["backend"] == "gloo" and len(h["rank_devices"]) == 2
    assert "slowest" in h["world_note"]
    (case,) = data["cases"]
    assert case["world_size"] == 2
    for e in case["modes"].values():
        assert e["error"] is None and len(e["ranks"]) == 2
        (it,) = e["iterations"]
        totals = [rank_its[0]["total_ms"] for rank_its in e["ranks"]]
        assert it["total_ms"] == max(totals) and it["slowest_rank"] == totals.index(max(totals))
        assert [rank_its[0]["generated_tokens"] for rank_its in e["ranks"]] == [8, 8]
        assert it["generated_tokens"] == 16  # every process's tokens over the slowest one's time
        assert it["tokens_per_second"] == pytest.approx(16 / (it["total_ms"] / 1e3))
        assert e["peak_memory_bytes"] == max(e["rank_peak_memory_bytes"])


FAIL_ON_RANK_1 = (
    "import os, sys, torch\n"
    "from torchkvops.rollout import Rollout\n"
    "real = Rollout.generate_rows\n"
    "def generate(self, *args, **kwargs):\n"
    "    if os.environ['RANK'] == '1':\n"
    "        raise torch.OutOfMemoryError('simulated: out of memory on rank 1')\n"
    "    return real(self, *args, **kwargs)\n"
    "Rollout.generate_rows = generate\n"
    "from torchkvops.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_a_rank_that_fails_is_one_line_on_every_rank(tmp_path):
    out = tmp_path / "samples.jsonl"
    proc = torchrun(*ROLLOUT, "--output", str(out), program=["--no-python", sys.executable, "-c", FAIL_ON_RANK_1])
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("torchkvops: error:")]
    assert sorted(line.split("]")[0] for line in ours) == ["torchkvops: error: [rank 0", "torchkvops: error: [rank 1"]
    for line in ours:
        assert "rank 1 failed while generating: OutOfMemoryError: simulated: out of memory on rank 1" in line
    assert not out.exists()


def test_a_mode_that_fails_on_another_process_fails_on_this_one_too(monkeypatch):
    """bench's lockstep, in one process: a World whose status exchange reports that process 1 failed the
    first timed call of `shared`; this process must drop `shared` too (no more calls of it, so both
    take the same collective steps) and record process 1's error, while `prefix` goes on."""
    import torch

    from torchkvops.bench import cases as bench_cases
    from torchkvops.bench import matrix as bench
    from torchkvops.bench import world as bench_world
    from torchkvops.models import build_model

    calls = []
    case = bench_cases.Case(1, 2, 4, 3)

    class Runner:
        def __init__(self, mode):
            self.mode = mode

        def run(self):
            calls.append(self.mode)
            return torch.zeros(case.rows, case.response_length, dtype=torch.long)

        def profile(self, clock, end):
            p = dict.fromkeys(bench_cases.PROFILE_FIELDS)
            p.update(
                decode_ms=2.0,
                decode_steps=2,
                generated_tokens=6,
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

    class ElsewhereFails(bench_world.World):
        """Process 0 of 2; process 1's statuses are made up (records are this process's only)."""

        def __init__(self):
            super().__init__()
            self.size, self.steps = 2, []

        def failures(self, error):
            self.steps.append(error)
            mine = [] if error is None else [(0, error)]
            # steps: the case's prompts, 2 runners made, 1 warm-up each, then round 0: shared's timed call is 6th
            return mine + ([(1, "OutOfMemoryError: simulated")] if len(self.steps) == 6 else [])

    monkeypatch.setattr(bench, "make_runner", lambda mode, *args: Runner(mode))
    world = ElsewhereFails()
    settings = bench_cases.Settings(warmup=1, iterations=2)
    (result,) = bench.run_matrix(
        build_model("tiny"),
        [case],
        ["shared", "prefix"],
        settings,
        vocab_size=512,
        special_ids=[0, 1, 2],
        pad_token_id=0,
        progress=False,
        world=world,
    )
    assert calls == ["shared", "prefix", "shared", "prefix", "prefix", "prefix"]  # warm-ups, rounds, peak
    assert result["modes"]["shared"]["error"] == "rank 1: OutOfMemoryError: simulated"
    assert result["modes"]["prefix"]["error"] is None and len(result["modes"]["prefix"]["iterations"]) == 2
    assert len(world.steps) == 9 and not any(world.steps)  # 1 + 2 + 2 + round 0 (2) + round 1 (1) + peak (1)
