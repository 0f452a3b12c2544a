"""Cache groups: the rollout's KV cache is a list of groups of layers, each with its own buffers and
shape (`torchkvops.models.adapter.CacheSpec`, built from the model: a full-attention group per KV shape,
and for hybrid models a recurrent group per layout of their layers' states).

A group (`CacheGroup`) stores the KV of its layers, `[group layers, 2, rows, kv_heads, tokens, head_dim]`
per buffer of the layout (`torchkvops.rollout.layouts`), and its kind says how its rows are expanded,
gathered and written home (`GROUP_KINDS`: a new kind is one class there). A recurrent group
(`RecurrentGroup`) stores each layer's states, one row of fixed width whatever the length, as
`[group layers, 1, rows, 1, 1, width]`: the same dims for rows, so expansion (`repeat_kv_cache_`, one
"position" of `width` values), compaction and writing home are the attention groups' code.

A forward's metadata (`torchkvops.rollout.attention`) addresses a buffer of every group at once through
`KVViews`: one tensor per group, and each model layer's slot (its group and its index in it), the slot of
the layer whose KV it reads (its own; for a layer that shares an earlier layer's KV, that layer's), and
the slot of its states.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..models.adapter import GroupSpec
from ..models.families import FULL_ATTENTION, RECURRENT, SLIDING_WINDOW
from ..ops import repeat_kv_cache_

__all__ = [
    "CacheGroup",
    "SlidingWindowGroup",
    "RecurrentGroup",
    "KVViews",
    "GROUP_KINDS",
    "make_group",
    "layer_kv",
    "layer_slot",
]


class KVViews(NamedTuple):
    """One buffer of every cache group (a call's prompt buffer, or its decode buffer), and where each
    model layer's KV is in them. A tuple, so that a compiled graph that reads it guards on its tensors and
    constants only."""

    buffers: tuple[Tensor, ...]  # one per group: [group layers, 2, rows, kv_heads, tokens, head_dim]
    slots: tuple[tuple[int, int] | None, ...]  # per model layer: (group, index in the group) of the KV it reads
    state_slots: tuple[tuple[int, int] | None, ...] = ()  # per model layer: the slot of its states (recurrent)

    @property
    def rows(self) -> int:
        return self.buffers[0].shape[2]

    @property
    def tokens(self) -> int:
        """The buffer's positions (every group's, full attention)."""
        return self.buffers[0].shape[4]

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def narrow_rows(self, start: int, length: int) -> KVViews:
        """Rows [start, start + length) of every group's buffer (views)."""
        return KVViews(tuple(b.narrow(2, start, length) for b in self.buffers), self.slots, self.state_slots)

    def clone(self) -> KVViews:
        return KVViews(tuple(b.clone() for b in self.buffers), self.slots, self.state_slots)


def layer_slot(views: KVViews, layer: int) -> tuple[Tensor, int]:
    """The whole buffer of the group that holds the KV `layer` reads, and its index in it (what a mutating
    operator takes: the whole buffer, the slicing inside the kernel)."""
    group, index = views.slots[layer]
    return views.buffers[group], index


def layer_kv(views: KVViews, layer: int) -> Tensor:
    """The KV `layer` reads: [2, rows, kv_heads, tokens, head_dim] (K at 0, V at 1)."""
    group, index = views.slots[layer]
    return views.buffers[group][index]


class CacheGroup:
    """The KV of a group of layers of one kind and one shape: its buffers, as views the cache carves out of
    its allocation (`torchkvops.rollout.kv_cache.RolloutKVCache`), and what its kind does to their rows.
    This class is full attention: every position of every row is kept."""

    kind = FULL_ATTENTION

    def __init__(self, spec: GroupSpec):
        assert spec.kind == self.kind, (spec.kind, self.kind)
        self.layers, self.shape, self.window = spec.layers, spec.shape, spec.window
        # One view per buffer of the layout: `home` where every row's KV stays after the call (for
        # Rollout.extend), `current` where decode writes and reads (a compacted batch's, or the home ones).
        self.home: list[Tensor] = []
        self.current: list[Tensor] = []
        # The paged layout: the group's KV is this pool ([group layers, 2, blocks, kv_heads, block_size,
        # head_dim], `paged_store`), its one buffer; rows move through their block tables, not their KV.
        self.pool: Tensor | None = None

    def __repr__(self) -> str:
        s = self.shape
        return f"{type(self).__name__}(layers={self.layers}, kv_heads={s.kv_heads}, head_dim={s.head_dim})"

    def buffer_shape(self, rows: int, tokens: int) -> tuple[int, ...]:
        """A buffer's shape in the cache's allocation (a paged group's KV is its pool, apart: none)."""
        return (0,) if self.pool is not None else self.shape.buffer_shape(rows, tokens)

    # The layout's first and last buffers (one and the same in the copy layout).
    @property
    def prompt_kv(self) -> Tensor | None:
        """Where prefill writes the prompts."""
        return self.current[0] if self.current else None

    @property
    def decode_kv(self) -> Tensor | None:
        """Where decode writes, and what its attention reads."""
        return self.current[-1] if self.current else None

    def gather(self, index: tuple[Tensor, ...], views: list[Tensor], written: int | None = None) -> None:
        """views[b][l] = current[b][l][:, index[b]] for each buffer b and layer l, in increasing b and l:
        the order in which they lie in the allocation (see RolloutKVCache.compact: an in-place gather reads
        each layer before anything overwrites it). `written`: the decode buffer's columns any row has
        written (None: all); only those are moved, so that a gather's cost follows what rows hold, not the
        buffer's budget-sized width (the columns after them are read by no row: see `_decode_columns`)."""
        if self.pool is not None:
            return  # the rows' tables move with the decode state; the KV stays in its blocks
        last = len(views) - 1
        for b, (src, rows, dst) in enumerate(zip(self.current, index, views)):
            src, dst = (_decode_columns(t, written) if b == last else t for t in (src, dst))
            for layer in range(src.shape[0]):
                dst[layer].copy_(src[layer].index_select(1, rows))

    def write_home(self, original: Tensor, written: int | None = None) -> None:
        """The current (work) rows' KV into their home rows (`original`: each one's home row), the first
        `written` columns (None: all). The prompts' KV never changes in decode."""
        if self.pool is not None:
            return
        home, work = (_decode_columns(t, written) for t in (self.home[-1], self.current[-1]))
        for layer in range(home.shape[0]):
            home[layer].index_copy_(1, original, work[layer])

    def expand_prompts(self, batch: int, repeats: int, num_tokens: int) -> None:
        """Rows [0, batch) of the prompts' buffer hold the prompts: make rows [0, batch*repeats) hold them,
        in repeat_interleave order, with one operator call over the group's every layer's K and V."""
        repeat_kv_cache_(self.current[0], batch, repeats, num_tokens)

    def check(self, key: Tensor, value: Tensor, layer: int) -> None:
        """A layer's K and V fit the group's buffers."""
        heads, head_dim = key.shape[1], key.shape[3]
        s = self.shape
        if (heads, head_dim) != (s.kv_heads, s.head_dim) or value.shape != key.shape:
            raise ValueError(
                f"torchkvops: layer {layer} produced keys {tuple(key.shape)} and values {tuple(value.shape)}, "
                f"but its KV buffer holds [rows, {s.kv_heads} kv_heads, tokens, {s.head_dim}]: models with "
                "other KV layouts are not supported"
            )


class RecurrentGroup(CacheGroup):
    """The states of a group of recurrent layers of one row layout (`recurrent.RowLayout`): each row's
    after its tokens so far, whatever their number. Prefill writes the prompts' rows of the first buffer;
    `expand_prompts` gives each prompt's state to its N rows."""

    kind = RECURRENT

    def __init__(self, spec: GroupSpec):
        super().__init__(spec)
        self.row_layout = None  # set by the cache, which knows its dtype

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={self.layers}, width={self.shape.head_dim})"

    def buffer_shape(self, rows: int, tokens: int) -> tuple[int, ...]:
        return (len(self.layers), 1, rows, 1, 1, self.shape.head_dim)

    def expand_prompts(self, batch: int, repeats: int, num_tokens: int) -> None:
        repeat_kv_cache_(self.current[0], batch, repeats, 1)

    def rows(self, views: KVViews, layer: int) -> Tensor:
        """`layer`'s states in one of the group's buffers (`views`): [rows, width]."""
        group, index = views.state_slots[layer]
        return views.buffers[group][index, 0, :, 0, 0]

    def check(self, key: Tensor, value: Tensor, layer: int) -> None:
        raise AssertionError(f"torchkvops: layer {layer} keeps states, not KV")


def _decode_columns(buffer: Tensor, written: int | None) -> Tensor:
    """The first `written` columns of a decode buffer [layers, 2, rows, kv_heads, columns, head_dim] (None:
    all). The columns after them hold another row's older KV (or zeros) once rows move: no row reads them
    (the decode attention reads each row's [kv_start, column], and the dense path masks the rest)."""
    return buffer if written is None else buffer[..., : min(written, buffer.shape[4]), :]


class SlidingWindowGroup(CacheGroup):
    """The KV of a group of sliding-window layers (`window`: the keys before its query a layer reads). The
    pool keeps its blocks in a window pool whose blocks go back as rows slide past them (`paged_store`)."""

    kind = SLIDING_WINDOW

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, window={self.window})"


# Each kind of group, by GroupSpec.kind.
GROUP_KINDS: dict[str, type[CacheGroup]] = {
    FULL_ATTENTION: CacheGroup,
    SLIDING_WINDOW: SlidingWindowGroup,
    RECURRENT: RecurrentGroup,
}


def make_group(spec: GroupSpec) -> CacheGroup:
    if spec.kind not in GROUP_KINDS:
        raise ValueError(f"torchkvops: no cache group of kind {spec.kind!r}; the rollout keeps {sorted(GROUP_KINDS)}")
    return GROUP_KINDS[spec.kind](spec)
