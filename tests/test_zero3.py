"""Generate on a DeepSpeed ZeRO-3 engine (CPU accelerator over gloo, 2 processes on 127.0.0.1, launched by
torchrun; tests/zero3_worker.py), every parameter partitioned: the call is served with HF's tokens on the
same engine, gathered once (one all-gather per parameter for the whole call, not one per parameter and
forward), the parameters partitioned again after it, and a training step after gathered calls gives the
loss and weights of the same step on an engine that made none; a budget the weights do not fit keeps the
per-step gathers with one warning; a LoRA model is gathered, then merged, and left bit-identical.
Skipped where deepspeed is not installed; every launch is bounded by a timeout."""

from pathlib import Path

import pytest
import test_fsdp
import torch

pytest.importorskip("deepspeed")

WORKER = str(Path(__file__).with_name("zero3_worker.py"))


SCENARIOS = [
    "gather",
    *(["lora"] if test_fsdp.installed("peft") else []),
    "eos_one_rank",
    *(["rollout_engine"] if test_fsdp.installed("deepspeed.runtime.rollout") else []),
]
records = test_fsdp.launched_once(WORKER, SCENARIOS)


def test_zero3_weights_are_gathered_once_per_call_with_hfs_tokens(records):
    for r in records("gather"):
        for mode in ("per_step", "once", "auto"):
            assert torch.equal(r[f"got_{mode}"], r["expected"]), (r["rank"], mode)
            assert r[f"status_after_{mode}"] == ["NOT_AVAILABLE"], mode  # partitioned again
        # One all-gather per parameter for the call; per step, one per parameter and forward (as HF's).
        assert r["gathers_once"] == r["parameters"] < r["gathers_per_step"] == r["gathers_hf"]
        assert r["gathers_auto"] == r["gathers_per_step"]  # a budget of 1 byte: per-step gathers ...
        assert len(r["warnings_auto"]) == 1 and "exceed gather_budget_bytes" in r["warnings_auto"][0]  # ... said once
        assert r["warnings_per_step"] == [] and r["warnings_once"] == []
        assert r["profile_once"]["gathered_bytes"] > 0 and r["profile_once"]["gather_ms"] > 0
        assert r["profile_per_step"]["gathered_bytes"] == 0 == r["profile_auto"]["gathered_bytes"]
        assert torch.equal(r["loss_after_calls"], r["loss_without_call"])
        for after, without in zip(r["weights_after_calls"], r["weights_without_call"]):
            assert torch.equal(after, without)


def test_a_zero3_lora_model_is_gathered_then_merged_and_left_bit_identical(records):
    pytest.importorskip("peft")
    for r in records("lora"):
        assert torch.equal(r["got"], r["expected"]), r["rank"]
        assert r["profile"]["gathered_bytes"] > 0 and r["profile"]["merged_lora_layers"] == r["lora_layers"] == 14
        assert r["changed"] == [] and r["status_after"] == ["NOT_AVAILABLE"]
        assert torch.equal(r["got_per_step"], r["expected"]) and r["changed_per_step"] == []
        assert r["profile_per_step"]["merged_lora_layers"] == 0 == r["profile_per_step"]["gathered_bytes"]


def test_zero3_synced_generation_with_eos_ids_on_one_rank_only_gives_hfs_tokens(records):
    """The all-ended check (a collective) runs on both ranks although only rank 0's call has EOS ids
    (a check on one rank only aborted gloo gathered once and hung per step); a 60 s process-group timeout
    turns a hang into a failure."""
    for r in records("eos_one_rank"):
        assert r["served"] == 2, r["rank"]
        for mode in ("per_step", "once"):
            assert torch.equal(r[f"got_{mode}"], r["expected"]), (r["rank"], mode)
        assert torch.isfinite(r["loss"])


def test_torchkvops_rollout_engine_equals_hybrid_engine_rollout_under_zero3_gathered_once(records):
    """torchkvops.deepspeed.TorchkvopsRollout on a ZeRO-3 engine, ranks with different prompts: run to the
    budget, the batch HybridEngineRollout gives (per-step gathers); with EOS honoured, its first columns
    and padding after; each call gathers every parameter once, and leaves them partitioned."""
    pytest.importorskip("deepspeed.runtime.rollout")
    for r in records("rollout_engine"):
        expected, got, eos = r["expected"], r["got"], r["got_eos"]
        for field in ("input_ids", "attention_mask", "response_start_idx"):
            assert torch.equal(got[field], expected[field]), (r["rank"], field)
        width = eos["input_ids"].shape[1]
        assert torch.equal(eos["input_ids"], expected["input_ids"][:, :width]), r["rank"]
        assert torch.equal(eos["attention_mask"], expected["attention_mask"][:, :width]), r["rank"]
        assert (expected["attention_mask"][:, width:] == 0).all()
        assert r["gathers_got"] == r["gathers_got_eos"] == r["parameters"] < r["gathers_expected"]
        assert r["status_after"] == ["NOT_AVAILABLE"]
