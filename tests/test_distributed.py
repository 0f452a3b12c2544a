"""Data-parallel rollouts on torch.distributed (gloo, 2 processes on 127.0.0.1, launched by torchrun):
the gathered output equals a single-process rollout over all prompts, failures raise everywhere, and
a two-"node" run through a c10d rendezvous. Every launch is bounded by a timeout."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_worker import CASES, CONFIGS, shard
from models import FAMILIES
from timeouts import TIMEOUT

from torchkvops import Rollout, RolloutConfig

ROOT = Path(__file__).absolute().parents[1]
WORKER = str(Path(__file__).with_name("dist_worker.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # The worker script's folder, not ROOT, starts its sys.path: import this tree's torchkvops, not an
    # installed copy from elsewhere (a git worktree beside an editable install of another).
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    e.update(extra)
    return e


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def launch(scenarios: str, out: Path, timeout: float = TIMEOUT, **extra_env) -> None:
    """`scenarios` (comma-separated) in one launch of the worker on 2 processes."""
    cmd = torchrun(
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        WORKER,
        scenarios,
        str(out),
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env(**extra_env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


def load(out: Path, rank: int, scenario: str) -> dict:
    return torch.load(out / f"rank{rank}_{scenario}.pt", weights_only=False)


def single_process(case: str, cfg: dict):
    """The reference: one Rollout over every rank's prompts, left-padded to the longest, in rank order,
    decoding every row to the end (no compaction)."""
    model = FAMILIES["llama"]()
    rollout = Rollout(model, RolloutConfig(**{**cfg, "compact_finished_rows": False}))
    shards = [shard(case, r) for r in range(len(CASES[case]))]
    shards = [s for s in shards if s[0] is not None]
    width = max(ids.shape[1] for ids, _ in shards)
    pad = rollout.pad_id
    ids = torch.cat([torch.nn.functional.pad(i, (width - i.shape[1], 0), value=pad) for i, _ in shards])
    mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0), value=0) for _, m in shards])
    return rollout.generate(ids, mask)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The scenarios that leave the group working, in one launch (each process imports torch once); a
    group timeout the "failure" scenario must not wait for."""
    out = tmp_path_factory.mktemp("ranks")
    launch("equivalence,failure,mismatch", out, DIST_TIMEOUT_S="900")
    return out


@pytest.fixture(scope="module")
def equivalence(launched):
    return [load(launched, r, "equivalence") for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_gathered_output_equals_a_single_process_rollout(equivalence, case, config):
    expected = single_process(case, CONFIGS[config])
    n = CONFIGS[config]["samples_per_prompt"]
    for rank in range(2):
        got = equivalence[rank][f"{case}/{config}/gathered"]
        assert got.prompt_length == expected.prompt_length
        r = expected.responses.shape[1]
        # Responses may be right-padded further on a process whose rows ran longer; compare the common part.
        assert torch.equal(got.sequences[:, : got.prompt_length + r], expected.sequences), (rank, case, config)
        assert torch.equal(got.response_mask[:, :r], expected.response_mask)
        assert not got.response_mask[:, r:].any()
        if expected.logprobs is not None:  # gathered too (issue #18); rows batched differently: rounding
            torch.testing.assert_close(got.logprobs[:, :r], expected.logprobs, rtol=1e-4, atol=1e-4)
            assert not got.logprobs[:, r:].any()
    # gather=False: each rank's own rows, in order.
    first = 0
    for rank in range(2):
        local = equivalence[rank][f"{case}/{config}/local"]
        rows = CASES[case][rank][0] * n
        assert local.responses.shape[0] == rows
        r = local.responses.shape[1]
        assert torch.equal(local.responses, expected.responses[first : first + rows, :r])
        first += rows
        profile = equivalence[rank].get(f"{case}/{config}/profile")
        if profile is not None and rows > 2:  # each shard compacted its own batch as its rows ended
            assert profile.useful_row_steps < profile.computed_row_steps < rows * r, (rank, case, profile)


def test_a_rank_that_raises_makes_every_rank_raise(launched):
    for rank in range(2):
        result = load(launched, rank, "failure")
        assert result["error"] is not None and "rank 1 failed while generating" in result["error"]
        assert "input_ids must be token ids" in result["error"]
        assert result["seconds"] < 900  # raised before the group's timeout: no waiting for it
        assert result["after"].sequences.shape[0] == 3  # and the group still works


def test_ranks_with_different_settings_raise_the_same_error_before_generating(launched):
    results = [load(launched, r, "mismatch") for r in range(2)]
    expected = {
        "samples_per_prompt": "samples_per_prompt: 2 on rank 0; 3 on rank 1",
        "temperature": "temperature: 1.0 on rank 0; 0.7 on rank 1",
        "gather": "gather: True on rank 0; False on rank 1",
        "return_logprobs": "return_logprobs: True on rank 0; False on rank 1",
        "lm_head_dtype": "lm_head_dtype: 'torch.float32' on rank 0; None on rank 1",
    }
    for name, needle in expected.items():
        error = results[0]["errors"][name]
        assert error == results[1]["errors"][name], name  # the same error on every rank
        assert error.startswith("ValueError: torchkvops.distributed.generate: the processes' settings differ")
        assert needle in error
        assert [field for field in expected if f"{field}: " in error] == [name]  # only the field that differs
    for result in results:
        assert result["generated"] == 0  # refused before any rank generated
        assert result["after"].sequences.shape[0] == 3  # and the group still works


def test_a_rank_that_never_calls_gives_an_error_not_a_hang(tmp_path):
    launch("absent", tmp_path, DIST_TIMEOUT_S="8")  # a hang instead would end at launch's TIMEOUT, failing
    result = load(tmp_path, 0, "absent")
    assert result["error"] is not None


def test_two_nodes_through_a_c10d_rendezvous(tmp_path, equivalence):
    """Two torchrun agents (two "nodes" on 127.0.0.1), one process each, meeting at a c10d rendezvous."""
    port = free_port()
    cmd = torchrun(
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "torchkvops-test",
        WORKER,
        "equivalence",
        str(tmp_path),
    )
    agents = [
        subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        outputs = [a.communicate(timeout=TIMEOUT) for a in agents]
    finally:
        for a in agents:
            a.kill()
    for a, (_, err) in zip(agents, outputs):
        assert a.returncode == 0, err[-3000:]
    results = [load(tmp_path, r, "equivalence") for r in range(2)]
    assert [r["world"] for r in results] == [2, 2]
    for key in ("uneven/sampled/gathered", "rank1-empty/greedy/gathered"):
        assert torch.equal(results[0][key].sequences, equivalence[0][key].sequences)
