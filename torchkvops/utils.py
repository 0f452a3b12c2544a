"""Small helpers below the engine, which import no module of the package (any module may use them):
the handle a `patch_*` function returns (`PatchHandle`, used by patch_generate and patch_forward), one
warning per cause (`WarnOnce`), a least-recently-used cache (`LRU`: the decoder's states and graphs,
patch_generate's rollouts) and the left-padding rule of a Hugging Face attention mask
(`left_padding_fault`: the rollout and generate's contract).
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from torch import Tensor

__all__ = ["PatchHandle", "WarnOnce", "LRU", "left_padding_fault", "check_has_values"]


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
def check_has_values(tensor, name: str, where: str) -> None:
    """A ValueError naming `name` (for the caller `where`) when `tensor` holds no values to read: on the
    meta device."""
    if tensor.is_meta:
        raise ValueError(f"{where}: {name} is on the meta device, which holds no values; pass it on a real device")


class WarnOnce:
    """A UserWarning the first time each cause is seen: `template` formatted with `cause=` (and the
    caller's other fields). Keyed by the cause alone, whatever the other fields are."""

    def __init__(self, template: str):
        self.template = template
        self.seen: set[str] = set()

    def __call__(self, cause: str, stacklevel: int = 1, template: str | None = None, **fields) -> None:
        """stacklevel: as `warnings.warn` counts it from the caller's line (1: that line); `template`: this
        cause's own, instead of the one given at construction."""
        if cause not in self.seen:
            self.seen.add(cause)
            text = (template or self.template).format(cause=cause, **fields)
            warnings.warn(text, UserWarning, stacklevel=stacklevel + 1)


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
