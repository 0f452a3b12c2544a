"""The rollout's KV cache: preallocated buffers reused across rollouts, presented to Hugging Face models
as a `Cache`.

Buffers are `[layers, 2, rows, kv_heads, tokens, head_dim]` (K at index 0, V at 1), so one
`repeat_kv_cache_` call expands every layer's prompt KV at once and one `write_kv_` call per layer
stores a step's K and V. Two layouts (`RolloutConfig.kv_sharing`):

- "copy": one buffer of B*N rows x (P + R - 1) positions. Prefill writes the B prompts into rows
  [0, B), `repeat_kv_cache_` copies each prompt to its N rows, decode appends at column P + step.
- "prefix": the B prompts' KV stays where prefill wrote it, once per prompt (`prompt_kv`, B rows x P
  positions), and each of the B*N rows owns only its response KV (`decode_kv`, R - 1 positions). The
  decode attention (`torchkvops.rollout.attention`) reads both and merges them; nothing is copied. A
  prefix common to every prompt, computed once (`torchkvops.rollout.prompts`), is kept once too
  (`common_kv`, one row), apart from the rest: compaction never moves it.

The cache keeps buffers; where a forward's K and V go and what its attention reads is that forward's own
metadata (`torchkvops.rollout.attention`: `PrefillForward`, `PackedAttention`, `DecodeAttention`), which
the caller binds (`bind`) before the model runs: `update` hands each layer's K and V to it.

All views are carved out of one flat allocation that is kept while it is big enough, and every view is
contiguous, so compiled graphs see the same strides for the same shapes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ..models.adapter import KVShape
from ..ops import repeat_kv_cache_
from .compaction import COMPACT_FRACTION

__all__ = ["RolloutKVCache", "KVShape"]


def _carve(
    storage: Tensor | None, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, list[Tensor]]:
    """Views of these shapes, one after the other from the start of `storage` (made, or made larger,
    when it is too small; callers drop their reference to a storage that is too small first, so that it
    is freed before the new one is made): (the storage, the views)."""
    sizes = [math.prod(s) for s in shapes]
    if storage is None or storage.numel() < sum(sizes):
        storage = torch.zeros(sum(sizes), dtype=dtype, device=device)
    views, offset = [], 0
    for shape, size in zip(shapes, sizes):
        views.append(storage[offset : offset + size].view(shape))
        offset += size
    return storage, views


def _gather_rows(src: Tensor, rows: Tensor, dst: Tensor) -> None:
    """dst[l] = src[l][:, rows] for every layer l, in increasing l (see RolloutKVCache.compact)."""
    for layer in range(src.shape[0]):
        dst[layer].copy_(src[layer].index_select(1, rows))


class RolloutKVCache(Cache):
    """Static KV buffers reused across rollouts; `prepare()` sizes them for a layout
    (torchkvops.rollout.layouts), `release()` frees them. The buffers are one per entry of the layout's
    `kv_lengths`: `prompt_kv` is the first and `decode_kv` the last (one and the same in the copy layout)."""

    def __init__(self, shape: KVShape, dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        self._storage: Tensor | None = None  # flat; the home views are carved out of it
        self._work: Tensor | None = None  # flat; a compacted batch's views are carved out of it
        self.layout = None  # the layout object the buffers are prepared for
        # Home views: every row of the call, where its KV stays after the call (for Rollout.extend); and
        # the current views: where decode writes and reads (a compacted batch's, or the home ones).
        self._home: list[Tensor] = []
        self._current: list[Tensor] = []
        # Prefix layout: the KV of a prefix common to every prompt, [layers, 2, 1, kv_heads, L', head_dim]
        # (None: none this call), in an allocation of its own, kept while it is big enough.
        self.common_kv: Tensor | None = None
        self._common_storage: Tensor | None = None
        self.forward = None  # the metadata of the forward running now (bind)
        self.work_used_bytes = 0  # the largest compacted batch's views since the home views were made

    @property
    def prompt_kv(self) -> Tensor | None:
        """Where prefill writes the prompts."""
        return self._current[0] if self._current else None

    @property
    def decode_kv(self) -> Tensor | None:
        """Where decode writes, and what its attention reads."""
        return self._current[-1] if self._current else None

    @property
    def home_prompt_kv(self) -> Tensor | None:
        return self._home[0] if self._home else None

    @property
    def home_decode_kv(self) -> Tensor | None:
        return self._home[-1] if self._home else None

    # --- buffer management ---------------------------------------------------------------------
    def prepare(self, layout, prompts: int, rows: int, lengths: tuple[int, ...], common: int = 0) -> None:
        """Buffers of `layout` for `prompts` prompts and `rows` rows, of `lengths` positions each
        ([layers, 2, rows of the buffer, kv_heads, positions, head_dim]), and `common` positions of a prefix
        common to every prompt kept once (`common_kv`; 0: none)."""
        shapes = [self.shape.buffer_shape(r, t) for r, t in zip(layout.buffer_rows(prompts, rows), lengths)]
        self._home = self._current = self._views(shapes)
        self.layout = layout
        self.common_kv = None
        if common:
            self._common_storage, (self.common_kv,) = _carve(
                self._common_storage, [self.shape.buffer_shape(1, common)], self.dtype, self.device
            )

    @property
    def compacted(self) -> bool:
        return bool(self._current) and self._current[-1] is not self._home[-1]

    def compact(self, rows: Tensor, prompts: Tensor | None, original: Tensor) -> None:
        """Decode goes on with the decode buffer's rows `rows` (int64, on the buffer's device) and, in the
        prefix layout, the prompts `prompts` only (torchkvops.rollout.compaction); `original` [current rows]
        is each current row's row in the home views.

        Every row's KV is kept for `Rollout.extend`: the compacted batch decodes in a second allocation
        (the work views), so the rows that leave stay in the home views. The first compaction gathers
        from home into the work views; a later one first writes the current rows home (the ones leaving
        would be overwritten), then gathers in place into smaller work views carved from the start of the
        same allocation: a smaller view's layer l ends where the current view's layer l + 1 begins or
        before, so no layer is overwritten before it is read (and the prompts, which come first, before
        the response KV). A compacted shape thus has the same addresses in every call (its CUDA graph
        replays)."""
        if self.compacted:
            self._write_home(original)
        self._current = self._gather(self._work_views, rows, prompts)

    def compact_in_place(self, rows: Tensor, prompts: Tensor | None = None) -> None:
        """Decode goes on with rows `rows` only (and in the prefix layout the prompts `prompts`), gathered
        in place into smaller views carved from the start of the same allocation (see compact()'s in-place
        case); what is left behind is not kept (a streaming batch's rows, copied out already)."""
        assert not self.compacted
        self._home = self._current = self._gather(self._views, rows, prompts)

    def _gather(self, carve, rows: Tensor, prompts: Tensor | None) -> list[Tensor]:
        """Each current view's kept rows (the layout's index for it), into views that `carve` makes."""
        index = self.layout.kv_index(rows, prompts)
        views = carve([self.shape.buffer_shape(i.numel(), v.shape[4]) for i, v in zip(index, self._current)])
        for src, i, dst in zip(self._current, index, views):
            _gather_rows(src, i, dst)
        return views

    def finish_decode(self, original: Tensor | None) -> None:
        """After decode: the rows of a compacted batch (`original`: each one's home row) back home, and the
        home views current again, so that every row's KV is where `Rollout.extend` looks for it."""
        if self.compacted:
            self._write_home(original)
        self._current = self._home

    def _write_home(self, original: Tensor) -> None:
        """The current (work) rows' KV into their home rows. The prompts' KV never changes in decode."""
        home, work = self._home[-1], self._current[-1]
        for layer in range(home.shape[0]):
            home[layer].index_copy_(1, original, work[layer])

    def grow(self, decode_tokens: int) -> None:
        """Home views with room for `decode_tokens` positions per row in the decode buffer (Rollout.extend:
        a longer history), their KV copied over. Not while compacted."""
        assert not self.compacted, "grow() runs on the home views"
        old, layout = self._home, self.layout
        if decode_tokens <= old[-1].shape[4]:
            return
        old_storage, self._storage = self._storage, None  # both live until the copy is done
        lengths = [v.shape[4] for v in old[:-1]] + [decode_tokens]
        self._home = self._current = self._views([self.shape.buffer_shape(v.shape[2], t) for v, t in zip(old, lengths)])
        self.layout = layout
        for src, dst in zip(old, self._home):
            dst[..., : src.shape[4], :].copy_(src)
        del old_storage

    def _views(self, shapes: list[tuple[int, ...]]) -> list[Tensor]:
        self.work_used_bytes = 0  # new home views: no compacted batch yet
        if self._storage is None or self._storage.numel() < sum(math.prod(s) for s in shapes):
            # Free the old allocation before making the new one (a common prefix's, apart, stays).
            self._storage = self._work = None
            self._home = self._current = []
        self._storage, views = _carve(self._storage, shapes, self.dtype, self.device)
        return views

    def _work_views(self, shapes: list[tuple[int, ...]]) -> list[Tensor]:
        if self._work is None or self._work.numel() < sum(math.prod(s) for s in shapes):
            # Made once for the largest compacted batch of these home views (every prompt, and
            # COMPACT_FRACTION of the rows), so that compacted shapes keep their addresses from call to
            # call; made only before a call's first compaction, which reads the home views only.
            rows = int(COMPACT_FRACTION * self._home[-1].shape[2])
            largest = [tuple(v.shape) for v in self._home[:-1]]
            largest.append(self.shape.buffer_shape(rows, self._home[-1].shape[4]))
            self._work = None
            self._work, _ = _carve(None, largest, self.dtype, self.device)
        views = _carve(self._work, shapes, self.dtype, self.device)[1]
        self.work_used_bytes = max(self.work_used_bytes, sum(v.numel() * v.element_size() for v in views))
        return views

    def release(self) -> None:
        """Free the buffers; the next `prepare()` allocates new ones."""
        self._storage = self._work = self.layout = None
        self._home = self._current = []
        self.common_kv = self._common_storage = None
        self.forward = None

    @property
    def allocated_bytes(self) -> int:
        return sum(0 if s is None else s.numel() * s.element_size() for s in (self._storage, self._work))

    @property
    def used_bytes(self) -> int:
        """Bytes of KV storage the home views and the largest compacted batch use (the allocations may
        be larger, from an earlier call)."""
        common = 0 if self.common_kv is None else self.common_kv.numel() * self.common_kv.element_size()
        return sum(v.numel() * v.element_size() for v in self._home) + self.work_used_bytes + common

    def bind(self, forward) -> None:
        """The metadata of the forward about to run (what `update` hands each layer's K and V to)."""
        self.forward = forward

    def expand_prompts(self, batch: int, repeats: int, num_tokens: int) -> None:
        """Copy layout: rows [0, batch) hold the prompts; make rows [0, batch*repeats) hold them, in
        repeat_interleave order, with one operator call over every layer's K and V."""
        repeat_kv_cache_(self.prompt_kv, batch, repeats, num_tokens)

    # --- the transformers Cache interface ------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Hand a layer's K and V to the bound forward: it writes them where they go and returns what the
        model's attention reads."""
        return self.forward.write(self, key_states, value_states, layer_idx)

    def check_layout(self, key_states: Tensor, value_states: Tensor, layer_idx: int) -> None:
        """A layer's K and V fit the buffers (made once per forward before decode, which skips it)."""
        kv = self.prompt_kv
        heads, head_dim = key_states.shape[1], key_states.shape[3]
        if (heads, head_dim) != (kv.shape[3], kv.shape[5]) or value_states.shape != key_states.shape:
            raise ValueError(
                f"torchkvops: layer {layer_idx} produced keys {tuple(key_states.shape)} and values "
                f"{tuple(value_states.shape)}, but the KV buffer holds [rows, {kv.shape[3]} kv_heads, "
                f"tokens, {kv.shape[5]}]: models with other KV layouts are not supported"
            )

    def get_seq_length(self, layer_idx: int = 0):
        return 0 if self.forward is None else self.forward.seq_length()

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """Asked only when the model builds its own mask, which happens in an unpadded prefill (decode
        always passes its own 4-D mask): keys are then exactly the prompt's positions."""
        return int(query_length), 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1 if self.decode_kv is None else self.decode_kv.shape[4]

    def __len__(self) -> int:
        return self.shape.layers

    @property
    def is_compileable(self) -> bool:
        return True

    # Per-layer kinds that transformers' mask builders read: every layer is plain full attention.
    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.shape.layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.shape.layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.shape.layers
