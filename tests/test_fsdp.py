"""Generate on an FSDP2-sharded model (fully_shard on CPU with gloo, 2 processes on 127.0.0.1, launched by
torchrun; tests/fsdp_worker.py): with synced_gpus (HF's resolution for an FSDP-managed model) the call is
served on every rank, each rank's tokens equal HF's generate on the same wrapper although the ranks' rows
end at different steps, and a call one rank cannot serve falls back on every rank; with synced_gpus=False
a served call leaves the model trainable (it ran under inference mode, and FSDP's unsharded parameters
broke the next training step), and the next call follows the trained weights. Every launch is bounded by
a timeout."""

import subprocess
from pathlib import Path

import pytest
import torch
from test_distributed import env, free_port, torchrun
from timeouts import TIMEOUT

ROOT = Path(__file__).absolute().parents[1]
WORKER = str(Path(__file__).with_name("fsdp_worker.py"))

pytest.importorskip("torch.distributed.fsdp")


def run_scenario(scenario: str, out: Path) -> list[dict]:
    cmd = torchrun(
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        WORKER,
        scenario,
        str(out),
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_synced_generation_is_served_on_every_rank_with_hfs_tokens(tmp_path):
    ranks = run_scenario("synced", tmp_path)
    for r in ranks:
        assert r["served"] == 1, r["rank"]
        assert torch.equal(r["got"], r["expected"]), r["rank"]
        # One rank cannot serve the second call: every rank fell back to HF's generate, with its output.
        assert r["served_after_fallback"] == 1 and torch.equal(r["fallback_got"], r["fallback_expected"])
    # The ranks' rows ended at different steps (HF trims each rank's output where its own rows ended), so
    # the rank that ended first decoded filler steps until the other was done.
    assert ranks[0]["got"].shape[1] - 6 != ranks[1]["got"].shape[1] - 9


def test_a_served_call_leaves_the_sharded_model_trainable(tmp_path):
    for r in run_scenario("train", tmp_path):
        assert r["served"] == 2 and torch.isfinite(r["loss"])
        assert torch.equal(r["got"], r["expected"])
        assert not torch.equal(r["expected_after_step"], r["expected"])  # the step changed the tokens ...
        assert torch.equal(r["got_after_step"], r["expected_after_step"])  # ... and the rollout follows
