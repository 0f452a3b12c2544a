"""What the rollout needs to know about a Hugging Face causal LM, and the checks that refuse models it
cannot run correctly. Works with transformers 5.x, whose cache argument is `cache` in newer releases
and `past_key_values` in older ones."""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from . import sharding
from .families import (
    ATTENTION_KINDS,
    ATTENTION_LAYER_TYPES,
    FULL_ATTENTION,
    LAYER_KINDS,
    RECURRENT,
    RECURRENT_LAYER_TYPES,
    REFUSED_CONFIG_FIELDS,
    SLIDING_WINDOW,
    STATELESS_LAYER_TYPES,
    family_of,
)
from .precision import compute_dtype
from .recurrent import RowLayout, probe_states

__all__ = [
    "ModelAdapter",
    "KVShape",
    "GroupSpec",
    "CacheSpec",
    "model_state",
    "unwrap_model",
    "is_peft_model",
]

# The parameter dtypes the rollout computes in (those its sampling operator takes logits in).
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Attention implementations that take an arbitrary 4-D mask as we build it: SDPA a boolean one
# (True = may attend), eager an additive one.
_MASK_FORMATS = {"sdpa": "bool", "eager": "additive"}


class KVShape:
    """Layers, KV heads and head size of a model's attention, read from its config."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim

    @classmethod
    def from_config(cls, config) -> KVShape:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, kv_heads, head_dim)

    def buffer_shape(self, rows: int, tokens: int) -> tuple[int, ...]:
        return (self.layers, 2, rows, self.kv_heads, tokens, self.head_dim)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Layers whose KV (or, kind RECURRENT, states) one cache group stores: one kind, one number of KV heads
    and head size; a recurrent group's `state_fields` (the fields of each layer's row, `recurrent.StateField`)
    take `head_dim` elements of the cache's dtype per row (`recurrent.RowLayout.width`) and one KV head."""

    kind: str
    layers: tuple[int, ...]  # the model layers, in order
    kv_heads: int
    head_dim: int
    state_fields: tuple = ()  # RECURRENT: the StateFields of each layer's row
    window: int | None = None  # SLIDING_WINDOW: the keys before the query its layers read

    def __post_init__(self):
        if (self.kind == SLIDING_WINDOW) != (self.window is not None):
            raise ValueError(
                f"torchkvops: a {self.kind} cache group with window {self.window}: only a sliding one has one"
            )

    @property
    def shape(self) -> KVShape:
        return KVShape(len(self.layers), self.kv_heads, self.head_dim)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What the rollout's KV cache holds for a model: its cache groups, and which layer's KV each layer's
    attention reads (`reads[l]`: l itself, whose KV its group stores; an earlier layer whose KV it shares,
    as gemma3n's `kv_sharing_modes` say: such a layer is in no attention group and writes no KV; or None:
    a layer without attention). A recurrent layer's states are in one RECURRENT group (a hybrid layer's
    too, besides its KV)."""

    groups: tuple[GroupSpec, ...]
    reads: tuple[int | None, ...]  # one entry per model layer

    def __post_init__(self):
        for kinds in (ATTENTION_KINDS, (RECURRENT,)):
            stored = [layer for group in self.groups if group.kind in kinds for layer in group.layers]
            if len(set(stored)) != len(stored):
                raise ValueError(f"torchkvops: a layer is in two cache groups of one kind: {self.groups}")
        stored = {layer for group in self.groups if group.kind in ATTENTION_KINDS for layer in group.layers}
        for layer, source in enumerate(self.reads):
            if source is None:
                if layer in stored:
                    raise ValueError(f"torchkvops: layer {layer} has no attention, but a cache group stores its KV")
                continue
            if (source == layer) != (layer in stored) or source not in stored:
                raise ValueError(
                    f"torchkvops: layer {layer} reads layer {source}'s KV, but the cache groups store "
                    f"layers {sorted(stored)}: a layer stores its own KV or reads a stored layer's"
                )
        # Attention groups first: the buffers' shared properties (positions, device) are read off group 0.
        kinds = [group.kind for group in self.groups]
        if kinds and kinds[0] not in ATTENTION_KINDS or kinds != sorted(kinds, key=lambda k: k == RECURRENT):
            raise ValueError(f"torchkvops: the attention cache groups come before the recurrent ones: {self.groups}")

    @classmethod
    def single(cls, shape: KVShape) -> CacheSpec:
        """One full-attention group of every layer."""
        layers = tuple(range(shape.layers))
        return cls((GroupSpec(FULL_ATTENTION, layers, shape.kv_heads, shape.head_dim),), layers)

    @classmethod
    def from_config(cls, config, states: dict | None = None, dtype: torch.dtype | None = None) -> CacheSpec:
        """The cache groups a model's config asks for: the one place a new kind of layer adds its groups.
        Attention layers: one group per KV shape (per-layer head sizes and KV heads, as gemma4's
        heterogeneous config gives them, make several), of the layers that compute their own KV. A layer
        that reuses an earlier layer's (gemma3n's and gemma4's `kv_sharing_modes`: "reuse" layers read the
        K and V of the last "store" layer of their own layer type) stores none and reads that layer's.
        Recurrent layers (`states`: `recurrent.probe_states` of the model, layer -> LayerStates; None: a
        model of attention layers only): one RECURRENT group per row layout in `dtype`, the cache's."""
        shapes = _layer_shapes(config)
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * len(shapes)
        modes = _kv_sharing_modes(config, kinds) or ["own"] * len(shapes)
        reads, last_store = [], {}
        for layer, mode in enumerate(modes):
            if states is not None and not states[layer].has_kv:
                reads.append(None)
                continue
            if mode != "reuse":
                reads.append(layer)
                if mode == "store":
                    last_store[kinds[layer]] = layer
                continue
            if kinds[layer] not in last_store:
                raise ValueError(
                    f"torchkvops: layer {layer} reuses the KV of an earlier {kinds[layer]} layer, but none stores it"
                )
            reads.append(last_store[kinds[layer]])
        # One group per KV shape and window: sliding-window layers (layer_types' "sliding_attention", as the
        # models' own attention reads them) apart from full-attention ones, whose keys are all kept.
        window = sliding_window(config)
        by_shape: dict[tuple[int, int, int | None], list[int]] = {}
        for layer, source in enumerate(reads):
            if source == layer:
                slides = window if LAYER_KINDS[kinds[layer]] == SLIDING_WINDOW else None
                by_shape.setdefault((*shapes[layer], slides), []).append(layer)
        groups = [
            GroupSpec(
                FULL_ATTENTION if slides is None else SLIDING_WINDOW, tuple(layers), kv_heads, head_dim, window=slides
            )
            for (kv_heads, head_dim, slides), layers in by_shape.items()
        ]
        by_row: dict[tuple, list[int]] = {}
        for layer, kept in sorted((states or {}).items()):
            if kept.fields:
                by_row.setdefault(kept.fields, []).append(layer)
        for fields, layers in by_row.items():
            width = RowLayout(fields, dtype or torch.float32).width
            groups.append(GroupSpec(RECURRENT, tuple(layers), 1, width, state_fields=fields))
        return cls(tuple(groups), tuple(reads))

    @property
    def values_per_token(self) -> int:
        """The K and V elements one position of one row holds, over every stored layer."""
        return sum(len(g.layers) * 2 * g.kv_heads * g.head_dim for g in self.groups if g.kind in ATTENTION_KINDS)

    @property
    def values_per_row(self) -> int:
        """The state elements one row holds whatever its length, over every recurrent layer."""
        return sum(len(g.layers) * g.head_dim for g in self.groups if g.kind == RECURRENT)


def _probe(model: nn.Module, device: torch.device) -> dict:
    """`recurrent.probe_states` on the Hugging Face model inside any wrapper (a DistributedDataParallel's
    forward would sync buffers: a collective, here on one process only), whatever it raises named as the
    reason the model is refused."""
    inner = unwrap_model(model)
    cache_kwarg = "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"
    try:
        return probe_states(inner, cache_kwarg, device)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 (any failure of the probe means: not served)
        raise ValueError(
            f"torchkvops: {type(model).__name__}'s recurrent layers' states could not be read from "
            f"transformers' cache ({type(e).__name__}: {e})"
        ) from e


def _layer_shapes(config) -> list[tuple[int, int]]:
    """(KV heads, head size) of every layer: its own in a heterogeneous config (gemma4), else the model's."""
    if _per_layer_config(config):
        heads = config.num_attention_heads
        return [
            (getattr(c, "num_key_value_heads", None) or heads, getattr(c, "head_dim", None) or c.hidden_size // heads)
            for c in config.per_layer_config
        ]
    shape = KVShape.from_config(config)
    return [(shape.kv_heads, shape.head_dim)] * shape.layers


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def input_vocab(model: nn.Module) -> int | None:
    """How many token ids the model can embed: its input embedding's size, else its config's vocab_size."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None) or getattr(model.config, "vocab_size", None)


def output_vocab(model: nn.Module) -> int | None:
    """How many token ids the model can produce: its LM head's size, else its config's vocab_size."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return getattr(head, "out_features", None) or getattr(model.config, "vocab_size", None)


# Every config field that ModelAdapter (and KVShape) read: `model_state` watches them.
_CONFIG_FIELDS = (
    "_attn_implementation",
    "is_encoder_decoder",
    "layer_types",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "max_position_embeddings",
    "use_sliding_window",
    "sliding_window",
    "vocab_size",
    "model_type",
    "alibi",
    "attn_logit_softcapping",
    "kv_lora_rank",
    "v_head_dim",
)


def _kv_sharing_modes(config, kinds: list[str]) -> list[str | None] | None:
    """Each layer's KV sharing ("reuse": reads the last "store" layer of its type's KV; None: its own), as
    the config says: `kv_sharing_modes` (transformers >= 5.2x), or for 5.17's Gemma 3n, which has only
    `num_kv_shared_layers`, what its attention layers compute from it (the last layers reuse, the last
    layer of each type before them stores). None: no layer shares."""
    modes = getattr(config, "kv_sharing_modes", None)
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if modes is not None or not shared:
        return modes
    first = len(kinds) - shared
    modes = [None if layer < first else "reuse" for layer in range(len(kinds))]
    for kind in set(kinds):
        earlier = [layer for layer in range(first) if kinds[layer] == kind]
        if earlier:  # (else from_config names the reusing layer that nothing stores for)
            modes[earlier[-1]] = "store"
    return modes


_PER_LAYER = "per-layer"  # model_state's value of a config field that differs per layer


def _per_layer_config(config) -> bool:
    """A config whose layers have attributes of their own (transformers' heterogeneous configs: gemma4's
    per-layer head sizes), where a global head_dim or num_key_value_heads is ambiguous."""
    return getattr(config, "is_heterogeneous", False) is True


def model_state(model: nn.Module) -> tuple:
    """Everything a ModelAdapter reads from a model, as a tuple that compares equal while an adapter built
    before (and a rollout built on it) is still right: the attention implementation
    (`set_attn_implementation`), the dtype the parameters compute in and their device (`.to()`, `.half()`;
    FSDP's mixed precision), the vocabularies (`resize_token_embeddings`), the forward and the config
    fields the adapter reads. Cheap: attribute reads only (and one walk over the modules for FSDP's
    policies), no device work."""
    config = getattr(model, "config", None)
    first = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    dtype = None if first is None else compute_dtype(model, first)
    forward = getattr(model, "forward", None)
    fields = []
    for name in _CONFIG_FIELDS:
        try:
            value = getattr(config, name, None)
        except RuntimeError:  # a per-layer attribute of a heterogeneous config (gemma4): not one value
            value = _PER_LAYER
        fields.append(tuple(value) if isinstance(value, list) else value)
    return (
        id(config),
        tuple(fields),
        None if first is None else (dtype, first.device),
        input_vocab(model) if config is not None else None,
        output_vocab(model) if config is not None else None,
        getattr(forward, "__func__", forward),
    )


def unwrap_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside the wrappers trainers put around it: PEFT's PeftModel (LoRA and the
    other tuners inject their layers into the model that `get_base_model()` returns, so its forward
    computes with the adapters), DistributedDataParallel / DataParallel / FSDP1 (`.module`),
    torch.compile's OptimizedModule (`._orig_mod`) and TRL's value-head wrapper (`.pretrained_model`).
    A model that is none of these is returned as it is."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        if is_peft_model(model):
            model = model.get_base_model()
            continue
        inner = None
        if type(model).__name__ in _MODULE_WRAPPERS:
            inner = getattr(model, "module", None)
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            inner = model._orig_mod
        elif hasattr(model, "v_head") and isinstance(getattr(model, "pretrained_model", None), nn.Module):
            inner = model.pretrained_model
        if isinstance(inner, nn.Module):
            model = inner
    return model


def is_peft_model(model) -> bool:
    """A PEFT PeftModel (checked by its attributes, so that peft need not be installed)."""
    return callable(getattr(type(model), "get_base_model", None)) and hasattr(model, "peft_config")


def peft_refusal(model) -> str | None:
    """Why a PeftModel's generate cannot be served from its base model, or None: prompt-learning tuners
    (prefix and prompt tuning) add virtual tokens that PeftModel.generate feeds, not the base model."""
    if not is_peft_model(model):
        return None
    config = getattr(model, "active_peft_config", None)
    if config is not None and getattr(config, "is_prompt_learning", False):
        return f"a PEFT model with a prompt-learning adapter ({getattr(config, 'peft_type', 'prompt learning')})"
    return None


_MODULE_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def _unsupported_attention(model: nn.Module, config) -> str | None:
    """What the model's attention does beyond softmax(q k^T * scale + mask) v over a plain per-layer KV
    cache, which the rollout's prefill and decode would silently drop or fail on; None when nothing."""
    refused = family_of(config).refused
    if refused is not None:
        return refused
    for field, why in REFUSED_CONFIG_FIELDS.items():
        if getattr(config, field, None) not in (None, False):
            return why
    return None


class ModelAdapter:
    """Reads a decoder-only model's shape and forward signature once, at construction."""

    def __init__(self, model: nn.Module):
        config = getattr(model, "config", None)
        if config is None or not callable(model):
            raise TypeError(f"torchkvops: model must be a Hugging Face causal LM, got {type(model).__name__}")
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(
                f"torchkvops: {type(model).__name__} is an encoder-decoder model; only decoder-only causal LMs are supported"
            )
        layer_types = getattr(config, "layer_types", None) or []
        other = sorted(set(layer_types) - ATTENTION_LAYER_TYPES - RECURRENT_LAYER_TYPES - STATELESS_LAYER_TYPES)
        if other:
            raise ValueError(
                f"torchkvops: {type(model).__name__} has layers of type {other}; only models whose layers are "
                "attention with a plain per-layer KV cache or recurrent layers with fixed-size states "
                f"({', '.join(sorted(RECURRENT_LAYER_TYPES))}) are supported"
            )
        attn = getattr(config, "_attn_implementation", None) or "eager"
        if attn not in _MASK_FORMATS:
            raise ValueError(
                f"torchkvops: attention implementation {attn!r} is not supported; load the model with "
                f"attn_implementation='sdpa' or 'eager'"
            )
        self.mask_format = _MASK_FORMATS[attn]
        unsupported = _unsupported_attention(model, config)
        if unsupported:
            raise ValueError(f"torchkvops: {type(model).__name__} {unsupported}, which the rollout does not implement")
        first_param = next(model.parameters())
        # Where and in what the model computes: a sharded model's mixed-precision param_dtype, which its
        # gathered weights have, whether or not they are gathered now.
        self.device, self.dtype = first_param.device, compute_dtype(model, first_param)
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"torchkvops: {type(model).__name__} has {self.dtype} parameters; the rollout's "
                f"sampler takes {', '.join(map(str, _DTYPES))}"
            )
        params = inspect.signature(model.forward).parameters
        if "cache" in params:
            self.cache_kwarg = "cache"
        elif "past_key_values" in params:
            self.cache_kwarg = "past_key_values"
        else:
            raise ValueError(f"torchkvops: {type(model).__name__}.forward takes no KV cache argument")
        self.takes_cache_position = "cache_position" in params
        self.takes_attention_mask = "attention_mask" in params
        self.takes_logits_to_keep = "logits_to_keep" in params
        self.model, self.config = model, config
        # Recurrent layers' states per row, read off one probe forward (none for attention-only models).
        self.layer_states = None
        if set(layer_types) - ATTENTION_LAYER_TYPES:
            if sharding.is_sharded(model):
                raise ValueError(
                    f"torchkvops: {type(model).__name__} has recurrent layers and is sharded (FSDP or ZeRO-3): "
                    "not served yet (the probe of its layers' states would be a forward, whose gathers are "
                    "collectives, on each process at its own time)"
                )
            self.layer_states = _probe(model, self.device)
        self.cache_spec = CacheSpec.from_config(config, self.layer_states, self.dtype)  # the KV cache's groups
        # Whether some layer keeps recurrent state (whose packed forwards then run chunk by chunk).
        self.has_states = self.cache_spec.values_per_row > 0
        self.max_positions = getattr(config, "max_position_embeddings", None)
        # The window of the model's sliding-window layers (None: none), and the kinds of layer it has.
        self.window = sliding_window(config)
        kinds = getattr(config, "layer_types", None)
        self.layer_kinds = set(kinds) if kinds else {"sliding_attention" if self.window else "full_attention"}
        # PEFT's tuner layers (LoRA's Linear, ...), whose active adapters a decode graph depends on.
        self._tuner_layers = [
            m
            for m in model.modules()
            if isinstance(getattr(type(m), "active_adapters", None), property) and hasattr(m, "disable_adapters")
        ]
        # Token ids the model can embed (inputs, and the pad id fed back after EOS) and produce (EOS ids).
        self.input_vocab = input_vocab(model)
        self.output_vocab = output_vocab(model)

    def check_length(self, prompt_length: int, new_tokens: int) -> None:
        """Refuse lengths the model's positions do not cover. The last sampled token is never fed back, so a
        rollout runs the model at prompt_length + new_tokens - 1 positions (HF's generate serves the same
        lengths: up to max_position_embeddings + 1 tokens in all). A sliding window is no limit: both KV
        layouts mask the keys past it."""
        positions = prompt_length + new_tokens - 1
        if self.max_positions is not None and positions > self.max_positions:
            raise ValueError(
                f"torchkvops: prompt length + max_new_tokens - 1 = {positions} positions exceed the model's "
                f"{self.max_positions} (max_position_embeddings)"
            )

    def eos_ids(self, configured) -> list[int]:
        if configured is not None:
            return _as_id_list(configured)
        gen = getattr(self.model, "generation_config", None)
        ids = _as_id_list(getattr(gen, "eos_token_id", None))
        return ids or _as_id_list(getattr(self.config, "eos_token_id", None))

    def pad_id(self, configured, eos_ids: list[int]) -> int:
        for value in (
            configured,
            getattr(getattr(self.model, "generation_config", None), "pad_token_id", None),
            getattr(self.config, "pad_token_id", None),
        ):
            if value is not None:
                return int(value)
        return eos_ids[0] if eos_ids else 0

    def prefill_mask(self, allowed: torch.Tensor):
        """The mask of a prefill whose query i is column i of the keys: `attention_mask(allowed)`, and for a
        model with sliding-window layers whose window the keys outrun, those layers' own (keys less than the
        window before each query): a {"full_attention", "sliding_attention"} dict when both kinds of layer
        are there (what transformers' models take in place of building their masks), else the windowed
        mask alone."""
        mask = self.attention_mask(allowed)
        window, keys = self.window, allowed.shape[-1]
        if window is None or keys <= window:
            return mask
        column = torch.arange(keys, device=allowed.device)
        near = (column[:, None] - column[None, :]) < window  # [q, kv]
        windowed = self.attention_mask(allowed & near[None])
        if "full_attention" in self.layer_kinds:
            return {"full_attention": mask, "sliding_attention": windowed}
        return windowed

    def attention_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """[rows, q, kv] booleans (True = may attend) -> the [rows, 1, q, kv] mask this model takes."""
        if self.mask_format == "bool":
            return allowed[:, None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return mask.masked_fill(~allowed, torch.finfo(self.dtype).min)[:, None]

    def weight_addresses(self) -> tuple[int, ...]:
        """Where every parameter and buffer lives now: a CUDA graph replays on these addresses, so a
        change (parameters gathered into new storage, load_state_dict(assign=True), .to()) means
        re-capture. Cheap: no device work."""
        return tuple(t.data_ptr() for t in self.model.parameters()) + tuple(t.data_ptr() for t in self.model.buffers())

    def adapter_state(self) -> tuple:
        """Which PEFT adapters the model's tuner layers run now (`set_adapter`, `disable_adapter()`,
        merging) and at which scale (LoRA's `scaling`, a Python float that `set_scale`, `scale_layer` and
        `rescale_adapter_scale` change): a CUDA graph replays the kernels and constants of the adapters
        active when it was captured, so a change means re-capture. Adapter weights updated in place need
        none: the graph reads them. Cheap."""
        return tuple(
            (
                tuple(getattr(m, "active_adapters", ())),
                bool(getattr(m, "disable_adapters", False)),
                tuple(getattr(m, "merged_adapters", ())),
                tuple(sorted((getattr(m, "scaling", None) or {}).items())),
            )
            for m in self._tuner_layers
        )

    def forward_kwargs(self, cache, attention_mask, position_ids, cache_position) -> dict:
        """The model's forward arguments besides input_ids, for one call that keeps the last
        position's logits only."""
        kwargs = {
            self.cache_kwarg: cache,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "use_cache": True,
        }
        if self.takes_cache_position:
            kwargs["cache_position"] = cache_position
        if self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return kwargs

    def packed_logits(
        self, cache, ids: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor, last: torch.Tensor
    ):
        """One forward over packed tokens `ids` [T] (several rows' chunks in one sequence; their attention is
        the rollout's, which reads its own mask: the model gets a placeholder 4-D mask, which it passes
        through); returns the logits at the packed indices `last` [L] only: [L, vocab]."""
        kwargs = self.forward_kwargs(
            cache, ids.new_zeros((1, 1, ids.numel(), 1), dtype=self.dtype), positions[None], columns
        )
        if self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = last
            return self.model(input_ids=ids[None], **kwargs).logits[0]
        return self.model(input_ids=ids[None], **kwargs).logits[0, last]

    def last_logits(self, cache, input_ids, attention_mask, position_ids, cache_position) -> torch.Tensor:
        """One forward; returns the logits of the last position only: [rows, vocab]."""
        kwargs = self.forward_kwargs(cache, attention_mask, position_ids, cache_position)
        return self.model(input_ids=input_ids, **kwargs).logits[:, -1, :]


def sliding_window(config) -> int | None:
    """The attention window that binds some layer of a model with this config, or None when every layer
    sees all tokens."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return getattr(config, "sliding_window", None)
