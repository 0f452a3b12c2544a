"""torchkvops.rollout.decode's state declaration: a DecodeState holds exactly the tensors DecodeState.FIELDS
declares, with the shapes its DecodeShape gives, and compaction (`gather_into`) moves every per-row
field with its row and every per-prompt field with its prompt, whatever fields are declared. The decode
loop itself is tested through Rollout (tests/test_rollout.py, test_compaction.py, test_logprobs.py)."""

import dataclasses

import pytest
import torch

from torchkvops.rollout.decode import DecodeShape, DecodeState

SHAPES = {
    "copy": DecodeShape(rows=6, mask_len=16, max_new_tokens=5, dtype=torch.bfloat16, logprobs=True),
    "prefix": DecodeShape(rows=6, mask_len=8, max_new_tokens=5, dtype=torch.float32, prompts=3, prompt_len=16),
}


@pytest.mark.parametrize("layout", list(SHAPES))
def test_a_state_holds_what_its_fields_declare(layout):
    shape = SHAPES[layout]
    state = DecodeState(shape, torch.device("cpu"))
    declared = {f.name for f in DecodeState.FIELDS}
    tensors = {name for name, value in vars(state).items() if isinstance(value, torch.Tensor)}
    assert tensors <= declared
    assert state.bias.shape == (6, 1, 1, shape.mask_len) and state.bias.dtype == shape.dtype
    assert (state.logprobs is not None) == shape.logprobs
    assert (state.prompt_bias is not None) == (layout == "prefix")
    assert state.slot_rows is None  # only a compacted prefix-layout batch has query slots
    assert len(state.tensors()) == len(tensors)


@pytest.mark.parametrize("layout", list(SHAPES))
def test_gather_moves_every_field_with_its_row_or_prompt(layout):
    shape = SHAPES[layout]
    old = DecodeState(shape, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for t in old.tensors():
        t.copy_(torch.randint(0, 2 if t.dtype == torch.bool else 1000, t.shape, generator=g).to(t.dtype))
    rows, groups = torch.tensor([4, 1, 5]), torch.tensor([2, 0]) if layout == "prefix" else None
    new = DecodeState(dataclasses.replace(shape, rows=3, prompts=2 if groups is not None else 0), torch.device("cpu"))
    old.gather_into(new, rows, groups)
    for f in DecodeState.FIELDS:
        src, dst = getattr(old, f.name), getattr(new, f.name)
        if src is None:
            continue
        if f.per == "row":
            assert torch.equal(dst, src[rows]), f.name
        elif f.per == "prompt":
            assert torch.equal(dst, src[groups]), f.name
    moved = {f.name for f in DecodeState.FIELDS if f.per in ("row", "prompt")}
    assert {"tokens", "position_ids", "bias", "finished", "keys", "nonfinite_step", "responses", "step"} <= moved
