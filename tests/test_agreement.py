"""What every process must agree on before a collective (tests/agreement_worker.py, 2 gloo processes on
127.0.0.1 launched by torchrun, a process-group timeout of DIST_TIMEOUT_S so that a collective joined by
one process alone fails the scenario instead of hanging it): a call served on one rank and not on
another, EOS ids on one rank only, a model with several FSDP roots, FSDP's hooks inside decode steps and
the dtype of a mixed-precision model's KV cache, and every combination the integration can produce.
HF's generate on the same wrapper is the oracle; each scenario ends with a training step, which fails
if a call left the process group broken."""

from pathlib import Path

import pytest
import torch
from devices import requires_gpu
from test_fsdp import launched_once, run_scenario

pytest.importorskip("torch.distributed.fsdp")

WORKER = str(Path(__file__).with_name("agreement_worker.py"))
# Long enough for a loaded 2-core machine's legitimate waits, short enough to end a hang soon.
DIST_TIMEOUT_S = "60"


SCENARIOS = ["unsynced_mixed", "eos_one_rank", "common_prefix_one_rank", "multi_root", "hooks", "combinations"]
records = launched_once(WORKER, SCENARIOS, DIST_TIMEOUT_S=DIST_TIMEOUT_S)


def test_a_call_served_on_one_rank_and_refused_on_the_other_falls_back_on_both(records):
    """Unsynced generation on a sharded model (decoder layers sharded: HF resolves synced_gpus=False; or
    the root sharded with synced_gpus=False), rank 1's call refused: every rank runs HF's generate (the
    served rank would otherwise wait in the gather's collectives while the other runs HF's forwards),
    both return HF's tokens, and the training step after works."""
    for r in records("unsynced_mixed"):
        for sharding in ("layers", "root"):
            assert torch.equal(r[f"got_{sharding}"], r[f"expected_{sharding}"]), (r["rank"], sharding)
            assert r[f"served_{sharding}"] == 0, (r["rank"], sharding)
            assert torch.isfinite(r[f"loss_{sharding}"])


def test_synced_generation_with_eos_ids_on_one_rank_only_gives_hfs_tokens(records):
    """The all-ended check (a collective) runs on every rank, whether or not its call has EOS ids: served
    on both ranks, gathered once and per step, with HF's tokens."""
    for r in records("eos_one_rank"):
        for mode in ("per_step", "once"):
            assert r[f"served_{mode}"] == 1, (r["rank"], mode)
            assert torch.equal(r[f"got_{mode}"], r["expected"]), (r["rank"], mode)
        assert torch.isfinite(r["loss"])


def test_a_common_prefix_on_one_rank_keeps_the_ranks_in_step(records):
    """Synced generation where only rank 0's prompts begin with a common prefix: a rollout in lockstep
    prefills as every rank does (a common prefix computed once is one more forward, and per step every
    forward is FSDP's gathers), so both ranks are served with HF's tokens, gathered per step and once."""
    for r in records("common_prefix_one_rank"):
        for mode in ("per_step", "once"):
            assert r[f"served_{mode}"] == 1, (r["rank"], mode)
            assert torch.equal(r[f"got_{mode}"], r["expected"]), (r["rank"], mode)
        assert torch.isfinite(r["loss"])


def test_a_model_with_several_fsdp_roots_is_gathered_and_served_from_its_first_call(records):
    for r in records("multi_root"):
        assert r["warnings"] == [], r["warnings"]
        assert r["served"] == 1 and r["served_again"] == 1
        assert r["profile"]["gathered_bytes"] > 0
        assert torch.equal(r["got"], r["expected"]) and torch.equal(r["got_again"], r["expected"])
        assert torch.isfinite(r["loss"])


def test_no_fsdp_hook_runs_inside_a_gathered_decode_step_and_mixed_precision_caches_in_its_dtype(records):
    """FSDP2 with param_dtype=bf16. Gathered once, none of FSDP's forward hooks runs during the call (on
    CUDA they would make FSDP's all-gather streams wait on the capturing stream, forking them into the
    CUDA graph); per step they do (so the count sees them). The tokens are HF's either way (its casts are
    applied without its hooks), the KV cache is bf16 (the dtype of the gathered weights, also for a Rollout
    built while the weights are sharded fp32), and the hooks are back for the training step after."""
    for r in records("hooks"):
        assert r["served_once"] == 1 == r["served_per_step"]
        assert r["hooks_once"] == 0 and r["hooks_in_steps_once"] == 0
        assert r["hooks_in_steps_per_step"] > 0
        assert r["profile_once"]["gathered_bytes"] > 0 == r["profile_per_step"]["gathered_bytes"]
        for mode in ("once", "per_step"):
            assert torch.equal(r[f"got_{mode}"], r["expected"]), (r["rank"], mode)
            assert r[f"adapter_dtype_{mode}"] == torch.bfloat16 and r[f"kv_dtypes_{mode}"] == ["torch.bfloat16"]
        assert r["rollout_dtype"] == torch.bfloat16 and r["distributed_kv_dtype"] == "torch.bfloat16"
        assert torch.equal(r["distributed_got"], r["expected"][:, -10:])
        assert r["hooks_training"] > 0 and torch.isfinite(r["loss"])


def test_every_combination_of_served_synced_eos_and_gather_mode_returns_hfs_tokens(records):
    """served/fallback on each rank x synced/unsynced x EOS ids on each rank x gather_weights: every call
    returns (within the process-group timeout: no collective waited for alone), with HF's tokens, served on
    both ranks exactly when both can serve it, and the training step after each works."""
    ranks = records("combinations")
    for r in ranks:
        assert r["error"] is None, r["error"]
        assert len(r["records"]) == 4 * 2 * 4 * 3
        for record in r["records"]:
            assert record["equal"], record
            assert record["rollouts"] == int(all(record["served"])), record
            assert record["seconds"] < r["timeout"] and record["loss"] == record["loss"], record


@pytest.mark.cuda
@requires_gpu
def test_fsdp2_on_nccl_gathered_once_decodes_from_cuda_graphs(tmp_path):
    """One process, NCCL, FSDP2 on the GPU (float32, and bf16 mixed precision): a call gathered once
    captures its decode steps in CUDA graphs with FSDP's hooks off (their stream waits inside a capture
    would fork FSDP's streams into it: cudaErrorStreamCaptureUnjoined, then eager decode for good), the
    next call replays them; the tokens are HF's (float32) and the same call's eager ones (both); a
    training step and HF's generate on FSDP's own streams work after, and so do calls after them."""
    (r,) = run_scenario("nccl_graphs", tmp_path, WORKER, nproc=1, BACKEND="nccl", DIST_TIMEOUT_S=DIST_TIMEOUT_S)
    for precision in ("fp32", "bf16"):
        assert torch.isfinite(r[f"loss_{precision}"])
        for when in ("first", "after"):
            tag = f"{precision}_{when}"
            assert r[f"warnings_{tag}"] == [], r[f"warnings_{tag}"]
            assert r[f"captured_graphs_{tag}"] >= 1 and r[f"captured_graphs_{tag}_eager"] == 0, tag
            assert r[f"hooks_{tag}"] == 0 and r[f"profile_{tag}"]["gathered_bytes"] > 0, tag
            eager = r[f"got_{tag}_eager"]
            assert torch.equal(r[f"got_{tag}"], eager) and torch.equal(r[f"got_again_{tag}"], eager), tag
            if precision == "fp32":
                assert torch.equal(eager, r[f"expected_{tag}"]), tag
