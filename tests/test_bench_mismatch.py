"""`torchkvops bench --mismatch` (issue #18): each engine's log-probabilities against a trainer's forward
over the same sequences."""

from __future__ import annotations

import json

import torch
from models import FAMILIES

from torchkvops.bench import cases as bench_cases
from torchkvops.bench import mismatch
from torchkvops.cli import main as cli


def test_bench_mismatch_float32_is_within_1e_4_for_every_engine(tmp_path, capsys):
    """float32 on the CPU (the issue's goal): both layouts and HF generate, on its own samples
    and forced to the rollout's tokens, within 1e-4 of the trainer on every token; the table is printed
    and the JSON holds the numbers."""
    out = tmp_path / "bench.json"
    rc = cli.main(
        [
            "bench",
            "--model-shape",
            "tiny",
            "--device",
            "cpu",
            "--warmup",
            "0",
            "--iterations",
            "1",
            "--no-progress",
            "--batch-sizes",
            "1",
            "--samples-per-prompt",
            "2",
            "--prompt-lengths",
            "8",
            "--response-lengths",
            "6",
            "--modes",
            "expanded",
            "prefix",
            "hf-generate",
            "--mismatch",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert "trainer" in data["header"]["mismatch_note"]
    (case,) = data["cases"]
    engines = case["mismatch"]
    assert set(engines) == {"expanded", "prefix", "hf-generate", "hf-generate on expanded tokens"}
    for name, e in engines.items():
        assert e["tokens"] == 2 * 6, name
        assert 0 <= e["mean_abs_delta"] <= e["max_abs_delta"] <= 1e-4, (name, e)
        assert e["k3_kl"] >= 0, (name, e)
        assert f"| {name} | 12 |" in printed
    assert "| engine | tokens | mean abs delta | max abs delta | k3 KL |" in printed


def test_mismatch_engines_of_a_bf16_model_include_the_float32_head():
    """On a half-precision model each rollout mode is also measured with lm_head_dtype=float32 (against a
    float32-head trainer); a wrong sequence would show: the statistics compare against the trainer's
    forward over exactly the sequences each engine generated."""
    model = FAMILIES["llama"]().to(torch.bfloat16)
    case = bench_cases.Case(batch_size=1, samples_per_prompt=2, prompt_length=8, response_length=5)
    settings = bench_cases.Settings(temperature=1.0, seed=3)
    prompts = bench_cases.synthetic_prompts(case, 96, [0, 1, 2], 0, torch.device("cpu"))
    engines = mismatch.measure_mismatch(model, case, ["shared", "prefix", "hf-generate"], settings, prompts, 0)
    assert set(engines) == {
        "shared",
        "shared + fp32 head",
        "prefix",
        "prefix + fp32 head",
        "hf-generate",
        "hf-generate on shared tokens",
    }
    for name, e in engines.items():
        assert "error" not in e, (name, e)
        assert e["tokens"] == 10 and e["max_abs_delta"] < 0.1, (name, e)
    assert "forward" not in vars(model.lm_head)  # the float32 head is only on during the measurement


def test_mismatch_stats():
    engine = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    trainer = torch.tensor([[-1.1, -2.0], [-0.5, -2.5]])
    s = mismatch.mismatch_stats(engine, trainer)
    delta = torch.tensor([0.1, 0.0, 0.0, -0.5], dtype=torch.float64)
    assert s["tokens"] == 4
    assert abs(s["mean_abs_delta"] - 0.15) < 1e-6 and abs(s["max_abs_delta"] - 0.5) < 1e-6
    # k3 = mean(r - 1 - log r), r = p_trainer / p_engine = exp(-delta)
    r = torch.exp(-delta)
    assert abs(s["k3_kl"] - float((r - 1 - torch.log(r)).mean())) < 1e-6


def test_mismatch_of_a_nocompact_mode_is_measured_on_its_layout():
    """`prefix-nocompact` is the prefix layout with compaction off: with --mismatch (no EOS, so nothing to
    compact) its log-probabilities are the prefix layout's to the bit, not the copy layout's (which
    differ from them in bf16: prompts of 40 tokens, whose 2 whole blocks the prefix layout reads stacked)."""
    model = FAMILIES["llama"]().to(torch.bfloat16)
    case = bench_cases.Case(batch_size=2, samples_per_prompt=2, prompt_length=40, response_length=6)
    settings = bench_cases.Settings(temperature=1.0, seed=3)
    prompts = bench_cases.synthetic_prompts(case, 96, [0, 1, 2], 0, torch.device("cpu"))
    engines = mismatch.measure_mismatch(model, case, ["shared", "prefix", "prefix-nocompact"], settings, prompts, 0)
    assert engines["prefix-nocompact"] == engines["prefix"]
    assert engines["prefix"] != engines["shared"]
