"""A shared-prefix forward and backward for RL trainers: rows that share a prefix compute it once.

    import torchkvops
    torchkvops.patch_forward(model)             # the one line a TRL user adds (policy; and ref_model)

After generation, GRPO-style trainers run the model over every row's prompt + completion up to three
times (old-policy and reference log-probabilities, then the policy's loss), and each prompt sits in G
rows. With the patch, the model's backbone finds the rows that share a prefix (`prefix_groups`), packs
each shared prefix once followed by its rows' own suffixes into one sequence (and, when every row starts
with the same real tokens, a system prompt, wherever each row's left padding puts them, those once before
all the groups: positions are then numbered from each row's first real token for families whose results
depend on differences of positions only, see models.families), runs its own layers over
that (embeddings, norms and MLPs act per token; every attention layer calls `prefix_attention`, which
knows the groups), and scatters the hidden states back to the [rows, length, hidden] layout. The LM
head, `logits_to_keep`, `labels` and TRL's fused log-prob head then work unchanged, and outputs and
gradients are the plain forward's up to float rounding, at padding positions too under SDPA and
flash-attention (see `prefix_attention`: the logit at a row's last padding column predicts its first
real token, and a padding collator's labels include it). Under eager attention the plain forward's
left-padding outputs are a uniform average over the whole row, which a shared prefix cannot give: a
call whose `labels` read one runs the plain forward. Positions are the plain forward's own, so a
suffix's continue its prefix's.

Where it hooks: the backbone (`model.base_model`, e.g. LlamaModel, found through PEFT's PeftModel,
DDP's `.module`, torch.compile's and TRL's wrappers: `models.unwrap_model`), whose forward is replaced on
this instance, and a forward pre-hook on the causal LM around it, which sees the `labels`. TRL's GRPOTrainer replaces the top-level `model.forward` with a fused LM head that calls the
backbone directly, so patching before or after TRL, on `trainer.model` and `trainer.ref_model`, both
work. The attention layers read their model's config through a view that names this module's attention
function, while the model's own config keeps its attention implementation (what TRL reads, saves and
copies to the reference model). The packed layout reaches the attention function as a keyword argument
of the layer call, so gradient checkpointing's recomputation (reentrant or not) sees it too; without
one the function calls the model's own attention, exactly as before.

Around each call that TRL's fused head serves (`fused_lm_head=True`), the same hooks make that head
project only the positions whose label it keeps on the CPU too, as it does where Triton runs
(`trl_head`): on the CPU TRL otherwise projects every position, a cost the same with or without the
shared forward (11x the head's work in a GRPO pass on SmolLM2-135M).

Falls back to the plain forward, with a warning the first time each cause is seen, for anything that
would change results or that it cannot serve: dropout active in train mode, output_attentions,
inputs_embeds or other extra inputs, an attention implementation other than eager, sdpa or
flash-attention, logit softcapping, a device other than CPU or CUDA, or no rows
sharing at least `min_shared_tokens` columns. A forward with a KV cache (use_cache=True or a cache
argument: generation) runs the model's own forward without a warning; with use_cache left unset the
shared forward returns no cache.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import weakref

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedConfig

from ..fused_attention import applied_softcap
from ..models.adapter import unwrap_model
from ..models.families import (
    ABSOLUTE_POSITION_FIELDS,
    FAMILIES,
    NO_ATTENTION_LAYER_TYPES,
    RECURRENT_LAYER_TYPES,
    family_of,
)
from ..models.forward_modes import active_dropout, autocast_dtype, disable_dropout
from ..models.precision import compute_dtype
from ..models.recurrent import own_forward, recurrent_mixers, restore_forward
from ..utils import PatchHandle, WarnOnce
from .prefix_attention import SERVED_DEVICES, PackedLayout, packed_attention
from .prefix_groups import grouping_keys, pack_layout, plan_grouping, ungroup_one_token_prefixes
from .recurrent_segments import packed_recurrent_forward
from .trl_head import compact_fused_head, uses_trl_fused_head

__all__ = ["patch_forward", "ForwardPatch", "SharedForwardConfig", "SharedForwardStats", "disable_dropout", "NAME"]

NAME = "torchkvops_shared"  # the attention function's name in transformers' AttentionInterface
_LAYOUT_KWARG = "torchkvops_packed_layout"  # the keyword that carries the layout to the attention layers
_STATE_ATTR = "_torchkvops_shared_forward"

# Attention implementations whose results the shared path reproduces (all exact attention).
SERVED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
_SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Arguments the shared path handles; any other argument set (not None) means the plain forward.
_HANDLED = {
    "input_ids",
    "attention_mask",
    "position_ids",
    "use_cache",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    # Gemma4's backbone takes the LM head's logits_to_keep to skip the rest of the positions in its KV-shared
    # layers; the packed forward computes every position (its causal LM slices the hidden states after).
    "logits_to_keep",
}
_CACHE_ARGUMENTS = ("cache", "past_key_values")
# Arguments that change nothing when False (MoE families pass output_router_logits=False by default).
_OFF_WHEN_FALSE = {"output_router_logits"}
# The warning for each cause of a fallback, given once per patch.
_FALLBACK_WARNING = "torchkvops.patch_forward: {cause}; this forward (and every one with it) runs the plain forward"


@dataclasses.dataclass(frozen=True)
class SharedForwardConfig:
    """Options of `patch_forward`. `min_shared_tokens`: a group of rows is computed once only when they
    share at least this many leading columns (padding included); shorter shared prefixes save less
    than the extra attention calls cost."""

    min_shared_tokens: int = 16

    def __post_init__(self):
        v = self.min_shared_tokens
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"SharedForwardConfig.min_shared_tokens must be an int >= 1, got {v!r}")


@dataclasses.dataclass
class SharedForwardStats:
    """What the patched backbone did: forwards served by the shared path, forwards that fell back to
    the plain one (each cause is warned about once; forwards with a KV cache are not counted), and,
    over the shared ones, the tokens the plain forward would have computed (rows x length) and those
    computed instead, and the groups of rows that shared a prefix, counted by their size (rows per group
    -> groups seen; a row that shares with none is a group of 1)."""

    shared_calls: int = 0
    fallback_calls: int = 0
    row_tokens: int = 0
    computed_tokens: int = 0
    group_sizes: dict[int, int] = dataclasses.field(default_factory=dict)


class _ConfigView:
    """What a patched model's attention layers see as their config: the model's config, except that
    `_attn_implementation` names the shared-prefix attention function (which calls the model's own
    attention, read live from the real config, whenever a call carries no packed layout)."""

    _attn_implementation = NAME

    def __init__(self, config: PreTrainedConfig):
        object.__setattr__(self, "_torchkvops_config", config)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_torchkvops_config":  # copy/pickle probes, half-built copies
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, "_torchkvops_config"), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._torchkvops_config, name, value)


def _model_attention(module: nn.Module):
    """The attention function `module` calls when not packed: its model's configured implementation,
    looked up as its own modeling file looks it up."""
    view = module.config
    if not isinstance(view, _ConfigView):
        raise RuntimeError(
            f"torchkvops: the {NAME!r} attention is set only by torchkvops.patch_forward on the "
            "attention layers it patches; do not select it as a model's attn_implementation"
        )
    family = sys.modules[type(module).__module__]
    return family.ALL_ATTENTION_FUNCTIONS.get_interface(
        view._torchkvops_config._attn_implementation, family.eager_attention_forward
    )


def _shared_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    layout: PackedLayout | None = kwargs.pop(_LAYOUT_KWARG, None)
    if layout is None:
        return _model_attention(module)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # The backbone checked all of these before packing (see _plain_reason); here they are invariants.
    # The arguments honoured: models.families.ATTENTION_ARGUMENTS.
    window = kwargs.get("sliding_window")
    if dropout:
        raise RuntimeError(f"torchkvops: shared-prefix attention got dropout={dropout!r}, which it cannot serve")
    # Under autocast the model's own attention (SDPA, eager's matmuls) runs in the autocast dtype, and
    # its inputs may come in mixed dtypes (RoPE in float32, V straight from a bf16 projection).
    dtype = autocast_dtype(query.device.type)
    dtype = query.dtype if dtype is None else dtype
    query, key, value = (t.to(dtype) for t in (query, key, value))
    sinks = kwargs.get("s_aux")
    implementation = module.config._torchkvops_config._attn_implementation
    softcap = applied_softcap(kwargs.get("softcap"), implementation)
    # Plain eager attention gives a query with no key the mean of its row's values (with sinks: nothing).
    eager = implementation == "eager" and sinks is None
    return packed_attention(query, key, value, layout, scaling, window, sinks, softcap, blind_average=eager), None


AttentionInterface.register(NAME, _shared_attention)


def _mixer_forward(mixer: nn.Module, previous, hidden_states: Tensor, cache=None, attention_mask=None, **kwargs):
    """A recurrent layer's forward while patched (set on the module as functools.partial(this, module, its
    instance-level forward before or None), as the backbone's is): over a packed layout (the keyword the
    attention layers get, which hybrids' decoder layers pass on to their recurrent layers too) segment by
    segment (`recurrent_segments`), else its own."""
    original = own_forward(mixer, previous)
    layout: PackedLayout | None = kwargs.pop(_LAYOUT_KWARG, None)
    if layout is None:
        return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    return packed_recurrent_forward(original, hidden_states, layout, **kwargs)


def _install_mixers(state: _PatchState) -> None:
    """Each recurrent layer's forward patched (`_mixer_forward`), again where something replaced it since:
    transformers re-kernelizes hub-kernel layers (Gated DeltaNet's) on every train()/eval() switch, which
    drops an instance's forward."""
    for i, (mixer, _) in enumerate(state.mixers):
        current = vars(mixer).get("forward")
        if not (isinstance(current, functools.partial) and current.func is _mixer_forward):
            state.mixers[i] = (mixer, current)
            mixer.forward = functools.partial(_mixer_forward, mixer, current)


def _has_recurrent_layers(config) -> bool:
    return bool(set(getattr(config, "layer_types", None) or []) & RECURRENT_LAYER_TYPES)


def _position_embedding_modules(backbone: nn.Module) -> list[nn.Module]:
    """Learned position embeddings (an nn.Embedding whose name says positions)."""
    return [m for n, m in backbone.named_modules() if isinstance(m, nn.Embedding) and "pos" in n.rsplit(".", 1)[-1]]


# --- the patched backbone forward -----------------------------------------------------------------
@dataclasses.dataclass
class _PatchState:
    config: SharedForwardConfig
    stats: SharedForwardStats
    numbering: str  # how the backbone numbers positions (position_numbering)
    previous_forward: object  # the backbone's own instance-level forward before the patch, or None
    views: list  # (attention module, its config before the patch)
    # (recurrent layer's module, its own instance-level forward before the patch or None): hybrids
    mixers: list = dataclasses.field(default_factory=list)
    warn_once: WarnOnce = dataclasses.field(default_factory=lambda: WarnOnce(_FALLBACK_WARNING))
    # Set by the causal LM's pre-hook for the forward it is running: its labels include a token that a
    # left-padding column predicts (what eager attention gives there, a shared prefix cannot).
    labels_read_blind_queries: bool = False
    # The TRL fused-head contexts the pre-hook entered (trl_head), exited by the post-hook.
    head_contexts: list = dataclasses.field(default_factory=list)

    def original(self, backbone: nn.Module):
        if self.previous_forward is not None:
            return self.previous_forward
        return functools.partial(type(backbone).forward, backbone)


def _shared_backbone_forward(self: nn.Module, *args, **kwargs):
    """The patched backbone forward, set on the backbone as functools.partial(this, backbone): a deep
    copy, a pickle or torch.save of the model is patched alike, on its own weights."""
    state: _PatchState = getattr(self, _STATE_ATTR)
    original = state.original(self)
    if kwargs.get("use_cache") or any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
        # A forward with a KV cache (generation: HF's generate, a torchkvops rollout) needs the model's own
        # forward, and it is not what patch_forward serves: no warning. Plain Python, so that a compiled
        # (fullgraph) decode step traces straight through.
        return original(*args, **kwargs)
    plan = _plan(self, state, args, kwargs)
    if plan is None:
        return original(*args, **kwargs)
    arguments, layout, positions = plan
    return _run_packed(original, state.stats, arguments, layout, positions)


@torch.compiler.disable  # host work (the grouping), once per forward, outside any compiled graph
def _plan(backbone: nn.Module, state: _PatchState, args: tuple, kwargs: dict):
    """(arguments by name, layout, plain positions [rows, length]) for a call that the shared path
    serves; None (after counting the fallback and warning once about its cause) for any other."""
    try:
        signature = inspect.signature(type(backbone).forward)
        arguments = dict(signature.bind(backbone, *args, **kwargs).arguments)
    except TypeError:
        return None  # the model's own forward reports the bad call
    arguments.pop(next(iter(signature.parameters)))  # self
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    reason = _plain_reason(backbone, arguments)
    if reason is None and state.labels_read_blind_queries and backbone.config._attn_implementation == "eager":
        reason = (
            "labels that a left-padding column predicts, under eager attention (its output there is a "
            "uniform average over the whole row, which a shared prefix cannot reproduce; sdpa serves these)"
        )
    if reason is None:
        input_ids = arguments["input_ids"]
        mask = arguments.get("attention_mask")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
        given = arguments.get("position_ids")
        numbering = state.numbering
        # Keys under which a token's result depends only on the row from its first real token on: the
        # positions the forward will use, where they are not a function of the mask from there.
        keys = grouping_keys(input_ids, mask, given)  # (one host copy of the ids and mask, or two for GPT-2)
        nested_keys = (
            keys
            if given is not None or numbering != "column"
            else grouping_keys(input_ids, mask, _column_positions(input_ids))
        )
        grouping = plan_grouping(keys, nested_keys, state.config.min_shared_tokens)
        if state.mixers:  # (recurrent layers: a one-token prefix after common tokens cannot give its states)
            grouping = ungroup_one_token_prefixes(grouping, nested_keys)
        if not grouping.common and all(len(g.rows) == 1 for g in grouping.groups):
            reason = (
                f"no rows that share a prefix of at least min_shared_tokens={state.config.min_shared_tokens} columns"
            )
    if reason is not None:
        state.stats.fallback_calls += 1
        state.warn_once(reason)
        return None
    _install_mixers(state)
    relative = grouping.common and given is None and numbering == "relative"
    positions = _relative_positions(mask) if relative else _plain_positions(numbering, input_ids, mask, given)
    return arguments, pack_layout(grouping, mask), positions


def _column_positions(input_ids: Tensor) -> Tensor:
    rows, length = input_ids.shape
    return torch.arange(length, device=input_ids.device).expand(rows, length)


def _plain_positions(numbering: str, input_ids: Tensor, mask: Tensor, given: Tensor | None) -> Tensor:
    """[rows, length]: the position of every token as the plain forward numbers it."""
    rows, length = input_ids.shape
    if given is not None:
        return given.expand(rows, length)
    if numbering == "mask":  # OPT: cumsum(mask) - 1 at real tokens, -1 at padding
        return mask.long().cumsum(1) * mask - 1
    return _column_positions(input_ids)


def _relative_positions(mask: Tensor) -> Tensor:
    """[rows, length]: columns numbered from each row's first real token (0 on the left padding before
    it, whose queries see no key and whose keys no query sees)."""
    columns = torch.arange(mask.shape[1], device=mask.device)
    first = mask.long().argmax(dim=1, keepdim=True)
    return (columns - first).clamp(min=0)


def _plain_reason(backbone: nn.Module, arguments: dict) -> str | None:
    """Why this call must run the plain forward, or None."""
    config = backbone.config
    if arguments.get("inputs_embeds") is not None:
        return "inputs_embeds (rows are grouped by their token ids)"
    for name in _CACHE_ARGUMENTS:
        if arguments.get(name) is not None:
            return f"a KV cache ({name})"
    if arguments.get("use_cache"):
        return "use_cache=True (the shared forward keeps no per-row KV cache)"
    if arguments.get("output_attentions", getattr(config, "output_attentions", False)):
        return "output_attentions=True"
    if arguments.get("output_router_logits"):
        return (
            "output_router_logits=True (the router's auxiliary loss averages over the tokens computed, which "
            "a shared prefix makes fewer than the plain forward's)"
        )
    extra = sorted(
        name
        for name, value in arguments.items()
        if name not in _HANDLED and value is not None and not (name in _OFF_WHEN_FALSE and value is False)
    )
    if extra:
        return f"the argument {extra[0]!r}"
    input_ids, mask, positions = (arguments.get(k) for k in ("input_ids", "attention_mask", "position_ids"))
    if not (isinstance(input_ids, Tensor) and input_ids.dim() == 2 and not input_ids.is_floating_point()):
        return "input_ids that are not a 2-D tensor of token ids"
    if mask is not None and (not isinstance(mask, Tensor) or mask.shape != input_ids.shape):
        return "an attention_mask that is not 2-D [rows, length] (a custom 4-D mask)"
    if positions is not None and (
        not isinstance(positions, Tensor)
        or positions.dim() != 2
        or positions.shape[1] != input_ids.shape[1]
        or positions.shape[0] not in (1, input_ids.shape[0])
    ):
        return "position_ids that are not [rows, length] or [1, length]"
    if input_ids.numel() == 0:
        return f"an empty batch (input_ids of shape {tuple(input_ids.shape)})"
    if backbone.training:
        cause = active_dropout(backbone)
        if cause:
            return (
                f"dropout in train mode ({cause}: every row needs its own dropout mask; set it to 0 with "
                "torchkvops.models.forward_modes.disable_dropout(model), or call model.eval())"
            )
    attn = config._attn_implementation
    if attn not in SERVED_ATTENTION:
        return f"attn_implementation={attn!r} (served: {', '.join(SERVED_ATTENTION)})"
    if input_ids.device.type not in SERVED_DEVICES:
        return f"a model on {input_ids.device.type} (served: {', '.join(SERVED_DEVICES)})"
    dtype = compute_dtype(backbone)  # (FSDP's mixed precision: the dtype its gathered weights have)
    if dtype not in _SERVED_DTYPES:
        return f"{dtype} parameters"
    return None


def _run_packed(original, stats: SharedForwardStats, arguments: dict, layout: PackedLayout, positions: Tensor):
    input_ids = arguments["input_ids"]
    rows, length = input_ids.shape
    call = {
        "input_ids": input_ids.reshape(-1)[layout.src][None],
        "position_ids": positions.reshape(-1)[layout.src][None],
        # A 4-D mask is returned as it is by transformers' mask builders: no [T, T] mask is built.
        "attention_mask": torch.ones((1, 1, 1, 1), dtype=torch.bool, device=input_ids.device),
        "use_cache": False,
        "return_dict": True,
        _LAYOUT_KWARG: layout,
    }
    if arguments.get("output_hidden_states") is not None:
        call["output_hidden_states"] = arguments["output_hidden_states"]
    out = original(**call)

    def unpack(hidden: Tensor) -> Tensor:  # [1, T, hidden] -> [rows, length, hidden]
        return hidden[0].index_select(0, layout.dest).view(rows, length, -1)

    out["last_hidden_state"] = unpack(out["last_hidden_state"])
    if out.get("hidden_states") is not None:
        out["hidden_states"] = tuple(unpack(h) for h in out["hidden_states"])
    stats.shared_calls += 1
    stats.row_tokens += rows * length
    stats.computed_tokens += layout.tokens
    for bucket in layout.buckets:
        stats.group_sizes[bucket.rows] = stats.group_sizes.get(bucket.rows, 0) + bucket.groups
    return out.to_tuple() if arguments.get("return_dict") is False else out


# --- patching ---------------------------------------------------------------------------------------
def _backbone(model: nn.Module) -> nn.Module:
    """The module that runs the decoder layers: `model.base_model` of the Hugging Face model inside any
    wrapper (`models.unwrap_model`), or the decoder it wraps (OPTModel's OPTDecoder, which OPTForCausalLM
    calls directly)."""
    model = unwrap_model(model)
    backbone = getattr(model, "base_model", model)
    if not isinstance(getattr(backbone, "config", None), PreTrainedConfig):
        raise TypeError(
            f"patch_forward: model must be a Hugging Face causal LM or its backbone, got {type(model).__name__}"
        )
    decoder = getattr(backbone, "decoder", None)
    if isinstance(decoder, nn.Module) and isinstance(getattr(decoder, "config", None), PreTrainedConfig):
        return decoder
    return backbone


def _attention_modules(backbone: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in backbone.modules()
        if type(m).__name__.endswith("Attention")
        and hasattr(m, "layer_idx")
        and isinstance(getattr(m, "config", None), (PreTrainedConfig, _ConfigView))
    ]


def position_numbering(backbone: nn.Module) -> str | None:
    """How the backbone numbers positions (`models.families.Family.positions`), or None when it is none
    torchkvops knows: a family's entry says, else a rotary family (or a hybrid without position
    embeddings) is "relative" unless a config field makes its scores read absolute positions."""
    config = backbone.config
    if getattr(config, "model_type", None) in FAMILIES:
        return family_of(config).positions
    if not any(type(m).__name__.endswith("RotaryEmbedding") for m in backbone.modules()):
        # A hybrid without position embeddings (Nemotron-H, Granite 4: its recurrent layers order the
        # tokens, its attention has none) reads no position: any numbering gives its results, so a prefix
        # common to rows of different left padding is computed once, as for rotary families.
        if _has_recurrent_layers(config) and not _position_embedding_modules(backbone):
            return "relative"
        return None
    absolute = any(getattr(config, f, None) for f in ABSOLUTE_POSITION_FIELDS)
    return "column" if absolute else "relative"


def _unsupported_model(backbone: nn.Module) -> str | None:
    config = backbone.config
    model_type = getattr(config, "model_type", None)
    refused = family_of(config).refused
    if refused is not None:
        return f"model type {model_type!r} is not supported: it {refused}"
    if position_numbering(backbone) is None:
        known = [name for name, family in FAMILIES.items() if family.refused is None and family.positions != "relative"]
        return (
            f"model type {model_type!r} is not supported: its positions are neither rotary embeddings nor "
            f"a numbering torchkvops knows ({', '.join(known)})"
        )
    if getattr(config, "add_cross_attention", False):
        return "models with cross-attention are not supported"
    if getattr(config, "reorder_and_upcast_attn", False):
        return "GPT-2's reorder_and_upcast_attn is not supported"
    kinds = getattr(config, "layer_types", None) or []
    layers = getattr(config, "num_hidden_layers", None)
    # Layers without attention: recurrent ones (a "hybrid" layer has both), Nemotron-H's MLP and MoE blocks.
    expected = layers - sum(kind in NO_ATTENTION_LAYER_TYPES for kind in kinds)
    found = len(_attention_modules(backbone))
    if found != expected:
        return f"found {found} attention layers in {type(backbone).__name__}, expected {expected} of {layers}"
    try:
        recurrent_mixers(backbone)
    except ValueError as e:
        return str(e).removeprefix("torchkvops: ")
    return None


def _is_patched(backbone: nn.Module) -> bool:
    forward = vars(backbone).get("forward")
    return isinstance(forward, functools.partial) and forward.func is _shared_backbone_forward


@functools.cache
def _forward_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


@torch.compiler.disable  # host work (one flag), outside any compiled graph
def _labels_pre_hook(state: _PatchState, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Before the causal LM's forward: whether its labels include a token that a left-padding column
    predicts (labels[:, j] != -100 where every column before j is padding). Host sync: one flag, only
    for a call with labels and a 2-D mask."""
    try:
        bound = _forward_signature(type(module)).bind_partial(module, *args, **kwargs).arguments
    except TypeError:
        bound = {}
    if uses_trl_fused_head(kwargs):  # TRL's fused head: only the kept positions, on the CPU too
        context = compact_fused_head(next(module.parameters()).device)
        context.__enter__()
        state.head_contexts.append(context)
    labels, mask = bound.get("labels"), bound.get("attention_mask")
    state.labels_read_blind_queries = bool(
        isinstance(labels, Tensor)
        and isinstance(mask, Tensor)
        and mask.dim() == 2
        and labels.shape == mask.shape
        and mask.shape[1] > 1
        and ((labels[:, 1:] != -100) & ~mask.bool().cummax(dim=1).values[:, :-1]).any()
    )


@torch.compiler.disable
def _labels_post_hook(state: _PatchState, module: nn.Module, args: tuple, output) -> None:
    state.labels_read_blind_queries = False
    if state.head_contexts:
        state.head_contexts.pop().__exit__(None, None, None)


class ForwardPatch(PatchHandle):
    """What `patch_forward` returns: `undo()` (or leaving the `with` block) restores the model;
    `stats` counts the forwards served by the shared path and by the plain one."""

    def __init__(self, backbone: nn.Module, config: SharedForwardConfig, causal_lm: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.stats = SharedForwardStats()
        modules = _attention_modules(backbone)
        state = _PatchState(
            config=config,
            stats=self.stats,
            numbering=position_numbering(backbone),
            previous_forward=vars(backbone).get("forward"),
            views=[(m, m.config) for m in modules],
        )
        for m in modules:
            m.config = _ConfigView(m.config)
        state.mixers = [(mixer, None) for mixer in recurrent_mixers(backbone).values()]
        _install_mixers(state)
        setattr(backbone, _STATE_ATTR, state)
        backbone.forward = functools.partial(_shared_backbone_forward, backbone)
        self._hooks = []
        if causal_lm is not None and causal_lm is not backbone:
            self._hooks = [
                causal_lm.register_forward_pre_hook(functools.partial(_labels_pre_hook, state), with_kwargs=True),
                causal_lm.register_forward_hook(functools.partial(_labels_post_hook, state), always_call=True),
            ]
        self._backbone_ref = weakref.ref(backbone)

    @classmethod
    def of(cls, model: nn.Module) -> ForwardPatch | None:
        """A handle on `model`'s patch (None: its forward is not patched): for a deep copy of a patched model,
        which is patched too (TRL's Online DPO and A2PO copy the policy into their reference model), to read
        its `stats` or undo it."""
        backbone = _backbone(model)
        if not _is_patched(backbone):
            return None
        state: _PatchState = getattr(backbone, _STATE_ATTR)
        handle = cls.__new__(cls)
        PatchHandle.__init__(handle)
        handle.config, handle.stats, handle._backbone_ref = state.config, state.stats, weakref.ref(backbone)
        causal_lm = unwrap_model(model)
        handle._hooks = [] if causal_lm is backbone else _labels_hooks(causal_lm, state)
        return handle

    def _restore(self) -> None:
        backbone = self._backbone_ref()
        if backbone is None:
            return
        state: _PatchState = getattr(backbone, _STATE_ATTR)
        if state.previous_forward is None:
            del backbone.forward
        else:
            backbone.forward = state.previous_forward
        for module, config in state.views:
            module.config = config
        for mixer, previous in state.mixers:
            restore_forward(mixer, previous)
        for hook in self._hooks:
            hook.remove()
        delattr(backbone, _STATE_ATTR)


def _labels_hooks(causal_lm: nn.Module, state) -> list:
    """The handles of the label hooks a patch with `state` put on `causal_lm` (a deep copy's: its hooks are
    copies bound to its own state)."""
    from torch.utils.hooks import RemovableHandle

    hooks = []
    for table in (causal_lm._forward_pre_hooks, causal_lm._forward_hooks):
        for key, hook in list(table.items()):
            if isinstance(hook, functools.partial) and hook.func in (_labels_pre_hook, _labels_post_hook):
                if hook.args and hook.args[0] is state:
                    extra = [causal_lm._forward_pre_hooks_with_kwargs, causal_lm._forward_hooks_always_called]
                    handle = RemovableHandle(table, extra_dict=extra)
                    handle.id = key  # (removes this entry and its flags, as register_forward_*hook's handle would)
                    hooks.append(handle)
    return hooks


def patch_forward(model: nn.Module, **options) -> ForwardPatch:
    """Make this model instance's forward compute rows that share a prefix once (see the module docstring).

    `model` is a Hugging Face causal LM (its backbone, `model.base_model`, is patched) or a backbone, or
    either inside a PeftModel (LoRA: the adapters' gradients are the plain forward's), DDP, torch.compile
    or TRL wrapper.
    `options` are those of `SharedForwardConfig` (min_shared_tokens), validated as it validates them.
    Returns a handle: `handle.undo()` restores the model, `with patch_forward(model): ...` does so on
    leaving the block, and `handle.stats` counts what the patched forward did. Patching a patched model
    again is refused."""
    fields = {f.name for f in dataclasses.fields(SharedForwardConfig)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"patch_forward: unknown option {unknown[0]!r}; the options are {', '.join(sorted(fields))}")
    config = SharedForwardConfig(**options)
    backbone = _backbone(model)
    causal_lm = unwrap_model(model)
    if _is_patched(backbone):
        raise RuntimeError("patch_forward: this model's forward is already patched; undo() that handle first")
    reason = _unsupported_model(backbone)
    if reason:
        raise ValueError(f"patch_forward: {reason}")
    return ForwardPatch(backbone, config, causal_lm)
