"""Layers with recurrent state (Gated DeltaNet, Mamba2, gated short convolutions): what each keeps per row,
read from the model itself.

transformers 5 gives every such layer one cache interface (`Cache.get_conv_state`, `update_conv_state`,
`get_recurrent_state`, `update_recurrent_state`, backed by `LinearAttentionCacheLayerMixin` layers): a
convolution window and, for Gated DeltaNet and Mamba2, a recurrent state, each of a fixed size per row
whatever the sequence's length. `probe_states` runs the model once over two tokens with transformers' own
`DynamicCache` and reads the size and dtype of every state it filled, so that no family's layer needs a
table of its own here.

The rollout keeps a layer's states in one row of its cache group (`torchkvops.rollout.cache_groups`):
`RowLayout` lays the fields out one after the other in the cache's dtype (a float32 state in a bfloat16
cache takes two elements per value), each field starting on a 16-byte boundary so that it can be viewed in
its own dtype.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

__all__ = ["StateField", "RowLayout", "LayerStates", "probe_states", "RECURRENT_LAYER_TYPES"]

# The layer kinds (config.layer_types) whose layers keep recurrent state instead of (or, "hybrid": beside)
# a KV cache, and those that keep nothing (Nemotron-H's MLP and MoE blocks).
RECURRENT_LAYER_TYPES = {"linear_attention", "mamba", "conv", "hybrid"}
STATELESS_LAYER_TYPES = {"mlp", "moe"}

_ALIGN_BYTES = 16


@dataclasses.dataclass(frozen=True)
class StateField:
    """One state a layer keeps per row: `kind` "conv" (a convolution window) or "recurrent", its
    `index` (transformers' state_idx), its per-row shape and its dtype."""

    kind: str
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class LayerStates:
    """What the probe found a layer keeps: its states, and whether it keeps a KV cache too."""

    fields: tuple[StateField, ...]
    has_kv: bool


class RowLayout:
    """Where each of a layer's fields lies in one row of `width` elements of `dtype` (module docstring)."""

    def __init__(self, fields: tuple[StateField, ...], dtype: torch.dtype):
        self.fields, self.dtype = fields, dtype
        unit = dtype.itemsize
        step = _ALIGN_BYTES // unit
        self.offsets: dict[tuple[str, int], tuple[int, int]] = {}
        offset = 0
        for f in fields:
            size = math.prod(f.shape) * f.dtype.itemsize
            if size % unit:
                raise ValueError(f"torchkvops: a {f.dtype} state of {f.shape} does not fill whole {dtype} elements")
            self.offsets[(f.kind, f.index)] = (offset, size // unit)
            offset += -(-(size // unit) // step) * step
        self.width = max(offset, step)

    def view(self, rows: Tensor, kind: str, index: int) -> Tensor | None:
        """The field (`kind`, `index`) of `rows` ([rows, width], the cache's dtype) as [rows, *shape] in
        its own dtype (a view: writes go to the rows), or None when the layer keeps no such field."""
        where = self.offsets.get((kind, index))
        if where is None:
            return None
        field = next(f for f in self.fields if (f.kind, f.index) == (kind, index))
        offset, size = where
        return rows[:, offset : offset + size].view(field.dtype).view(rows.shape[0], *field.shape)


def probe_states(model: nn.Module, cache_kwarg: str, device: torch.device) -> dict[int, LayerStates]:
    """Every layer's states, from one forward of the model over two tokens with transformers' DynamicCache
    (under no_grad; the model's weights and mode are left as they are). Raises ValueError naming what is
    missing when this transformers gives the model's recurrent layers no cache states to read."""
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError as e:  # an older transformers: its hybrid models keep states their own way
        raise ValueError(
            "torchkvops: this transformers has no LinearAttentionCacheLayerMixin cache layers, through which "
            "the rollout reads recurrent layers' states (transformers >= 5.25)"
        ) from e
    cache = DynamicCache(config=model.config)
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg: cache}, use_cache=True)
    found = {}
    for layer, kept in enumerate(cache.layers):
        fields = []
        if isinstance(kept, LinearAttentionCacheLayerMixin):
            for i in range(kept.number_of_states):
                for kind, states in (("conv", kept.conv_states), ("recurrent", kept.recurrent_states)):
                    state = states.get(i)
                    if state is not None:
                        fields.append(StateField(kind, i, tuple(state.shape[1:]), state.dtype))
        has_kv = getattr(kept, "keys", None) is not None and getattr(kept, "keys").numel() > 0
        found[layer] = LayerStates(tuple(fields), has_kv)
    return found
