"""RolloutConfig.max_rows (torchkvops.rollout.streaming): rollouts larger than the row budget, decoded
max_rows // N prompts at a time with the rows of finished prompts refilled. The oracle is the same
rollout without a budget: the same tokens, log-probabilities equal to float rounding, the same shapes."""

import conftest
import pytest
import torch
from devices import DEVICES
from models import FAMILIES, prompts

from torchkvops import Rollout, RolloutConfig

MANY_EOS = list(range(40, 56))  # rows of the random models end at every step, most within a few dozen


def budgeted_and_not(model, ids, mask, max_rows, **config):
    outputs, profiles = [], []
    for budget in (None, max_rows):
        rollout = Rollout(model, RolloutConfig(max_rows=budget, enable_profiling=True, **config))
        outputs.append(rollout.generate(ids, mask))
        profiles.append(rollout.get_last_profile())
    return outputs, profiles


def assert_same(budgeted, unbudgeted):
    assert budgeted.responses.shape == unbudgeted.responses.shape
    assert torch.equal(budgeted.responses, unbudgeted.responses)
    assert torch.equal(budgeted.sequences, unbudgeted.sequences)
    assert torch.equal(budgeted.response_mask, unbudgeted.response_mask)
    if unbudgeted.logprobs is not None:
        torch.testing.assert_close(budgeted.logprobs, unbudgeted.logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", ["copy", "prefix", "paged"])
def test_tokens_equal_the_unbudgeted_rollout_for_every_budget(family_models, family, layout):
    """Budgets from one prompt's group to all rows; prompts of different lengths (left padding) admitted
    into rows other prompts freed; rows ending at every step, sampling with log-probabilities."""
    model = family_models[family]
    ids, mask = prompts(5, 7, seed=1, left_pad=[0, 2, 3, 0, 1])
    config = dict(
        samples_per_prompt=3,
        max_new_tokens=30,
        kv_sharing=layout,
        eos_token_id=MANY_EOS,
        temperature=1.0,
        seed=11,
        return_logprobs=True,
    )
    for max_rows in (3, 5, 7, 12, 14, 15):
        (unbudgeted, budgeted), (_, profile) = budgeted_and_not(model, ids, mask, max_rows, **config)
        assert_same(budgeted, unbudgeted)
        groups = max_rows // 3
        assert profile.refills == max(0, 5 - groups), max_rows  # every prompt admitted after the first groups


@pytest.mark.parametrize("layout", ["copy", "prefix", "paged"])
def test_greedy_and_lengths_shorter_than_max_new_tokens(llama, layout):
    """Greedy, every row ending early: the output is as long as the unbudgeted rollout's (which stops at
    its first all-ended check after the longest response), not max_new_tokens."""
    ids, mask = prompts(4, 6, seed=2, left_pad=[1, 0, 2, 0])
    config = dict(samples_per_prompt=2, max_new_tokens=48, kv_sharing=layout, eos_token_id=MANY_EOS + [0, 1, 2])
    (unbudgeted, budgeted), _ = budgeted_and_not(llama, ids, mask, 2, **config)
    assert unbudgeted.responses.shape[1] < 48
    assert_same(budgeted, unbudgeted)


def test_no_eos_and_min_new_tokens(llama):
    ids, mask = prompts(3, 5, seed=4)
    for config in (dict(eos_token_id=[]), dict(eos_token_id=MANY_EOS, min_new_tokens=6)):
        (unbudgeted, budgeted), _ = budgeted_and_not(
            llama, ids, mask, 2, samples_per_prompt=2, max_new_tokens=12, temperature=0.9, seed=3, **config
        )
        assert_same(budgeted, unbudgeted)


def test_kv_buffers_follow_the_budget(llama):
    """The KV held follows max_rows rows (and the scratch cache one prompt per row group), not B x N: each
    row holds its prompt's 16 tokens (one whole block, shared by reference; the expanded baseline's own
    copy) and at most 16 of its own (one block)."""
    ids, mask = prompts(8, 16, seed=5)
    config = dict(samples_per_prompt=4, max_new_tokens=16, eos_token_id=MANY_EOS, temperature=1.0, seed=1)
    (unbudgeted, budgeted), (full, streamed) = budgeted_and_not(llama, ids, mask, 8, **config)
    assert_same(budgeted, unbudgeted)
    expanded = dict(config, shared_prefill=False)
    (_, expanded_budgeted), (expanded_full, expanded_streamed) = budgeted_and_not(llama, ids, mask, 8, **expanded)
    assert_same(expanded_budgeted, unbudgeted)
    shape = Rollout(llama, RolloutConfig(**expanded)).cache.groups[0].shape
    per_position = shape.layers * 2 * shape.kv_heads * shape.head_dim * 4  # float32
    # The expanded baseline: 8 rows of their prompt's block and at most one more, at most 8 prompts' blocks
    # waiting, the scratch cache of 2 prompts of 16; at least each row's prompt block and the scratch.
    assert per_position * (8 * 16 + 2 * 16) <= expanded_streamed.kv_cache_bytes
    assert expanded_streamed.kv_cache_bytes <= per_position * (8 * 2 * 16 + 8 * 16 + 2 * 16)
    assert expanded_streamed.kv_cache_bytes < 0.3 * expanded_full.kv_cache_bytes
    # The pool: 8 rows of at most 2 blocks, 8 prompts' blocks at most (a prompt's block is held while its
    # samples run), the scratch of 2 prompts; without a budget its 32 rows' blocks.
    assert streamed.kv_cache_bytes <= per_position * (8 * 2 * 16 + 8 * 16 + 2 * 16) < full.kv_cache_bytes
    assert streamed.refills == 8 - 2


def test_compiled_streaming_equals_eager(llama):
    ids, mask = prompts(3, 6, seed=6, left_pad=[0, 2, 1])
    config = dict(samples_per_prompt=2, max_new_tokens=20, eos_token_id=MANY_EOS, temperature=1.0, seed=2, max_rows=2)
    eager = Rollout(llama, RolloutConfig(**config)).generate(ids, mask)
    rollout = Rollout(llama, RolloutConfig(compile=True, **config))
    compiled = rollout.generate(ids, mask)
    assert conftest.compiled(rollout)  # (else eager is compared with eager)
    assert torch.equal(eager.responses, compiled.responses)


@pytest.mark.parametrize("device", DEVICES)
def test_streaming_on_each_device(device):
    """On CUDA the one streaming batch is replayed from one CUDA graph across refills."""
    model = FAMILIES["llama"]().to(device)
    ids, mask = prompts(4, 6, seed=7, left_pad=[0, 1, 2, 3])
    config = dict(samples_per_prompt=2, max_new_tokens=24, eos_token_id=MANY_EOS, temperature=1.0, seed=9)
    unbudgeted = Rollout(model, RolloutConfig(**config)).generate(ids.to(device), mask.to(device))
    rollout = Rollout(model, RolloutConfig(max_rows=4, **config))
    assert_same(rollout.generate(ids.to(device), mask.to(device)), unbudgeted)
    if device == "cuda":
        assert rollout.decode_counters().captured_graphs == 1


def test_a_budget_smaller_than_one_group_is_refused():
    with pytest.raises(ValueError, match=r"max_rows must hold at least one prompt's samples_per_prompt=4 rows"):
        RolloutConfig(samples_per_prompt=4, max_rows=3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="RolloutConfig.max_rows must be None"):
            RolloutConfig(max_rows=bad)


def test_a_streamed_call_keeps_no_kv_for_extend(llama):
    ids, mask = prompts(3, 5)
    rollout = Rollout(llama, RolloutConfig(samples_per_prompt=2, max_new_tokens=4, max_rows=2, eos_token_id=[]))
    out = rollout.generate(ids, mask)
    with pytest.raises(ValueError, match=r"streamed its rows \(RolloutConfig.max_rows\), which keeps no KV"):
        rollout.extend(out, [[5]] * 6)


def test_generate_streams_groups_of_different_sizes_and_equals_hf(llama):
    """torchkvops.generate(max_rows=...): prompts with 4 (3 adjacent, 1 after the others), 1 and 2 identical
    rows (padded to groups of 4 with filler rows), 8 rows at a time; greedy tokens equal HF's generate."""
    import torchkvops

    ids, mask = prompts(3, 9, seed=1, left_pad=[0, 3, 5])
    order = [0, 0, 0, 1, 2, 2, 0]
    ids, mask = ids[order], mask[order]
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=MANY_EOS, pad_token_id=0)
    out = torchkvops.generate(llama, ids, attention_mask=mask, max_rows=8, **kwargs)
    with torch.no_grad():
        expected = llama.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"max_rows=2 is smaller than this call's largest group .*\(4 rows"):
        torchkvops.generate(llama, ids, attention_mask=mask, max_rows=2, **kwargs)


def test_patch_generate_serves_a_batch_larger_than_its_budget(llama):
    import torchkvops

    ids, mask = prompts(4, 6, seed=3, left_pad=[0, 1, 2, 0])
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)  # TRL: each prompt 4 times
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0, eos_token_id=MANY_EOS, pad_token_id=0)
    results = []
    for budget in (None, 8):
        handle = torchkvops.patch_generate(llama, max_rows=budget)
        torch.manual_seed(0)  # the call's sampling seed comes from torch's generator
        results.append(llama.generate(ids, attention_mask=mask, **kwargs))
        profile = handle.last_profile()
        handle.undo()
        assert profile.refills == (2 if budget else 0)
    assert torch.equal(results[0], results[1])
