"""Sliding-window models at any length in the copy KV layout (`CopyLayout.masks_windows`): the prefill masks
its sliding layers' keys past the window (a mask per layer kind), decode and a turn's packed forward mask
the keys of a row that are `window` or more columns before the query's own. The oracle is HF's generate,
whose sliding layers keep only the window. Tiny models of every served family with sliding layers (window
8) and a Mistral whose every layer slides; rows of 14 + 10 tokens, three times the window. The prefix
layout serves them within the window only, and says so."""

from __future__ import annotations

import warnings

import pytest
import torch
from families import WINDOW, tiny_model
from test_turns import EOS, run_turns

import torchkvops
from torchkvops import Rollout, RolloutConfig

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


def left_padded(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (3, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[2, :5] = 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_greedy(model, ids, mask, new):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0
        )
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_generate_and_a_row_budget_beyond_the_window_give_hfs_tokens(family):
    model = model_of(family)
    ids, mask = left_padded()
    expected = hf_greedy(model, ids, mask, NEW).repeat_interleave(2, dim=0)
    for max_rows in (None, 4):  # 4: the rows stream through a smaller batch
        config = RolloutConfig(samples_per_prompt=2, max_new_tokens=NEW, eos_token_id=[], max_rows=max_rows)
        assert torch.equal(Rollout(model, config).generate(ids, mask).responses, expected), max_rows
    with pytest.raises(ValueError, match="kv_sharing='copy' masks it at any length"):
        Rollout(model, RolloutConfig(max_new_tokens=NEW, eos_token_id=[], kv_sharing="prefix")).generate(ids, mask)


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "gemma2", "mistral_every_layer"])
def test_turns_beyond_the_window_equal_hf_on_each_full_history(family):
    """Two extends with appended chunks of 0-8 tokens (EOS ids: rows of different lengths), each row's new
    tokens against HF's generate on its full history."""
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=NEW, eos_token_id=EOS)
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


def test_the_windowed_decode_bias_on_the_emulated_cuda_attention_needs_no_copy():
    """Decode beyond the window through fused_attention's CUDA branch against the emulated memory-efficient
    kernels: the CPU branch's tokens, and the windowed bias (a new [rows, 1, 1, T] tensor each layer)
    aligned as the kernels read it, never copied."""
    from mem_eff_emulator import emulated_cuda_branch, recording_bias_copies

    model = model_of("gemma3_text")
    ids, mask = left_padded(3)
    config = RolloutConfig(samples_per_prompt=2, max_new_tokens=NEW, temperature=1.0, seed=0, eos_token_id=[])
    expected = Rollout(model, config).generate(ids, mask)
    with emulated_cuda_branch("zero") as emulator, recording_bias_copies() as copied:
        got = Rollout(model, config).generate(ids, mask)
    assert emulator.calls and copied and not any(copied)
    assert torch.equal(got.sequences, expected.sequences)


def test_patch_generate_with_the_prefix_layout_falls_back_beyond_the_window_with_hfs_tokens():
    model = model_of("gemma3_text")
    ids, mask = left_padded(4)
    expected = hf_greedy(model, ids, mask, NEW)
    with torchkvops.patch_generate(model, kv_sharing="prefix"):
        with pytest.warns(UserWarning, match="kv_sharing='prefix' serves sliding-window attention only within"):
            got = model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0
            )
    assert torch.equal(got[:, PROMPT:], expected)
