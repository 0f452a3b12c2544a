"""What the two trainer integrations share: `patch_generate` (generate_patch.py) and `patch_forward`
(training/shared_forward.py) both patch one model instance, fall back with one warning per cause, refuse
dropout they cannot reproduce, read autocast and keep a few cached objects. Each of those is written
once here, so that the two cannot drift apart. Only torch is imported: any module may use this one.
"""

from __future__ import annotations

import collections
import sys
import warnings
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch
from torch import Tensor, nn

__all__ = [
    "PatchHandle",
    "WarnOnce",
    "LRU",
    "DROPOUT_ATTRIBUTES",
    "ATTENTION_DROPOUT_ATTRIBUTES",
    "dropout_probability",
    "attention_dropout",
    "active_dropout",
    "disable_dropout",
    "autocast_dtype",
    "forward_autocast_dtype",
    "left_padding_fault",
]


# --- the handle a patch_* function returns -----------------------------------------------------------
class PatchHandle:
    """What a `patch_*` function returns: `active` until `undo()` (or leaving its `with` block), which
    restores the model once (`_restore`, written by each patch); undoing again does nothing."""

    def __init__(self) -> None:
        self.active = True

    def undo(self) -> None:
        if not self.active:
            return
        self.active = False
        self._restore()

    def _restore(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


# --- one warning per cause ----------------------------------------------------------------------------
class WarnOnce:
    """A UserWarning the first time each cause is seen: `template` formatted with `cause=` (and the
    caller's other fields). Keyed by the cause alone, whatever the other fields are."""

    def __init__(self, template: str):
        self.template = template
        self.seen: set[str] = set()

    def __call__(self, cause: str, stacklevel: int = 1, **fields) -> None:
        """stacklevel: as `warnings.warn` counts it from the caller's line (1: that line)."""
        if cause not in self.seen:
            self.seen.add(cause)
            warnings.warn(self.template.format(cause=cause, **fields), UserWarning, stacklevel=stacklevel + 1)


# --- a small least-recently-used cache ----------------------------------------------------------------
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most `capacity` entries, the least recently used (read by `get` or written by `put`) dropped
    first; `release(value)` is called on every entry that leaves (evicted, replaced, cleared)."""

    def __init__(self, capacity: int, release: Callable[[V], None] | None = None):
        if capacity < 1:
            raise ValueError(f"LRU: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._release = release
        self._entries: collections.OrderedDict[K, V] = collections.OrderedDict()

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value under `key` (now the most recently used), or `default`."""
        if key not in self._entries:
            return default
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: K, value: V) -> V:
        """Store `value` under `key` as the most recently used; returns it. Entries over the capacity go."""
        old = self._entries.pop(key, None)
        if old is not None and old is not value and self._release is not None:
            self._release(old)
        self._entries[key] = value
        while len(self._entries) > self.capacity:
            self.evict(next(iter(self._entries)))
        return value

    def evict(self, key: K) -> None:
        """Drop the entry under `key` (releasing it), if there is one."""
        value = self._entries.pop(key, None)
        if value is not None and self._release is not None:
            self._release(value)

    def clear(self) -> None:
        """Drop (and release) every entry."""
        while self._entries:
            self.evict(next(iter(self._entries)))

    def values(self):
        return self._entries.values()

    def __iter__(self):
        """The keys, least recently used first."""
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries


# --- dropout ------------------------------------------------------------------------------------------
# Where transformers layers keep a dropout probability: an nn.Dropout submodule, or the float they pass
# to functional dropout in train mode (OPT's `dropout`, Llama's `attention_dropout`).
DROPOUT_ATTRIBUTES = (
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "hidden_dropout",
    "attn_dropout",
    "resid_dropout",
    "embd_dropout",
)
# Of those, the ones an attention layer applies to its attention probabilities (GPT-2's nn.Dropout
# `attn_dropout`, Llama's `attention_dropout`, OPT's `dropout`), in the order a layer is read: the first
# one it has is the one it applies.
ATTENTION_DROPOUT_ATTRIBUTES = ("attn_dropout", "attention_dropout", "dropout")
assert set(ATTENTION_DROPOUT_ATTRIBUTES) <= set(DROPOUT_ATTRIBUTES)
# The projections by which an attention layer is recognised (with its `layer_idx`).
_ATTENTION_PROJECTIONS = ("q_proj", "c_attn", "qkv_proj", "query_key_value", "Wqkv")


def dropout_probability(value) -> float | None:
    """The dropout probability that `value` holds: an nn.Dropout's p or a number (not a bool); else None."""
    if isinstance(value, nn.Dropout):
        return float(value.p)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def attention_dropout(model: nn.Module) -> float:
    """The largest dropout on attention probabilities that the model's attention layers apply in train
    mode, read from the layers themselves (ATTENTION_DROPOUT_ATTRIBUTES), so that TRL's disable_dropout
    (p = 0) is seen."""
    most = 0.0
    for module in model.modules():
        if not (hasattr(module, "layer_idx") and any(hasattr(module, proj) for proj in _ATTENTION_PROJECTIONS)):
            continue
        for name in ATTENTION_DROPOUT_ATTRIBUTES:
            p = dropout_probability(getattr(module, name, None))
            if p is not None:
                most = max(most, p)
                break
    return most


def active_dropout(model: nn.Module) -> str | None:
    """The first dropout the model applies in train mode, named: an nn.Dropout with p > 0, or a float
    in DROPOUT_ATTRIBUTES that a layer passes to functional dropout; None when there is none."""
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, nn.Dropout):
            if module.p > 0:
                return f"{name or type(module).__name__} p={module.p}"
            continue
        for attribute in DROPOUT_ATTRIBUTES:
            value = vars(module).get(attribute)
            p = dropout_probability(value)
            if p is not None and p > 0:
                return f"{name + '.' if name else ''}{attribute}={value}"
    return None


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout the shared path checks to 0: nn.Dropout's p (what TRL's disable_dropout does) and
    the floats that OPT-style layers pass to functional dropout (which TRL's leaves on)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
            continue
        for attribute in DROPOUT_ATTRIBUTES:
            value = vars(module).get(attribute)
            if isinstance(value, float) and value > 0:
                setattr(module, attribute, 0.0)


# --- autocast -----------------------------------------------------------------------------------------
def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype an enabled autocast casts to on `device_type` here, or None (traceable by torch.compile)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def forward_autocast_dtype(model: nn.Module, device_type: str) -> torch.dtype | None:
    """The dtype the model's forward autocasts to, or None: an autocast around this call, or the one
    accelerate's mixed precision (a Trainer with bf16=True or fp16=True, as TRL's GRPOTrainer defaults
    to) wraps `model.forward` in, marking the model with `_original_forward`. device_type: the model's."""
    dtype = autocast_dtype(device_type)
    if dtype is not None:
        return dtype
    if vars(model).get("_original_forward") is not None:
        state = sys.modules.get("accelerate.state")
        mixed = state.AcceleratorState._shared_state.get("_mixed_precision") if state is not None else None
        return torch.float16 if mixed == "fp16" else torch.bfloat16  # accelerate's bf16 and fp8 autocast to bf16
    return None


# --- left padding -------------------------------------------------------------------------------------
def left_padding_fault(mask: Tensor) -> str | None:
    """Which rule of the left-padded layout (zeros first, then ones, at least one token a row) a 0/1
    mask [rows, length] breaks, the first found in this order: "empty row" (a row of zeros), "right
    padding" (a 0 in the last column), "hole" (a 0 after a 1); None when it breaks none. Host syncs:
    one to three flags."""
    if not bool(mask.any(dim=1).all()):
        return "empty row"
    if not bool(mask[:, -1].all()):
        return "right padding"
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        return "hole"
    return None
