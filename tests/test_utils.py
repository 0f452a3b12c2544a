"""torchkvops.utils and torchkvops.models.forward_modes, what the engine, patch_generate and
patch_forward share: the LRU, warn-once, the patch handle, the left-padding rule, and the dropout and
autocast readers (both integrations' end-to-end behaviour is tested in test_generate.py and
test_shared_forward.py)."""

import warnings

import pytest
import torch
from torch import nn

from torchkvops.models import forward_modes
from torchkvops.utils import LRU, PatchHandle, WarnOnce, left_padding_fault


def test_lru_drops_the_least_recently_used_and_releases_what_leaves():
    released = []
    cache = LRU(2, release=released.append)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recently used
    cache.put("c", 3)  # over capacity: "b" goes
    assert released == [2] and "b" not in cache and cache.get("b") is None and len(cache) == 2
    cache.put("a", 1)  # the same value again: not released
    cache.put("a", 4)  # replaced: the old one is
    assert released == [2, 1]
    cache.evict("c")
    cache.evict("missing")
    assert released == [2, 1, 3] and list(cache.values()) == [4]
    cache.clear()
    assert released == [2, 1, 3, 4] and not cache
    with pytest.raises(ValueError, match="capacity"):
        LRU(0)


def test_warn_once_warns_once_per_cause_at_the_callers_line():
    warn = WarnOnce("{where}: {cause} is off")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("x", where="a")
        warn("x", where="b")  # same cause: silent, whatever the other fields
        warn("y", where="b")
    assert [str(w.message) for w in caught] == ["a: x is off", "b: y is off"]
    assert caught[0].filename == __file__


def test_a_patch_handle_restores_once_and_on_leaving_its_block():
    class Handle(PatchHandle):
        restored = 0

        def _restore(self):
            self.restored += 1

    with Handle() as handle:
        assert handle.active
    handle.undo()
    assert not handle.active and handle.restored == 1


def test_both_dropout_readers_read_one_list():
    assert set(forward_modes.ATTENTION_DROPOUT_ATTRIBUTES) <= set(forward_modes.DROPOUT_ATTRIBUTES)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_idx, self.q_proj = 0, nn.Linear(2, 2)
            self.attention_dropout = 0.1

    model = nn.Sequential(Attention(), nn.Dropout(0.2))
    assert forward_modes.attention_dropout(model) == pytest.approx(0.1)  # attention probabilities only
    assert forward_modes.active_dropout(model) == "0.attention_dropout=0.1"
    forward_modes.disable_dropout(model)
    assert forward_modes.attention_dropout(model) == 0 and forward_modes.active_dropout(model) is None


def test_autocast_dtype_and_left_padding_fault():
    assert forward_modes.autocast_dtype("cpu") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert forward_modes.autocast_dtype("cpu") == torch.bfloat16
    faults = {(1, 1): None, (0, 1): None, (0, 0): "empty row", (1, 0): "right padding"}
    for row, fault in faults.items():
        assert left_padding_fault(torch.tensor([row, (1, 1)])) == fault
    assert left_padding_fault(torch.tensor([[1, 0, 1]])) == "hole"
