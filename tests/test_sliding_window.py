"""Sliding-window models at any length, in both KV layouts: the prefill masks its sliding layers' keys past
the window (a mask per layer kind); decode and a packed forward (a turn, the prompts after a system prompt)
mask a row's own keys `window` or more columns before the query's own, and the shared levels' keys (the
prefix layout's prompt and common prefix, whose columns are not the row's) `window` or more positions
before it. The oracle is HF's generate, whose sliding layers keep only the window. Tiny models of every
served family with sliding layers (window 8) and a Mistral whose every layer slides; rows of 14 + 10
tokens, three times the window."""

from __future__ import annotations

import warnings

import pytest
import torch
from families import WINDOW, tiny_model
from test_turns import EOS, run_turns

import torchkvops
from torchkvops import Rollout, RolloutConfig
from torchkvops.rollout.layouts import PagedLayout

SLIDING_FAMILIES = [
    "olmo3",
    "cohere2",
    "exaone4",
    "gemma3_text",
    "gemma3n_text",
    "gemma4_text",
    "gpt_oss",  # (attention sinks too, in decode and in a turn's packed forward)
    "gemma2",  # (capped attention scores too)
    "mistral_every_layer",
]
PROMPT, NEW = 14, 10


def model_of(family: str):
    if family == "mistral_every_layer":  # no layer types: every layer slides, one mask for all
        return tiny_model("mistral", sliding_window=WINDOW)
    model = tiny_model(family)
    if model is None:
        pytest.skip(f"this transformers has no {family}")
    return model


def left_padded(seed: int = 0, length: int = PROMPT):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (3, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[2, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_greedy(model, ids, mask, new):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0
        )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_generate_and_a_row_budget_beyond_the_window_give_hfs_tokens(family, kv_sharing):
    model = model_of(family)
    ids, mask = left_padded()
    expected = hf_greedy(model, ids, mask, NEW).repeat_interleave(2, dim=0)
    for max_rows in (None, 4):  # 4: the rows stream through a smaller batch
        config = RolloutConfig(
            samples_per_prompt=2, max_new_tokens=NEW, eos_token_id=[], max_rows=max_rows, kv_sharing=kv_sharing
        )
        assert torch.equal(Rollout(model, config).generate(ids, mask).responses, expected), max_rows


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_the_paged_layout_gives_back_blocks_out_of_the_window_with_hfs_tokens(family):
    """Rows 6x the window: the paged layout's sliding groups keep their KV in a window pool whose blocks go
    back as rows slide past them (`block_pool.WindowBlocks`), with HF's tokens, as a call and streamed. The
    window pool's peak, counted from the rows: each row's window and the stretch of 8 tokens it reserves
    ahead, in blocks (+ the one it straddles), each prompt's blocks (shared), and the scratch block; the
    full groups' tables hold every row's every key (what a window pool of their size would hold)."""
    model = model_of(family)
    ids, mask = left_padded()
    new = 6 * WINDOW
    expected = hf_greedy(model, ids, mask, new).repeat_interleave(2, dim=0)
    block = PagedLayout.block_size
    for max_rows in (None, 4):
        config = RolloutConfig(
            samples_per_prompt=2, max_new_tokens=new, eos_token_id=[], max_rows=max_rows, kv_sharing="paged"
        )
        rollout = Rollout(model, config)
        assert torch.equal(rollout.generate(ids, mask).responses, expected), max_rows
        store = rollout.cache.paged
        if family == "mistral_every_layer":  # (no layer types: the config says no layer slides)
            assert store.windows is None
            continue
        rows = 6 if max_rows is None else max_rows
        per_row = -(-(WINDOW + 8) // block) + 1
        assert store.peak_window_blocks <= rows * per_row + 3 * -(-PROMPT // block) + 1, max_rows
        assert store.peak_blocks >= rows * ((PROMPT + new) // block)


def system_prompted(seed: int):
    """3 prompts that begin with one 6-token system prompt (kept once: min_shared_tokens=4), left-padded:
    the system prompt's columns differ from prompt to prompt, so its keys' distance to a query depends on
    the prompt (windows of 8 reach into it from the first response tokens on)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 97, (6,), generator=g)
    rows = [torch.cat([system, torch.randint(3, 97, (n,), generator=g)]) for n in (8, 3, 5)]
    ids = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, 14 - row.numel() :], mask[i, 14 - row.numel() :] = row, 1
    return ids, mask


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "gemma2", "mistral_every_layer"])
def test_a_system_prompt_kept_once_and_ended_rows_beyond_the_window_give_hfs_tokens(family, kv_sharing):
    """The system prompt computed once (and, in the prefix layout, read by every row from its one copy),
    EOS ids that end rows at different steps (the batch compacted as they end)."""
    model = model_of(family)
    ids, mask = system_prompted(5)
    free = hf_greedy(model, ids, mask, NEW)
    eos = [int(free[0, 3]), int(free[2, 6])]  # ends rows of prompts 0 and 2 early
    with torch.no_grad():
        expected = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0
        )[:, ids.shape[1] :]
    config = RolloutConfig(
        samples_per_prompt=2,
        max_new_tokens=NEW,
        eos_token_id=eos,
        pad_token_id=0,
        kv_sharing=kv_sharing,
        min_shared_tokens=4,
        compact_finished_rows=True,
        enable_profiling=True,
    )
    rollout = Rollout(model, config)
    out = rollout.generate(ids, mask)
    assert rollout.get_last_profile().prefill_tokens == 6 + 8 + 3 + 5  # the system prompt once
    got = out.responses[:, : expected.shape[1]]
    assert torch.equal(got, expected.repeat_interleave(2, dim=0))


@pytest.mark.parametrize("kv_sharing", ["copy", "prefix", "paged"])
@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "gemma2", "mistral_every_layer"])
def test_turns_beyond_the_window_equal_hf_on_each_full_history(family, kv_sharing):
    """Two extends with appended chunks of 0-8 tokens (EOS ids: rows of different lengths), each row's new
    tokens against HF's generate on its full history."""
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=NEW, eos_token_id=EOS, kv_sharing=kv_sharing)
    run_turns(model_of(family), config, *left_padded(1), turns=2)


def test_patch_generate_serves_a_sliding_window_model_beyond_its_window():
    model = model_of("gemma3_text")
    ids, mask = left_padded(2)
    expected = hf_greedy(model, ids, mask, NEW)
    with torchkvops.patch_generate(model, enable_profiling=True) as handle, warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # served: no fallback warning
        got = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0
        )
        assert handle.last_profile() is not None  # served by the rollout
    assert torch.equal(got[:, PROMPT:], expected)


@pytest.mark.parametrize("kv_sharing", ["prefix"])
def test_the_windowed_decode_bias_on_the_emulated_cuda_attention_needs_no_copy(kv_sharing):
    """Decode beyond the window with the prompts' whole blocks read stacked (the full-attention layers) through
    fused_attention's CUDA branch against the emulated memory-efficient kernels: the CPU branch's tokens,
    and the prompt biases aligned as the kernels read them, never copied. (The windowed layers read each
    row's blocks through paged_attention, windowed by position in the kernel.)"""
    from mem_eff_emulator import emulated_cuda_branch, recording_bias_copies

    model = model_of("gemma3_text")
    ids, mask = left_padded(3, length=2 * PROMPT)  # (a whole block of 16 tokens and more: read stacked)
    config = RolloutConfig(
        samples_per_prompt=2, max_new_tokens=NEW, temperature=1.0, seed=0, eos_token_id=[], kv_sharing=kv_sharing
    )
    expected = Rollout(model, config).generate(ids, mask)
    with emulated_cuda_branch("zero") as emulator, recording_bias_copies() as copied:
        got = Rollout(model, config).generate(ids, mask)
    assert emulator.calls and copied and not any(copied)
    assert torch.equal(got.sequences, expected.sequences)


def test_patch_generate_with_the_prefix_layout_serves_beyond_the_window_with_hfs_tokens():
    model = model_of("gemma3_text")
    ids, mask = left_padded(4)
    expected = hf_greedy(model, ids, mask, NEW)
    with torchkvops.patch_generate(model, kv_sharing="prefix", enable_profiling=True) as handle:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # served: no fallback warning
            got = model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0
            )
        assert handle.last_profile() is not None  # served by the rollout
    assert torch.equal(got[:, PROMPT:], expected)
