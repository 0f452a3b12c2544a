"""A prefix every prompt of a call begins with (a system prompt), computed once (torchkvops.rollout.prompts):
found on the prompts' real tokens wherever left padding puts them; Hugging Face's greedy generate on the
same prompts is the oracle, in both layouts and every family, with compaction, turns, a row budget, the
emulated CUDA attention and patch_generate; seeded samples and log-probabilities equal the rollout's
without the common prefix; what prefill computes and what the prefix layout keeps are counted."""

import pytest
import torch
from models import FAMILIES, VOCAB, hf_greedy, prompts

import torchkvops
from torchkvops import Rollout, RolloutConfig
from torchkvops.rollout.prompts import common_prefix_length

NO_EOS = []
SYSTEM = 12  # tokens of the common prefix in these tests


def system_prompts(batch: int, questions: list[int], seed: int = 0, system: int = SYSTEM):
    """`batch` left-padded prompts: one system prompt of `system` tokens, then a question of questions[b]
    tokens each (different questions, so that nothing else is common)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, VOCAB, (system,), generator=g)
    rows = [torch.cat([head, torch.randint(3, VOCAB, (q,), generator=g)]) for q in questions[:batch]]
    width = max(r.numel() for r in rows)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - r.numel() :] = r
        mask[b, width - r.numel() :] = 1
    # Questions that start alike would lengthen the common prefix: make their first tokens differ.
    for b in range(batch):
        ids[b, width - questions[b]] = 3 + b
    return ids, mask


def test_the_common_prefix_is_found_on_real_tokens_wherever_padding_puts_them():
    ids, mask = system_prompts(3, [5, 1, 9])
    assert common_prefix_length(ids, mask, 4) == SYSTEM
    assert common_prefix_length(ids, mask, SYSTEM + 1) == 0  # shorter than min_shared_tokens
    assert common_prefix_length(ids, mask, None) == 0
    assert common_prefix_length(ids[:1], mask[:1], 1) == 0  # one prompt: nothing to share
    same = ids[2:3].repeat(3, 1)  # identical prompts: each keeps its last token of its own
    assert common_prefix_length(same, mask[2:3].repeat(3, 1), 1) == int(mask[2].sum()) - 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_greedy_rollout_with_a_common_prefix_equals_hf_generate(family_models, family, kv_sharing):
    model = family_models[family]
    ids, mask = system_prompts(3, [4, 1, 7], seed=1)
    config = RolloutConfig(
        samples_per_prompt=2,
        max_new_tokens=8,
        eos_token_id=NO_EOS,
        kv_sharing=kv_sharing,
        min_shared_tokens=4,
        enable_profiling=True,
    )
    rollout = Rollout(model, config)
    out = rollout.generate(ids, mask)
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 8).repeat_interleave(2, dim=0))
    # The system prompt once, then each prompt's own tokens.
    assert rollout.get_last_profile().prefill_tokens == SYSTEM + 4 + 1 + 7


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_samples_and_logprobs_equal_the_rollout_without_a_common_prefix(llama, kv_sharing):
    """Seeded sampling with EOS ids (rows end at different steps: compaction, with the common prefix kept
    whole), top-k/top-p and log-probabilities: the same tokens, log-probabilities within float32 rounding,
    and (a system prompt of 36 tokens) its two whole blocks held once in the pool, named by every row."""
    ids, mask = system_prompts(4, [3, 6, 2, 8], seed=2, system=36)
    base = dict(
        samples_per_prompt=3,
        max_new_tokens=20,
        kv_sharing=kv_sharing,
        temperature=0.9,
        top_k=40,
        top_p=0.95,
        seed=5,
        eos_token_id=[11, 23, 37, 45],
        return_logprobs=True,
        enable_profiling=True,
    )
    shared = Rollout(llama, RolloutConfig(min_shared_tokens=4, **base))
    plain = Rollout(llama, RolloutConfig(min_shared_tokens=None, **base))
    a, b = shared.generate(ids, mask), plain.generate(ids, mask)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)
    assert shared.decode_counters().compactions > 0
    assert shared.get_last_profile().prefill_tokens == 36 + 3 + 6 + 2 + 8  # the system prompt computed once
    store = shared.cache.paged  # (every row's table is kept after the call, for a turn)
    first = store.tables.blocks[0][:2]
    assert all(store.tables.blocks[r][:2] == first for r in range(12))
    assert [store.pool.refs[b] for b in first] == [12, 12]  # one copy in the pool, named by the 12 rows


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
def test_turns_after_a_common_prefix_equal_hf_on_the_full_history(llama, kv_sharing):
    ids, mask = system_prompts(2, [3, 5], seed=3)
    n, new = 2, 6
    rollout = Rollout(
        llama,
        RolloutConfig(
            samples_per_prompt=n, max_new_tokens=new, eos_token_id=NO_EOS, kv_sharing=kv_sharing, min_shared_tokens=4
        ),
    )
    out = rollout.generate(ids, mask)
    appended = [[5, 6], [7], None, [8, 9, 10]]
    out = rollout.extend(out, appended, max_new_tokens=new)
    for r, tail in enumerate(appended):
        if tail is None:
            continue
        prompt = ids[r // n][mask[r // n].bool()]
        first = out.responses[r, :new]
        full = torch.cat([prompt, first, torch.tensor(tail)])[None]
        expected = hf_greedy(llama, full, torch.ones_like(full), new)[0]
        got = out.responses[r, new + len(tail) : new + len(tail) + new]
        assert torch.equal(got, expected), r


def test_a_row_budget_streams_with_the_same_tokens(llama):
    """max_rows streams the rows (prompts prefilled as rows free up, without the common prefix): the
    tokens of the unbudgeted rollout that computed it once."""
    ids, mask = system_prompts(4, [3, 6, 2, 8], seed=4)
    base = dict(samples_per_prompt=2, max_new_tokens=10, eos_token_id=[11, 23, 37], min_shared_tokens=4)
    whole = Rollout(llama, RolloutConfig(**base)).generate(ids, mask)
    streamed = Rollout(llama, RolloutConfig(max_rows=4, **base)).generate(ids, mask)
    assert torch.equal(whole.sequences, streamed.sequences)


@pytest.mark.parametrize("kv_sharing", ["prefix"])
def test_decode_on_the_emulated_cuda_attention_reads_the_common_prefix_aligned(llama, kv_sharing):
    """The three-level decode attention's shared levels (the common prefix, the prompts) through
    fused_attention's CUDA branch against the emulated memory-efficient kernels: the CPU kernels' samples,
    no bias copied for alignment. (The copy layout's decode reads each row's keys through paged_attention
    alone, whose CPU kernel runs the CUDA kernel's row logic.)"""
    from mem_eff_emulator import emulated_cuda_branch, recording_bias_copies

    ids, mask = system_prompts(3, [3, 6, 2], seed=6)
    config = RolloutConfig(
        samples_per_prompt=3,
        max_new_tokens=16,
        kv_sharing=kv_sharing,
        temperature=1.0,
        seed=0,
        eos_token_id=[41, 60, 90],
        return_logprobs=True,
        min_shared_tokens=4,
    )
    expected = Rollout(llama, config).generate(ids, mask)
    rollout = Rollout(llama, config)
    with emulated_cuda_branch("zero") as emulator, recording_bias_copies() as copied:
        got = rollout.generate(ids, mask)
    assert emulator.calls and copied and not any(copied)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-4, atol=1e-5)


def test_patch_generate_computes_a_system_prompt_once_with_hfs_tokens(llama):
    ids, mask = system_prompts(3, [4, 2, 6], seed=7)
    ids, mask = ids.repeat_interleave(2, dim=0), mask.repeat_interleave(2, dim=0)  # TRL's layout: N copies
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = type(llama).generate(llama, ids, **kwargs)
    with torchkvops.patch_generate(llama, kv_sharing="prefix", min_shared_tokens=4) as handle:
        got = llama.generate(ids, **kwargs)
        assert handle.last_profile().prefill_tokens == SYSTEM + 4 + 2 + 6
    assert torch.equal(got, expected)


def test_bad_min_shared_tokens_names_the_field():
    with pytest.raises(ValueError, match="RolloutConfig.min_shared_tokens must be None .* or an int >= 1"):
        RolloutConfig(min_shared_tokens=0)


def decode_cache_lengths(model, run) -> list[int]:
    """What the KV cache reports as its length (`get_seq_length()`, from which transformers 5's models number
    the step's cache_position when none is passed) at each one-token (decode) forward of `run()`."""
    seen = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if ids is not None and ids.shape[-1] == 1 and cache is not None:
            seen.append(int(cache.get_seq_length()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
@pytest.mark.parametrize("common", [False, True], ids=["plain", "system-prompt"])
def test_decode_reports_hfs_cache_length_in_every_layout(llama, kv_sharing, common):
    """HF's generate feeds decode step s with a cache of P + s positions (P: the padded input's width), which
    its models number the step's cache_position from; the rollout's cache reports the same in both layouts,
    with or without a system prompt computed once (where the rows' buffers hold no padding, or only their
    response: the prefix layout reported the response column)."""
    ids, mask = system_prompts(3, [4, 1, 7], seed=2) if common else prompts(3, 9, seed=2, left_pad=[0, 3, 5])
    new = 6
    expected = decode_cache_lengths(llama, lambda: hf_greedy(llama, ids, mask, new))
    config = RolloutConfig(
        samples_per_prompt=2, max_new_tokens=new, eos_token_id=NO_EOS, kv_sharing=kv_sharing, min_shared_tokens=4
    )
    got = decode_cache_lengths(llama, lambda: Rollout(llama, config).generate(ids, mask))
    assert expected == list(range(ids.shape[1], ids.shape[1] + new - 1)) and got == expected
