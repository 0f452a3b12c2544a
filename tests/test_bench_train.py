"""`torchkvops bench-train` (and benchmarks/bench_shared_forward.py, its thin entry point): one small case
end to end, the JSON it writes, and the argument checks. The measurement itself is
torchkvops/bench/train.py; the shared forward's correctness is tests/test_shared_forward.py's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timeouts import TIMEOUT

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, script: bool = False) -> subprocess.CompletedProcess:
    """The script, or `python -m torchkvops bench-train` (which parses its arguments before importing torch)."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )  # this checkout's torchkvops
    command = [str(ROOT / "benchmarks" / "bench_shared_forward.py")] if script else ["-m", "torchkvops", "bench-train"]
    return subprocess.run(
        [sys.executable, *command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )


def test_one_case_end_to_end(tmp_path):
    output = tmp_path / "train.json"
    proc = run(
        "--model-shape",
        "tiny",
        "--device",
        "cpu",
        "--prompt-lengths",
        "48",
        "--completion-lengths",
        "8",
        "--group-sizes",
        "4",
        "--warmup",
        "0",
        "--iterations",
        "1",
        "--threads",
        "1",
        "--output",
        str(output),
        script=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| 48 | 8 | 4 | 1 | 224/80 |" in proc.stdout  # tokens: 4 x (48 + 8) plain, 48 + 4 x 8 shared
    document = json.loads(output.read_text())
    assert document["header"]["model_shape"] == "tiny"
    (result,) = document["results"]
    assert result["plain_tokens"] == 224 and result["shared_tokens"] == 80
    assert result["grad_rel_diff"] < 1e-4 and result["loss_rel_diff"] < 1e-5
    assert result["shared_saved_mib"] < result["plain_saved_mib"]
    assert len(result["plain_ms_all"]) == len(result["shared_ms_all"]) == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["--group-sizes", "1"], "--group-sizes: must be >= 2, got 1"),
        (["--prompt-lengths", "0"], "--prompt-lengths: must be >= 1, got 0"),
        (["--model-shape", "opt-125m", "--prompt-lengths", "2048"], "more than the opt-125m shape's 2048 positions"),
        (["--output", "/proc/nope/x.json"], "--output"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, message):
    proc = run(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr


def test_the_command_line_knows_every_model_shape_and_its_positions():
    from torchkvops.cli.arguments import MODEL_POSITIONS
    from torchkvops.models import MODEL_SHAPES, model_config

    assert MODEL_POSITIONS == {name: model_config(name).max_position_embeddings for name in MODEL_SHAPES}


def test_the_seed_draws_the_weights():
    """--seed reaches the random weights (bench-train's help: "weights and token ids"), not only the ids."""
    import torch

    from torchkvops.bench.train import train_model

    weights = [next(train_model("tiny", torch.device("cpu"), seed=seed).parameters()) for seed in (0, 0, 1)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
