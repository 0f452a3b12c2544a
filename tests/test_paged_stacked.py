"""The paged layout's prompts read stacked (`PagedLayout.stacked_tokens`): a prompt's whole blocks, which
every row of it names in its table, read once a decode step for its rows' stacked queries, each row's own
keys after them, the two merged by their log-sum-exps. Oracles: Hugging Face's greedy generate (on each
row's full history after a turn), and the same layout reading every row through its own table (the
threshold out of reach): the same samples, log-probabilities equal to rounding. Each test also checks that
the stacked read ran (a spy on it), so that a threshold or a shape that turned it off fails the test
instead of testing the per-row read twice."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from families import tiny_model
from models import hf_greedy, prompts
from test_turns import EOS as TURN_EOS
from test_turns import run_turns

from torchkvops import Rollout, RolloutConfig
from torchkvops.rollout import attention
from torchkvops.rollout.layouts import PagedLayout
from torchkvops.rollout.paged_store import KV_BLOCK_SIZE, PagedStore

EOS = [11, 23, 37, 45]
# Families whose decode attention takes each argument the stacked read passes on or leaves to the tables:
# grouped-query heads (llama), softcapped scores and a window (gemma2), attention sinks and a window
# (gpt_oss), a window on every other layer (gemma3), recurrent layers beside attention (qwen3_next).
FAMILIES = ["llama", "gemma2", "gpt_oss", "gemma3_text", "qwen3_next"]


@pytest.fixture
def stacked(monkeypatch):
    """Prompts of one whole block or more read stacked; the stacked reads made, in a list: whether each read
    the shared blocks in place (views of the pool where `PagedStore.place_prompts` laid them out) or
    gathered them through the tables."""
    calls = []
    read = attention._stacked_prompts

    def spy(context, *args, **kwargs):
        calls.append(context.prompts_in_place)
        return read(context, *args, **kwargs)

    monkeypatch.setattr(PagedLayout, "stacked_tokens", KV_BLOCK_SIZE)
    monkeypatch.setattr(attention, "_stacked_prompts", spy)
    return calls


def per_row(monkeypatch) -> None:
    """Every prompt read through its rows' tables."""
    monkeypatch.setattr(PagedLayout, "stacked_tokens", 1 << 30)


def sampled(max_new_tokens: int, samples: int = 3, **options) -> RolloutConfig:
    return RolloutConfig(
        samples_per_prompt=samples,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        seed=4,
        eos_token_id=EOS,
        return_logprobs=True,
        **options,
    )


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", max_position_embeddings=1024)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_stacked_prompts_greedy_matches_hf_generate(family, padded, stacked):
    """Prompts of 37 columns (two whole blocks shared, the third partly filled and each row's own), left
    padding over the first block and into the second, or over both whole blocks (that prompt's shared
    part is empty: its rows' own keys alone count): HF's greedy tokens."""
    model = tiny_model(family)
    if model is None:
        pytest.skip(f"{family}: not in this transformers")
    ids, mask = prompts(3, 37, seed=5, left_pad=[0, 20, 33] if padded else None)
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=30, eos_token_id=[])
    out = Rollout(model, config).generate(ids, mask)
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 30).repeat_interleave(2, dim=0))
    assert stacked and all(stacked)  # (no row ends: every read in place)


def test_stacked_samples_and_logprobs_equal_the_per_row_reads(llama, stacked, monkeypatch):
    """Rows that end at spread steps: the batch compacted (the stacked queries then gathered through query
    slots, padding slots among them), prompts whose padding fills a whole block for one of them: the
    per-row read's samples and log-probabilities."""
    ids, mask = prompts(3, 53, seed=2, left_pad=[0, 17, 5])
    config = sampled(150, samples=4)
    rollout = Rollout(llama, config)
    out = rollout.generate(ids, mask)
    assert stacked and rollout.decode_counters().compactions > 0
    per_row(monkeypatch)
    calls = len(stacked)
    reference = Rollout(llama, config).generate(ids, mask)
    assert len(stacked) == calls  # (the reference read every row through its table)
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(out.logprobs, reference.logprobs, rtol=1e-5, atol=1e-5)
    lengths = out.response_mask.sum(dim=1)
    assert int(lengths.min()) < int(lengths.max())


def test_prompts_read_in_place_give_the_gathered_reads_samples(llama, stacked, monkeypatch):
    """The stacked read viewing the prompts' blocks in place (`DecodeShape.prompts_in_place`), left padding
    over a whole block of one prompt, rows ending at spread steps (compaction keeps the views while every
    prompt has a live row, then gathers): the samples and log-probabilities of the same read gathering
    the blocks through the tables every step."""
    ids, mask = prompts(3, 53, seed=2, left_pad=[0, 17, 5])
    config = sampled(150, samples=4)
    rollout = Rollout(llama, config)
    out = rollout.generate(ids, mask)
    assert stacked[0] and rollout.decode_counters().compactions > 0
    calls = len(stacked)
    monkeypatch.setattr(PagedStore, "prompts_in_place", lambda *args: False)
    gathered = Rollout(llama, config).generate(ids, mask)
    assert len(stacked) > calls and not any(stacked[calls:])
    assert torch.equal(out.sequences, gathered.sequences)
    torch.testing.assert_close(out.logprobs, gathered.logprobs, rtol=1e-5, atol=1e-5)


def test_a_prompt_shorter_than_the_threshold_is_read_per_row(llama, stacked, monkeypatch):
    """Below `stacked_tokens` (and with one sample a prompt: nothing to stack) no stacked read is made."""
    ids, mask = prompts(2, 40, seed=1)
    monkeypatch.setattr(PagedLayout, "stacked_tokens", 48)  # 40 columns: 32 in whole blocks
    Rollout(llama, sampled(20)).generate(ids, mask)
    assert not stacked
    monkeypatch.setattr(PagedLayout, "stacked_tokens", 32)
    Rollout(llama, sampled(20, samples=1)).generate(ids, mask)
    assert not stacked
    Rollout(llama, sampled(20)).generate(ids, mask)
    assert stacked


def test_turns_after_stacked_reads_equal_hf_on_each_full_history(llama, stacked):
    """Two extends after a call whose prompts were read stacked, appends of 0 to 40 tokens, a row finished
    at the second: each turn's decode reads the prompts stacked too (their blocks stay where they were)."""
    config = RolloutConfig(samples_per_prompt=3, max_new_tokens=12, eos_token_id=TURN_EOS)  # (the oracle's)
    ids, mask = prompts(2, 35, seed=3, left_pad=[0, 6])
    run_turns(llama, config, ids, mask, turns=2, appended_lengths=(0, 40), finished_at={1: (2,)})
    assert len(stacked) > 0


def system_prompts(system_length: int = 36, left_pad=(0, 3, 9)):
    """Three prompts of 60 columns, left-padded by `left_pad`, the same `system_length` tokens at the start
    of every prompt's real tokens."""
    ids, mask = prompts(3, 60, seed=6, left_pad=list(left_pad))
    ids[:, :] = torch.where(mask.bool(), ids, 0)
    system = torch.randint(3, 90, (system_length,), generator=torch.Generator().manual_seed(0))
    for b in range(3):
        first = int((~mask[b].bool()).sum())
        ids[b, first : first + system_length] = system
    return ids, mask


def test_a_common_prefix_and_stacked_prompts(llama, stacked, monkeypatch):
    """A prefix common to every prompt (computed once) before remainders of other lengths: its two whole
    blocks read once a step for every row (the decode shape's `common_len`), each prompt's own whole blocks
    after them for its rows, ending where its own remainder ends. The per-row read's samples."""
    ids, mask = system_prompts()
    config = sampled(40, min_shared_tokens=16)
    rollout = Rollout(llama, config)
    out = rollout.generate(ids, mask)
    assert stacked and stacked[0]  # (in place: the common prefix's run, then each prompt's)
    assert rollout.decode_counters().graph_key[0].common_len == 32  # (36 tokens: two whole blocks)
    per_row(monkeypatch)
    reference = Rollout(llama, config).generate(ids, mask)
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(out.logprobs, reference.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "qwen3_next"])
@pytest.mark.parametrize("system_length", [36, 48], ids=["remainders-with-blocks", "common-ends-a-block"])
def test_a_common_prefix_read_once_greedy_matches_hf_generate(family, system_length, stacked):
    """The common prefix's level with softcapped scores (gemma2), attention sinks (gpt_oss) and recurrent
    layers beside attention (qwen3_next): HF's greedy tokens on the full prompts. A system prompt of 36
    tokens in prompts of 60, 57 and 46 tokens: two whole blocks read once for every row, then the prompts'
    own part (the third block), which the third prompt (two whole blocks) does not reach (all masked). A
    system prompt of 48 tokens in prompts of 60, 57 and 51: no prompt has a whole block past it, so the
    prompts' level reads it all (no common level)."""
    model = tiny_model(family)
    if model is None:
        pytest.skip(f"{family}: not in this transformers")
    ids, mask = system_prompts(system_length, left_pad=(0, 3, 14) if system_length == 36 else (0, 3, 9))
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=20, eos_token_id=[], min_shared_tokens=16)
    rollout = Rollout(model, config)
    out = rollout.generate(ids, mask)
    assert torch.equal(out.responses, hf_greedy(model, ids, mask, 20).repeat_interleave(2, dim=0))
    assert stacked and rollout.decode_counters().graph_key[0].common_len == (32 if system_length == 36 else 0)


def test_a_compiled_stacked_decode_gives_the_eager_tokens(llama, monkeypatch):
    """The decode step compiled with its prompts read stacked (no spy here: Dynamo would trace it; the
    decode shape tells: its prompts' shared columns), compacted as rows end: the eager tokens."""
    monkeypatch.setattr(PagedLayout, "stacked_tokens", KV_BLOCK_SIZE)
    ids, mask = prompts(2, 40, seed=2, left_pad=[0, 3])
    config = sampled(40)
    eager = Rollout(llama, config).generate(ids, mask)
    rollout = Rollout(llama, dataclasses.replace(config, compile=True))
    compiled = rollout.generate(ids, mask)
    counters = rollout.decode_counters()
    assert counters.compiled_steps > 0 and counters.eager_keys == 0 and counters.compactions > 0
    assert counters.graph_key[0].prompt_len == 32  # (40 columns: two whole blocks)
    assert any(shape.prompts_in_place for shape in rollout._decoder.decode_states._entries)  # (before a prompt ends)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=1e-4, atol=1e-4)
