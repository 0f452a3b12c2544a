"""patch_generate across calls (torchkvops.hf.generate_reuse): a call whose rows extend the last served
call's (an agent's next turn: prompt, completion through EOS, a tool's answer) is served from the kept
KV and prefills only what the rows append; any change of the weights drops what was kept. The oracle
is HF's generate on an unpatched twin of the model (same weights) or on the model with its patch undone."""

import copy

import pytest
import torch
from models import FAMILIES, prompts
from torch import nn

import torchkvops

EOS = [41, 60, 90]
KWARGS = dict(do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=0)


def hf(model, ids, mask):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **KWARGS)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel() :], mask[i, width - r.numel() :] = r, 1
    return ids, mask


def next_turn(ids, mask, out, rows, suffixes):
    """TRL's tool loop: for each row that called a tool, prompt (no padding) + completion through its
    first EOS + the tool's answer, left-padded."""
    built = []
    for i, suffix in zip(rows, suffixes):
        completion = out[i, ids.shape[1] :]
        ends = [k for k, t in enumerate(completion.tolist()) if t in EOS]
        completion = completion[: ends[0] + 1] if ends else completion
        built.append(torch.cat([ids[i][mask[i].bool()], completion, torch.tensor(suffix)]))
    return left_pad(built)


def first_turn():
    ids, mask = prompts(3, 6, seed=0, left_pad=[0, 2, 1])
    return ids.repeat_interleave(2, dim=0), mask.repeat_interleave(2, dim=0)  # GRPO: each prompt N=2 times


@pytest.mark.parametrize("layout", ["copy", "prefix"])
def test_tool_turns_are_served_from_the_kept_kv_and_equal_hf(layout):
    model, twin = FAMILIES["llama"](), FAMILIES["llama"]()
    handle = torchkvops.patch_generate(model, kv_sharing=layout)
    ids, mask = first_turn()
    out = model.generate(ids, attention_mask=mask, **KWARGS)
    assert torch.equal(out, hf(twin, ids, mask))
    assert handle.last_profile().reused_tokens == 0 and handle.last_profile().prefill_tokens == 3 * 6
    for turn, rows in enumerate(([0, 1, 3, 4], [1, 2])):  # rows that made a tool call
        suffixes = [[5, 6, 7 + i][: 1 + (i + turn) % 3] for i in range(len(rows))]
        ids, mask = next_turn(ids, mask, out, rows, suffixes)
        out = model.generate(ids, attention_mask=mask, **KWARGS)
        assert torch.equal(out, hf(twin, ids, mask)), turn
        profile = handle.last_profile()
        widest = max(len(s) for s in suffixes) + 1  # each row's last token and its tool answer
        # The call's rows' chunks only: the rollout's other rows are left out (batches of up to 8 rows
        # are compacted to exactly their live rows).
        assert profile.prefill_tokens == len(rows) * widest
        # Reused: each row's tokens after padding but its last (fed again), whose KV was kept.
        assert profile.reused_tokens == int(mask.sum()) - sum(len(s) for s in suffixes) - len(rows)


def step_optimizer(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()


def write_data(model):
    weight = model.lm_head.weight
    weight.data.copy_(weight.data.flip(0))  # through .data: no version counter bump


def replace_parameter(model):
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach() * 1.5)


def load_state(model):
    state = {k: v * 0.9 for k, v in model.state_dict().items()}
    model.load_state_dict(state)


@pytest.mark.parametrize("change", [step_optimizer, write_data, replace_parameter, load_state])
def test_a_weight_change_drops_the_kept_kv(change):
    model = FAMILIES["llama"]()
    handle = torchkvops.patch_generate(model)
    ids, mask = first_turn()
    out = model.generate(ids, attention_mask=mask, **KWARGS)
    change(model)
    ids, mask = next_turn(ids, mask, out, [0, 2], [[5, 6], [7]])
    out = model.generate(ids, attention_mask=mask, **KWARGS)
    assert handle.last_profile().reused_tokens == 0  # prefilled anew, by the new weights
    twin = copy.deepcopy(model)  # unpatched (copies are), with the changed weights
    assert torch.equal(out, hf(twin, ids, mask))


def test_reuse_off_release_and_calls_that_extend_nothing_prefill_anew():
    model, twin = FAMILIES["llama"](), FAMILIES["llama"]()
    ids, mask = first_turn()
    for setup in ("off", "release", "new row", "other settings"):
        handle = torchkvops.patch_generate(model, reuse_kv=setup != "off")
        out = model.generate(ids, attention_mask=mask, **KWARGS)
        if setup == "release":
            handle.release()
        rows, suffixes = [0, 3], [[5], [6, 7]]
        next_ids, next_mask = next_turn(ids, mask, out, rows, suffixes)
        if setup == "new row":  # a row that extends no kept row: the whole call is prefilled
            next_ids, next_mask = left_pad([*(r[m.bool()] for r, m in zip(next_ids, next_mask)), torch.tensor([9, 8])])
        kwargs = dict(KWARGS, eos_token_id=[41]) if setup == "other settings" else KWARGS
        result = model.generate(next_ids, attention_mask=next_mask, **kwargs)
        assert handle.last_profile().reused_tokens == 0, setup
        with torch.no_grad():
            assert torch.equal(result, twin.generate(next_ids, attention_mask=next_mask, **kwargs)), setup
        handle.undo()


def test_last_profile_is_none_after_a_fallback():
    model = FAMILIES["llama"]()
    handle = torchkvops.patch_generate(model)
    ids, mask = first_turn()
    model.generate(ids, attention_mask=mask, **KWARGS)
    assert handle.last_profile() is not None
    with pytest.warns(UserWarning, match="repetition_penalty"):
        model.generate(ids, attention_mask=mask, repetition_penalty=1.3, **KWARGS)
    assert handle.last_profile() is None


def test_reuse_kv_must_be_a_bool():
    with pytest.raises(ValueError, match="reuse_kv must be a bool, got 1"):
        torchkvops.patch_generate(FAMILIES["llama"](), reuse_kv=1)
