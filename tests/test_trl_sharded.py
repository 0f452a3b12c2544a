"""TRL's GRPOTrainer on 2 processes under DeepSpeed ZeRO-3 with LoRA (TRL's peft_config) and
ds3_gather_for_generation=False, with both patches (examples/grpo_trl_sharded.py, which runs the whole
matrix): every generate call is served, with the weights gathered by torchkvops once per call and the
LoRA merged; every training pass is shared; and the weights after two steps equal those of the same
run with TRL's own training passes and per-step gathers (the same sampled completions). Skipped where
trl, peft or deepspeed is not installed; every launch is bounded by a timeout."""

import importlib.util
from pathlib import Path

import pytest
from timeouts import TIMEOUT

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("deepspeed")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_trl_sharded.py"


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_trl_sharded", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_under_zero3_with_lora_gathers_once_merges_and_trains_like_the_reference(tmp_path):
    example = load_example()
    for r in example.run_config("zero3-nogather-lora", str(tmp_path), timeout=TIMEOUT):
        assert len(r["calls"]) == example.STEPS and r["fallbacks"] == 0, r["rank"]
        for gathered_bytes, merged_layers in r["calls"]:  # served, gathered by torchkvops, LoRA merged
            assert gathered_bytes > 0 and merged_layers == r["lora_layers"] > 0
        assert all(call == [0, 0] for call in r["reference_calls"])  # the reference: per-step, unmerged
        assert r["forward"] == [example.STEPS, 0]  # the loss pass of each step: shared, never plain
        assert all("lora_" in n for n in r["trainable"])
        assert r["update"] > 1e-4 and r["weight_difference"] < 1e-3 * r["update"]
