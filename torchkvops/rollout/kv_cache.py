"""The rollout's KV cache: preallocated buffers reused across rollouts, presented to Hugging Face models
as a `Cache`.

Buffers are `[layers, 2, rows, kv_heads, tokens, head_dim]` (K at index 0, V at 1), so one
`repeat_kv_cache_` call expands every layer's prompt KV at once and one `write_kv_` call per layer
stores a step's K and V. Two layouts (`RolloutConfig.kv_sharing`):

- "copy": one buffer of B*N rows x (P + R - 1) positions. Prefill writes the B prompts into rows
  [0, B), `repeat_kv_cache_` copies each prompt to its N rows, decode appends at column P + step.
- "prefix": the B prompts' KV stays where prefill wrote it, once per prompt (`prefix_kv`, B rows x P
  positions), and each of the B*N rows owns only its response KV (`suffix_kv`, R - 1 positions). The
  decode attention (`torchkvops.attention`) reads both and merges them; nothing is copied.

Two phases, chosen by the caller:
- prefill: the prompt's K/V (positions [0, P)) go into the prompt rows, and attention uses those K/V
  directly (no padding to the buffer's length);
- decode: each step writes one position at `write_pos` for every row, and attention reads the whole,
  statically shaped decode buffer of that layer, masked by the caller.

All views are carved out of one flat allocation that is kept while it is big enough, and every view is
contiguous, so compiled graphs see the same strides for the same shapes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ..hf.adapter import KVShape
from ..ops import repeat_kv_cache_, write_kv_

__all__ = ["RolloutKVCache", "KVShape", "KV_LAYOUTS"]

KV_LAYOUTS = ("copy", "prefix")


def _gather_rows(src: Tensor, rows: Tensor, dst: Tensor) -> None:
    """dst[l] = src[l][:, rows] for every layer l, in increasing l (see RolloutKVCache.compact)."""
    for layer in range(src.shape[0]):
        dst[layer].copy_(src[layer].index_select(1, rows))


class RolloutKVCache(Cache):
    """Static KV buffers reused across rollouts; `prepare_copy()` / `prepare_prefix()` size them,
    `release()` frees them."""

    def __init__(self, shape: KVShape, dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        self._storage: Tensor | None = None  # flat; the views below are carved out of it
        self.layout: str | None = None
        self.prompt_kv: Tensor | None = None  # where prefill writes the prompts
        self.decode_kv: Tensor | None = None  # where decode writes, and what its attention reads
        # Where the next decode step writes; a tensor, so that graphs never re-specialize on it.
        self.write_pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self._prefill_start = torch.zeros(1, dtype=torch.long, device=self.device)
        self.decoding = False

    # --- buffer management ---------------------------------------------------------------------
    def prepare_copy(self, rows: int, tokens: int) -> None:
        """One [layers, 2, rows, kv_heads, tokens, head_dim] buffer for prefill and decode."""
        (kv,) = self._views([self.shape.buffer_shape(rows, tokens)])
        self.layout, self.prompt_kv, self.decode_kv = "copy", kv, kv

    def prepare_prefix(self, prompts: int, prompt_tokens: int, rows: int, response_tokens: int) -> None:
        """The prompts' KV once ([..., prompts, ..., prompt_tokens, ...]) and each row's response KV
        ([..., rows, ..., response_tokens, ...])."""
        prefix, suffix = self._views(
            [self.shape.buffer_shape(prompts, prompt_tokens), self.shape.buffer_shape(rows, response_tokens)]
        )
        self.layout, self.prompt_kv, self.decode_kv = "prefix", prefix, suffix

    def compact(self, rows: Tensor, prompts: Tensor | None = None) -> None:
        """Decode goes on with the decode buffer's rows `rows` (int64, on the buffer's device) and, in the
        prefix layout, the prompts `prompts` only (torchkvops.compaction). They are gathered in place into
        smaller views carved from the start of the same allocation, as `prepare_*` carves them, so that a
        compacted shape has the same addresses in every call (and its CUDA graph replays). Each layer is
        gathered into a temporary and copied to its place, layer after layer: a smaller view's layer l
        ends where the current view's layer l + 1 begins or before, so no layer is overwritten before it
        is read (and the prompts, which come first, before the response KV)."""
        if self.layout == "copy":
            (kv,) = self._views([self.shape.buffer_shape(rows.numel(), self.decode_kv.shape[4])])
            _gather_rows(self.decode_kv, rows, kv)
            self.prompt_kv = self.decode_kv = kv
            return
        prefix, suffix = self._views(
            [
                self.shape.buffer_shape(prompts.numel(), self.prompt_kv.shape[4]),
                self.shape.buffer_shape(rows.numel(), self.decode_kv.shape[4]),
            ]
        )
        _gather_rows(self.prompt_kv, prompts, prefix)
        _gather_rows(self.decode_kv, rows, suffix)
        self.prompt_kv, self.decode_kv = prefix, suffix

    def _views(self, shapes: list[tuple[int, ...]]) -> list[Tensor]:
        sizes = [math.prod(s) for s in shapes]
        if self._storage is None or self._storage.numel() < sum(sizes):
            self.release()  # free the old allocation before making the new one
            self._storage = torch.zeros(sum(sizes), dtype=self.dtype, device=self.device)
        views, offset = [], 0
        for shape, size in zip(shapes, sizes):
            views.append(self._storage[offset : offset + size].view(shape))
            offset += size
        return views

    def release(self) -> None:
        """Free the buffers; the next `prepare_*()` allocates new ones."""
        self._storage = self.prompt_kv = self.decode_kv = self.layout = None
        # Made anew (see Rollout.release: a caller's inference_mode may have made these).
        self.write_pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self._prefill_start = torch.zeros(1, dtype=torch.long, device=self.device)

    @property
    def allocated_bytes(self) -> int:
        return 0 if self._storage is None else self._storage.numel() * self._storage.element_size()

    @property
    def used_bytes(self) -> int:
        """Bytes of KV storage the current layout uses (the allocation may be larger, from an earlier call)."""
        views = [] if self.layout is None else [self.prompt_kv] + ([self.decode_kv] if self.layout == "prefix" else [])
        return sum(v.numel() * v.element_size() for v in views)

    # --- phases --------------------------------------------------------------------------------
    def start_prefill(self) -> None:
        self.decoding = False

    def start_decode(self, first_position: int) -> None:
        self.decoding = True
        self.write_pos.fill_(first_position)

    def expand_prompts(self, batch: int, repeats: int, num_tokens: int) -> None:
        """Copy layout: rows [0, batch) hold the prompts; make rows [0, batch*repeats) hold them, in
        repeat_interleave order, with one operator call over every layer's K and V."""
        repeat_kv_cache_(self.prompt_kv, batch, repeats, num_tokens)

    # --- the transformers Cache interface ------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if not self.decoding:
            self._check_layout(key_states, value_states, layer_idx)
            # Prefill writes positions [0, P) and attends to exactly those, no padding to the buffer.
            write_kv_(self.prompt_kv, key_states, value_states, layer_idx, self._prefill_start)
            return key_states, value_states
        # Decode: no Python checks here (prefill made them for this model): a step is what a graph replays.
        kv = self.decode_kv
        write_kv_(kv, key_states, value_states, layer_idx, self.write_pos)
        return kv[layer_idx, 0], kv[layer_idx, 1]

    def _check_layout(self, key_states: Tensor, value_states: Tensor, layer_idx: int) -> None:
        kv = self.prompt_kv
        heads, head_dim = key_states.shape[1], key_states.shape[3]
        if (heads, head_dim) != (kv.shape[3], kv.shape[5]) or value_states.shape != key_states.shape:
            raise ValueError(
                f"torchkvops: layer {layer_idx} produced keys {tuple(key_states.shape)} and values "
                f"{tuple(value_states.shape)}, but the KV buffer holds [rows, {kv.shape[3]} kv_heads, "
                f"tokens, {kv.shape[5]}]: models with other KV layouts are not supported"
            )

    def get_seq_length(self, layer_idx: int = 0):
        return self.write_pos[0] if self.decoding else 0

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
