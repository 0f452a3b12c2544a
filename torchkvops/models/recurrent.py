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

A packed forward (the rollout's turns, the training forward's groups) runs a recurrent layer's own forward
segment by segment: `recurrent_mixers` finds each recurrent layer's module, and `SegmentStates` is the same
cache interface over one segment's rows, from given states (or none) to the final ones.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .families import RECURRENT_LAYER_TYPES

__all__ = [
    "StateField",
    "RowLayout",
    "LayerStates",
    "probe_states",
    "RecurrentStates",
    "SegmentStates",
    "kept_window",
    "recurrent_mixers",
    "own_forward",
    "restore_forward",
    "RECURRENT_CACHE_METHODS",
    "recurrent_cache_unsupported",
]


_ALIGN_BYTES = 16

# The cache methods through which transformers' recurrent layers read and write their states: the
# interface `SegmentStates` and the rollout's cache implement (transformers 5.25's). Earlier releases'
# layers call others, which these would not answer: 5.17-5.20 ask `has_previous_state` and read the cache
# layers' tensors, 5.21-5.24 lack the last two.
RECURRENT_CACHE_METHODS = (
    "get_conv_state",
    "update_conv_state",
    "get_recurrent_state",
    "update_recurrent_state",
    "is_recording_past",
    "get_recurrent_states_to_keep",
    "increase_count",
)


def recurrent_cache_unsupported() -> str | None:
    """Why this transformers' recurrent layers cannot be served (they call another cache interface than
    `RECURRENT_CACHE_METHODS`), naming its version; None when they can. The one check of that interface:
    the rollout's probe, the packed forwards and the tests ask it."""
    import transformers
    from transformers import Cache

    missing = [name for name in RECURRENT_CACHE_METHODS if not callable(getattr(Cache, name, None))]
    if not missing:
        return None
    return (
        f"transformers {transformers.__version__}'s recurrent layers keep their states through another cache "
        f"interface than the one torchkvops implements (its Cache has no {', '.join(missing)}): hybrid models "
        "need transformers >= 5.25"
    )


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
        self.places: dict[tuple[str, int], tuple[StateField, int, int]] = {}  # -> (field, offset, size)
        offset = 0
        for f in fields:
            size = math.prod(f.shape) * f.dtype.itemsize
            if size % unit:
                raise ValueError(f"torchkvops: a {f.dtype} state of {f.shape} does not fill whole {dtype} elements")
            self.places[(f.kind, f.index)] = (f, offset, size // unit)
            offset += -(-(size // unit) // step) * step
        self.width = max(offset, step)

    def view(self, rows: Tensor, kind: str, index: int) -> Tensor | None:
        """The field (`kind`, `index`) of `rows` ([rows, width], the cache's dtype) as [rows, *shape] in
        its own dtype (a view: writes go to the rows), or None when the layer keeps no such field."""
        place = self.places.get((kind, index))
        if place is None:
            return None
        field, offset, size = place
        return rows[:, offset : offset + size].view(field.dtype).view(rows.shape[0], *field.shape)


def probe_states(model: nn.Module, cache_kwarg: str, device: torch.device) -> dict[int, LayerStates]:
    """Every layer's states, from one forward of the model over two tokens with transformers' DynamicCache
    (under no_grad; the model's weights and mode are left as they are). Raises ValueError naming what is
    missing when this transformers gives the model's recurrent layers no cache states to read."""
    unsupported = recurrent_cache_unsupported()
    if unsupported:
        raise ValueError(f"torchkvops: {unsupported}")
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

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


class RecurrentStates:
    """transformers' recurrent-state cache interface (`RECURRENT_CACHE_METHODS`), the one torchkvops
    implements, twice, over two kinds of storage: `SegmentStates` (one segment's states as tensors that carry
    gradients: the training forward's segments, a packed forward's rows) and the rollout's cache
    (`rollout.kv_cache.RolloutKVCache`: every row's states in a buffer, started by a prefill and continued
    in place by decode). A layer reads a state before its tokens (`get_*`: None when it starts from
    none) and hands over what it leaves after them (`update_*`); the rest is alike in both, here."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        """The convolution window the layer continues from ([rows, channels, width]), or None."""
        raise NotImplementedError

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        """The recurrent state the layer continues from, or None."""
        raise NotImplementedError

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        """The convolution's input `conv_states` ([rows, channels, tokens]): keep its window (`kept_window`)
        and return what the convolution runs over."""
        raise NotImplementedError

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        """The state the layer leaves after its tokens: keep it and return it."""
        raise NotImplementedError

    def is_recording_past(self, layer_idx: int) -> bool:
        return False  # (no speculative decoding: states are never rolled back)

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        """(transformers counts tokens per recurrent layer; torchkvops' lengths are its forwards'.)"""


def kept_window(conv_input: Tensor, width: int) -> Tensor:
    """The convolution window a layer keeps after `conv_input` ([rows, channels, tokens]): its last `width`
    columns, zeros before a shorter input, as transformers' cache keeps it."""
    kept = conv_input[..., -width:]
    return F.pad(kept, (width - kept.shape[-1], 0))


class SegmentStates(RecurrentStates):
    """`RecurrentStates` for one segment of rows of one layer: `initial`
    ((kind, state_idx) -> [rows, ...]: the states the rows continue from; empty: none, the layer starts
    them), and `final`, what the layer leaves at the segment's end (the states the next segment continues
    from). Tensors, not buffers: gradients flow through them."""

    def __init__(self, initial: dict[tuple[str, int], Tensor] | None = None, windows_in_place: bool = False):
        self.initial = initial or {}
        self.final: dict[tuple[str, int], Tensor] = {}
        # A one-token segment takes the layers' decode step, which updates the window it is given in place:
        # with `windows_in_place` (no autograd: the rollout's turns) that window is the final one unless
        # update_conv_state says otherwise; without, a copy (the training forward pads such segments).
        self.windows_in_place = windows_in_place

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        state = self.initial.get(("conv", state_idx))
        if state is None:
            return None
        window = state.clone()
        if self.windows_in_place:
            self.final[("conv", state_idx)] = window
        return window

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self.initial.get(("recurrent", state_idx))

    def update_conv_state(
        self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs
    ) -> Tensor:
        """The convolution's input to run over: the window before the segment, then `conv_states` ([rows,
        channels, tokens]); its last `conv_kernel_size` columns (zeros before a shorter input) are kept."""
        previous = self.initial.get(("conv", state_idx))
        full = conv_states if previous is None else torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        width = conv_kernel_size if conv_kernel_size is not None else previous.shape[-1]
        self.final[("conv", state_idx)] = kept_window(full, width)
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        if not isinstance(recurrent_states, Tensor):  # intermediate states were asked for: the last one
            recurrent_states = recurrent_states[-1]
        self.final[("recurrent", state_idx)] = recurrent_states
        return recurrent_states


def recurrent_mixers(backbone: nn.Module) -> dict[int, nn.Module]:
    """layer index -> the module that keeps that recurrent layer's states (a Gated DeltaNet, a Mamba2
    mixer, a short convolution: a module with a `layer_idx` whose forward takes (hidden_states, cache,
    attention_mask)), for every layer whose kind (config.layer_types) is recurrent. Raises ValueError
    when a recurrent layer has none, or more than one, or this transformers' layers call another cache
    interface (`recurrent_cache_unsupported`)."""
    kinds = getattr(backbone.config, "layer_types", None) or []
    wanted = {i for i, kind in enumerate(kinds) if kind in RECURRENT_LAYER_TYPES}
    unsupported = recurrent_cache_unsupported() if wanted else None
    if unsupported:
        raise ValueError(f"torchkvops: {unsupported}")
    found: dict[int, list[nn.Module]] = {}
    for module in backbone.modules():
        layer = getattr(module, "layer_idx", None)
        if layer in wanted and not type(module).__name__.endswith("Attention") and _takes_states(type(module)):
            found.setdefault(layer, []).append(module)
    for layer, modules in found.items():  # the innermost (a decoder block may take the same arguments)
        found[layer] = [m for m in modules if not any(o is not m and o in set(m.modules()) for o in modules)]
    odd = sorted(i for i in wanted if len(found.get(i, ())) != 1)
    if odd:
        raise ValueError(
            f"torchkvops: recurrent layers {odd} of {type(backbone).__name__} have no single module that "
            "keeps their states (a forward taking hidden_states, cache and attention_mask)"
        )
    return {i: found[i][0] for i in sorted(wanted)}


def own_forward(module: nn.Module, previous):
    """What a patched module's forward calls: the instance-level forward it had before the patch
    (`previous`), else its class's."""
    return previous if previous is not None else functools.partial(type(module).forward, module)


def restore_forward(module: nn.Module, previous) -> None:
    """Undo an instance-level forward patch: `previous` back, or none (the class's) when there was none."""
    if previous is not None:
        module.forward = previous
    elif "forward" in vars(module):  # (transformers' kernelize may have dropped the patch already)
        del module.forward


@functools.cache
def _takes_states(cls: type) -> bool:
    names = list(inspect.signature(cls.forward).parameters)[1:4]
    return names == ["hidden_states", "cache", "attention_mask"]
