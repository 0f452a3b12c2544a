"""The rollout's KV cache: one preallocated buffer, presented to Hugging Face models as a `Cache`.

The buffer is `[layers, 2, rows, kv_heads, max_len, head_dim]` (K at index 0, V at 1), so one call of
`repeat_kv_cache_` expands every layer's prompt KV at once. Compiled graphs only ever see the whole
buffer as an input and take their per-layer views inside the graph: separate view inputs that alias
one storage would make AOTAutograd build a synthetic base and copy it.

Two phases, chosen by the caller:
- prefill: the prompt's K/V (positions [0, P)) are written into the first rows, and attention uses
  those K/V directly (no padding to max_len);
- decode: each step writes one position at `write_pos` for every row, and attention reads the
  whole, statically shaped [rows, kv_heads, max_len, head_dim] view, masked by the caller.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from .ops import repeat_kv_cache_, write_kv_

__all__ = ["RolloutKVCache", "KVShape"]


class KVShape:
    """Layers, KV heads and head size of a model's attention, read from its config."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim

    @classmethod
    def from_config(cls, config) -> "KVShape":
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, kv_heads, head_dim)


class RolloutKVCache(Cache):
    """A static KV buffer reused across rollouts; `prepare()` sizes it, `release()` frees it."""

    def __init__(self, shape: KVShape, dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        self._storage: Tensor | None = None  # the allocation, possibly larger than the current view
        self.kv: Tensor | None = None  # [layers, 2, rows, kv_heads, max_len, head_dim] view in use
        # Where the next decode step writes; a tensor so that compiled decode never recompiles on it.
        self.write_pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self._prefill_start = torch.zeros(1, dtype=torch.long, device=self.device)
        self.decoding = False
        torch._dynamo.mark_static_address(self.write_pos)
        torch._dynamo.mark_static_address(self._prefill_start)

    # --- buffer management ---------------------------------------------------------------------
    def prepare(self, rows: int, max_len: int) -> None:
        """Make `kv` a [layers, 2, rows, kv_heads, max_len, head_dim] view, reusing the allocation
        when it is big enough. Reusing the same view object keeps compiled graphs' guards stable."""
        s = self.shape
        if self.kv is not None and self.kv.shape[2] == rows and self.kv.shape[4] == max_len:
            return
        if self._storage is None or self._storage.shape[2] < rows or self._storage.shape[4] < max_len:
            self._storage = None  # free the old one before allocating the new
            self.kv = None
            self._storage = torch.zeros(
                (s.layers, 2, rows, s.kv_heads, max_len, s.head_dim), dtype=self.dtype, device=self.device
            )
            torch._dynamo.mark_static_address(self._storage)
        self.kv = self._storage[:, :, :rows, :, :max_len]
        torch._dynamo.mark_static_address(self.kv)

    def release(self) -> None:
        """Free the buffer; the next `prepare()` allocates a new one."""
        self._storage = None
        self.kv = None

    @property
    def allocated_bytes(self) -> int:
        return 0 if self._storage is None else self._storage.numel() * self._storage.element_size()

    # --- phases --------------------------------------------------------------------------------
    def start_prefill(self) -> None:
        self.decoding = False

    def start_decode(self, first_position: int) -> None:
        self.decoding = True
        self.write_pos.fill_(first_position)

    def expand_prompts(self, batch: int, repeats: int, num_tokens: int) -> None:
        """Rows [0, batch) hold the prompts; make rows [0, batch*repeats) hold them, in
        repeat_interleave order, with one operator call over every layer's K and V."""
        repeat_kv_cache_(self.kv, batch, repeats, num_tokens)

    # --- the transformers Cache interface ------------------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        kv = self.kv
        rows, heads, q_len, head_dim = key_states.shape
        if (heads, head_dim) != (kv.shape[3], kv.shape[5]) or value_states.shape != key_states.shape:
            raise ValueError(
                f"torchkvops: layer {layer_idx} produced keys {tuple(key_states.shape)} and values "
                f"{tuple(value_states.shape)}, but the KV buffer holds [rows, {kv.shape[3]} kv_heads, "
                f"tokens, {kv.shape[5]}]: models with other KV layouts are not supported"
            )
        if not self.decoding:
            # Prefill writes positions [0, P) and attends to exactly those, no padding to max_len.
            write_kv_(kv, key_states, value_states, layer_idx, self._prefill_start)
            return key_states, value_states
        write_kv_(kv, key_states, value_states, layer_idx, self.write_pos)
        return kv[layer_idx, 0], kv[layer_idx, 1]

    def get_seq_length(self, layer_idx: int = 0):
        return self.write_pos[0] if self.decoding else 0

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """Asked only when the model builds its own mask, which happens in an unpadded prefill (decode
        always passes its own 4-D mask): keys are then exactly the prompt's positions."""
        return int(query_length), 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1 if self.kv is None else self.kv.shape[4]

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
