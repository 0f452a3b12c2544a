"""The coverage table: every decoder-only family torchkvops claims (tests/families.py: tiny random models of
each, initializer_range 0.2), served or refused with a named reason, and where served, the same results
as the oracle:

- `Rollout` (both KV layouts): greedy tokens equal HF's generate on left-padded prompts; a model with a
  sliding window also beyond it, in both layouts.
- `patch_forward`: logits and every parameter's gradient equal the plain forward's, on a GRPO batch
  (left-padded prompts of 3 rows each, right-padded completions) whose prompts share a system prompt
  (computed once, nested) and whose rows are longer than a sliding window (masked within the packed
  layout).

`EXPECTED` is the table; docs/limitations.md lists the same (checked below). Families the installed
transformers lacks are skipped by name (the GPU machine's 5.17 lacks some)."""

from __future__ import annotations

import pathlib
import re
import warnings

import pytest
import torch
from families import FAMILIES, VOCAB, WINDOW, tiny_model, unavailable

import torchkvops
from torchkvops import Rollout, RolloutConfig

SERVED = "served"
# family -> (Rollout's verdict, patch_forward's): SERVED or a phrase of the reason it gives.
EXPECTED = {
    "llama": (SERVED, SERVED),
    "mistral": (SERVED, SERVED),
    "qwen2": (SERVED, SERVED),
    "qwen3": (SERVED, SERVED),
    "qwen3_moe": (SERVED, SERVED),
    "mixtral": (SERVED, SERVED),
    "phi3": (SERVED, SERVED),
    "olmo2": (SERVED, SERVED),
    "olmo3": (SERVED, SERVED),
    "smollm3": (SERVED, SERVED),
    "glm4": (SERVED, SERVED),
    "glm4_moe": (SERVED, SERVED),
    "granite": (SERVED, SERVED),
    "cohere2": (SERVED, SERVED),
    "seed_oss": (SERVED, SERVED),
    "ernie4_5": (SERVED, SERVED),
    "hunyuan_v1_dense": (SERVED, SERVED),
    "hunyuan_v1_moe": (SERVED, SERVED),
    "exaone4": (SERVED, SERVED),
    "apertus": (SERVED, SERVED),
    "ministral3": (SERVED, SERVED),
    "minimax_m2": (SERVED, SERVED),
    "gemma3_text": (SERVED, SERVED),
    "gemma3n_text": (SERVED, SERVED),
    "gemma2": (SERVED, SERVED),
    "gpt_oss": (SERVED, SERVED),
    "gemma4_text": (SERVED, SERVED),
    # Hybrids (recurrent layers: tests/test_hybrid.py).
    "qwen3_5_text": (SERVED, SERVED),
    "qwen3_5_moe_text": (SERVED, SERVED),
    "qwen3_next": (SERVED, SERVED),
    "granitemoehybrid": (SERVED, SERVED),
    "nemotron_h": (SERVED, SERVED),
    "falcon_h1": (SERVED, SERVED),
    "lfm2": (SERVED, SERVED),
}
assert set(EXPECTED) == set(FAMILIES)
# Families whose scores read absolute positions (a norm after the rotary embedding): a system prompt at
# different columns is computed once per prompt.
ABSOLUTE_POSITIONS = {"hunyuan_v1_dense", "hunyuan_v1_moe"}

_models: dict[str, torch.nn.Module] = {}


def model_of(family: str):
    if family not in _models:
        _models[family] = tiny_model(family)
    if _models[family] is None:
        pytest.skip(unavailable(family))
    return _models[family]


def sliding(model) -> bool:
    return "sliding_attention" in (getattr(model.config, "layer_types", None) or [])


def left_padded(batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("family", list(EXPECTED))
def test_the_rollout_serves_each_family_with_hfs_tokens_or_names_why_not(family):
    model = model_of(family)
    verdict = EXPECTED[family][0]
    new = 3
    ids, mask = left_padded(2, WINDOW - new)  # within a sliding window: prompt + new - 1 < WINDOW
    for kv_sharing in ("copy", "prefix"):
        config = RolloutConfig(samples_per_prompt=2, max_new_tokens=new, eos_token_id=[], kv_sharing=kv_sharing)
        if verdict != SERVED:
            with pytest.raises(ValueError, match=re.escape(verdict)):
                Rollout(model, config)
            continue
        with torch.no_grad():
            expected = model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0
            )[:, ids.shape[1] :]
        out = Rollout(model, config).generate(ids, mask)
        assert torch.equal(out.responses, expected.repeat_interleave(2, dim=0)), kv_sharing
    if verdict == SERVED and sliding(model):  # beyond the window, both layouts (tests/test_sliding_window.py)
        longer, mask = left_padded(2, WINDOW + 2)
        expected = model.generate(
            longer, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0
        )[:, longer.shape[1] :]
        for kv_sharing in ("copy", "prefix"):
            config = RolloutConfig(max_new_tokens=new, eos_token_id=[], kv_sharing=kv_sharing)
            assert torch.equal(Rollout(model, config).generate(longer, mask).responses, expected), kv_sharing


def grpo_batch(groups: int = 3, group_size: int = 3, system: int = 6, prompt: int = 10, completion: int = 6):
    """Left-padded prompts (0, 1, 2 pads) that start with the same `system` tokens, each in `group_size`
    rows with completions of their own (the second row's right-padded by one): rows of 16 tokens, twice
    the sliding window of the tiny configs."""
    g = torch.Generator().manual_seed(1)
    head = torch.randint(3, VOCAB, (system,), generator=g)
    ids, mask = [], []
    for i in range(groups):
        pads = i % 3
        own = torch.randint(3, VOCAB, (prompt - system - pads,), generator=g)
        for j in range(group_size):
            row = torch.cat(
                [torch.zeros(pads, dtype=torch.long), head, own, torch.randint(3, VOCAB, (completion,), generator=g)]
            )
            m = (torch.arange(row.numel()) >= pads).long()
            if j == 1:
                m[-1] = 0
            ids.append(row.masked_fill(m == 0, 0))
            mask.append(m)
    return torch.stack(ids), torch.stack(mask)


def forward_and_backward(model, ids, mask, logits_to_keep=0):
    """(logits, every parameter's gradient); with `logits_to_keep` (as TRL asks: the completions') the
    logits only."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=logits_to_keep).logits
    if logits_to_keep:
        return logits.detach(), {}
    logits.float().log_softmax(-1)[mask.bool()].sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(EXPECTED))
def test_patch_forward_serves_each_family_with_the_plain_outputs_and_gradients_or_names_why_not(family):
    model = model_of(family).train()
    try:
        verdict = EXPECTED[family][1]
        ids, mask = grpo_batch()
        real, keep = mask.bool(), 7
        plain_logits, plain_grads = forward_and_backward(model, ids, mask)
        plain_kept, _ = forward_and_backward(model, ids, mask, keep)
        with (
            torchkvops.patch_forward(model, min_shared_tokens=4) as handle,
            warnings.catch_warnings(record=True) as seen,
        ):
            warnings.simplefilter("always")
            logits, grads = forward_and_backward(model, ids, mask)
            kept, _ = forward_and_backward(model, ids, mask, keep)
        if verdict != SERVED:
            assert handle.stats.fallback_calls == 2 and any(verdict in str(w.message) for w in seen)
            return
        assert handle.stats.shared_calls == 2 and handle.stats.fallback_calls == 0
        # The system prompt once, each prompt's rest once, each row's completion (HunYuan: each prompt
        # whole, its scores reading absolute positions), in each of the two forwards.
        groups_alone = 3 * 10 + 9 * 6
        shared = groups_alone - (0 if family in ABSOLUTE_POSITIONS else 2 * 6)
        assert handle.stats.computed_tokens == 2 * shared
        torch.testing.assert_close(logits[real], plain_logits[real], rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(kept[real[:, -keep:]], plain_kept[real[:, -keep:]], rtol=1e-3, atol=1e-4)
        assert grads.keys() == plain_grads.keys()
        for name, want in plain_grads.items():
            # Where the plain forward's own gradient is finite (gemma3n's tiny config gives NaN there).
            finite = torch.isfinite(want)
            scale = want[finite].abs().max() if finite.any() else 0.0
            torch.testing.assert_close(grads[name][finite], want[finite], rtol=1e-3, atol=1e-5 * scale, msg=name)
    finally:
        model.eval()


def test_every_family_the_library_describes_is_tested():
    """A family with an entry in torchkvops.models.families (what differs for it) has its tests: served, a tiny
    model in this table or in tests/models.py (GPT-2, OPT: the model helpers' families, tested by every
    rollout and training test); refused, a tiny model in test_generate_contract's UNSERVABLE, whose test
    checks the refusal and the fallback to HF's own generate."""
    from models import FAMILIES as HELPER_FAMILIES
    from test_generate_contract import UNSERVABLE

    from torchkvops.models.families import FAMILIES as DESCRIBED

    for family, described in DESCRIBED.items():
        where = UNSERVABLE if described.refused else {**EXPECTED, **HELPER_FAMILIES}
        assert family in where, f"{family}: described in torchkvops.models.families, but no test builds it"


def test_the_docs_list_the_table():
    """docs/limitations.md's family table is EXPECTED: each family's row says served or why not."""
    text = (pathlib.Path(__file__).parents[1] / "docs" / "limitations.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| (.+?) \|$", text, flags=re.M))
    assert set(rows) == set(EXPECTED)
    for family, verdicts in EXPECTED.items():
        cells = [c.strip() for c in rows[family].split("|")]
        for cell, verdict in zip(cells, verdicts):
            assert (cell == "yes") if verdict == SERVED else (cell.startswith("no") and verdict in cell), (family, cell)
