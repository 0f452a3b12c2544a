"""The decode buffer's width follows the longest row, not max_new_tokens: a call's buffer starts with room for
FIRST_DECODE_COLUMNS tokens a row and is widened (`RolloutKVCache.widen`, `DecodeBatch.widen`) before a
stretch of steps could pass its end, compacted or not. Oracles: the same rollout whose buffer holds the whole
budget from the start (never widened), and HF's generate; widening changes no token and no
log-probability, and a larger budget with the same tokens holds the same KV."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from devices import DEVICES
from families import tiny_model
from models import hf_greedy, prompts
from test_turns import EOS, run_turns

from torchkvops import Rollout, RolloutConfig
from torchkvops.rollout import layouts


@pytest.fixture(scope="module")
def llama():
    """A tiny llama whose positions cover the budgets below."""
    return tiny_model("llama", max_position_embeddings=8192)


@pytest.fixture
def first_columns(monkeypatch):
    """Set the decode buffer's first width (in tokens a row) for the test."""

    def set_first(tokens: int) -> None:
        monkeypatch.setattr(layouts, "FIRST_DECODE_COLUMNS", tokens)

    return set_first


def sampled(kv_sharing: str, max_new_tokens: int, eos=(41,)) -> RolloutConfig:
    return RolloutConfig(
        samples_per_prompt=3,
        max_new_tokens=max_new_tokens,
        kv_sharing=kv_sharing,
        temperature=1.0,
        seed=0,
        eos_token_id=list(eos),
        return_logprobs=True,
        enable_profiling=True,
    )


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_widening_changes_no_token_or_logprob(llama, kv_sharing, first_columns):
    """Sampled rows ending at spread steps (so compaction, and widening of a compacted batch): a buffer that
    starts with room for one token a row gives the tokens and log-probabilities of one allocated at the budget."""
    ids, mask = prompts(3, 9, seed=2, left_pad=[0, 2, 5])
    config = sampled(kv_sharing, 200)
    first_columns(10_000)
    expected = Rollout(llama, config).generate(ids, mask)
    first_columns(1)
    rollout = Rollout(llama, config)
    got = rollout.generate(ids, mask)
    assert torch.equal(got.responses, expected.responses)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=0, atol=0)
    longest = int(got.response_mask.sum(dim=1).max())
    assert longest > 64, "the case must outgrow the first width"
    assert rollout.decode_counters().compactions > 0
    # The buffer was widened from its first width (8 columns in the prefix layout's own buffer, 64 with the
    # prompt in the copy layout's) to hold the longest row.
    assert rollout.cache.decode_columns > (8 if kv_sharing == "prefix" else 64)


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_widened_greedy_decode_without_eos_ids_equals_hfs(llama, kv_sharing, first_columns):
    """Without EOS ids decode runs its steps in one stretch: the buffer is widened once before it."""
    first_columns(1)
    ids, mask = prompts(2, 7, seed=3, left_pad=[0, 3])
    config = RolloutConfig(
        samples_per_prompt=2, max_new_tokens=80, kv_sharing=kv_sharing, temperature=0.0, eos_token_id=[]
    )
    got = Rollout(llama, config).generate(ids, mask)
    expected = hf_greedy(llama, ids, mask, 80).repeat_interleave(2, dim=0)
    assert torch.equal(got.responses, expected)


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_turns_after_widened_decodes_equal_hf_on_the_full_history(llama, kv_sharing, first_columns):
    first_columns(1)
    ids, mask = prompts(2, 7, seed=4, left_pad=[0, 2])
    config = RolloutConfig(
        samples_per_prompt=2, max_new_tokens=70, kv_sharing=kv_sharing, temperature=0.0, eos_token_id=EOS
    )
    run_turns(llama, config, ids, mask, turns=2, appended_lengths=(1, 30))


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_a_sliding_window_model_widened_past_its_window_equals_hfs(kv_sharing, first_columns):
    model = tiny_model("gemma3_text")
    if model is None:
        pytest.skip("this transformers has no gemma3_text")
    first_columns(1)
    ids, mask = prompts(2, 9, seed=5, left_pad=[0, 4])
    config = RolloutConfig(
        samples_per_prompt=2, max_new_tokens=72, kv_sharing=kv_sharing, temperature=0.0, eos_token_id=[]
    )
    got = Rollout(model, config).generate(ids, mask)
    assert torch.equal(got.responses, hf_greedy(model, ids, mask, 72).repeat_interleave(2, dim=0))


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_a_larger_budget_with_the_same_tokens_holds_the_same_kv(llama, kv_sharing):
    """Responses that end long before the budget: the same tokens, and the same KV bytes, at budgets of 256
    and 4096 tokens (the buffer follows the longest row)."""
    ids, mask = prompts(3, 9, seed=2, left_pad=[0, 2, 5])
    outputs, profiles = [], []
    for budget in (256, 4096):
        rollout = Rollout(llama, sampled(kv_sharing, budget, eos=EOS))
        outputs.append(rollout.generate(ids, mask))
        profiles.append(rollout.get_last_profile())
    assert int(outputs[0].response_mask.sum(dim=1).max()) < 200, "the rows must end before the smaller budget"
    width = outputs[0].responses.shape[1]
    assert torch.equal(outputs[1].responses[:, :width], outputs[0].responses)
    assert bool((outputs[1].responses[:, width:] == outputs[1].responses[0, -1]).all())
    assert profiles[1].kv_cache_bytes == profiles[0].kv_cache_bytes


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_a_row_budgets_batch_widens_as_its_rows_grow(llama, kv_sharing, first_columns):
    """A row budget's batch (rows retired and refilled: streaming) widened from one token a row: the tokens and
    log-probabilities of the rollout without a budget, whose buffer holds the budget from the start."""
    ids, mask = prompts(3, 9, seed=2, left_pad=[0, 2, 5])
    first_columns(10_000)
    expected = Rollout(llama, sampled(kv_sharing, 150)).generate(ids, mask)
    first_columns(1)
    rollout = Rollout(llama, dataclasses.replace(sampled(kv_sharing, 150), max_rows=3))
    got = rollout.generate(ids, mask)
    assert rollout.get_last_profile().refills > 0
    assert int(got.response_mask.sum(dim=1).max()) > 64, "the case must outgrow the first width"
    assert torch.equal(got.responses, expected.responses)
    # (float rounding: a row budget's batch runs the model over other row counts)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_a_row_budget_with_a_larger_budget_and_the_same_tokens_holds_the_same_kv(llama, kv_sharing):
    ids, mask = prompts(3, 9, seed=2, left_pad=[0, 2, 5])
    outputs, profiles = [], []
    for budget in (256, 4096):
        rollout = Rollout(llama, dataclasses.replace(sampled(kv_sharing, budget, eos=EOS), max_rows=3))
        outputs.append(rollout.generate(ids, mask))
        profiles.append(rollout.get_last_profile())
    width = outputs[0].responses.shape[1]
    assert torch.equal(outputs[1].responses[:, :width], outputs[0].responses)
    assert profiles[1].kv_cache_bytes == profiles[0].kv_cache_bytes


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
@pytest.mark.parametrize("device", DEVICES)
def test_widened_decode_replayed_from_cuda_graphs_gives_the_eager_tokens(llama, kv_sharing, device, first_columns):
    """On CUDA each width is a decode shape of its own (a graph captured per width, keyed by the new buffers'
    addresses); the steps replayed from graphs give the eager steps' tokens. On the CPU: eager both times."""
    first_columns(1)
    model = llama.to(device)
    try:
        ids, mask = (t.to(device) for t in prompts(3, 9, seed=2, left_pad=[0, 2, 5]))
        config = sampled(kv_sharing, 150)
        eager = Rollout(model, dataclasses.replace(config, cuda_graphs=False)).generate(ids, mask)
        rollout = Rollout(model, config)
        graphed = rollout.generate(ids, mask)
        assert torch.equal(graphed.responses, eager.responses)
        if device == "cuda":
            assert rollout.decode_counters().captured_graphs > 1
    finally:
        llama.to("cpu")


def test_the_profile_tells_the_kv_a_call_used_from_what_the_cache_holds(llama):
    """After a call of long prompts, a call of short ones uses less KV than the cache keeps."""
    rollout = Rollout(llama, sampled("copy", 100, eos=EOS))
    rollout.generate(*prompts(3, 120, seed=2))
    long = rollout.get_last_profile()
    assert long.kv_allocated_bytes >= long.kv_cache_bytes > 0
    rollout.generate(*prompts(3, 9, seed=2))
    short = rollout.get_last_profile()
    assert short.kv_cache_bytes < long.kv_cache_bytes
    assert short.kv_allocated_bytes == long.kv_allocated_bytes > short.kv_cache_bytes
