"""What makes a model's forward compute something other than its eval-mode forward in its parameters'
dtype: dropout in train mode and autocast. patch_generate (generate's contract) and patch_forward both
read them from here, with one list of the attributes where transformers layers keep a dropout
probability, so that the two cannot drift apart.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

__all__ = [
    "DROPOUT_ATTRIBUTES",
    "ATTENTION_DROPOUT_ATTRIBUTES",
    "dropout_probability",
    "dropout_attributes",
    "attention_dropout",
    "active_dropout",
    "disable_dropout",
    "autocast_dtype",
    "forward_autocast_dtype",
]


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


def dropout_attributes(module: nn.Module) -> list[str]:
    """The attributes of `module` that may hold a dropout probability it passes to functional dropout:
    those of DROPOUT_ATTRIBUTES, and any other whose name ends in "dropout" (Seed-OSS's
    `residual_dropout`): families name them freely, and a missed one silently changes results."""
    return [a for a in vars(module) if a in DROPOUT_ATTRIBUTES or a.endswith("dropout")]


def active_dropout(model: nn.Module) -> str | None:
    """The first dropout the model applies in train mode, named: an nn.Dropout with p > 0, or a float
    that a layer keeps for functional dropout (`dropout_attributes`); None when there is none."""
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, nn.Dropout):
            if module.p > 0:
                return f"{name or type(module).__name__} p={module.p}"
            continue
        for attribute in dropout_attributes(module):
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
        for attribute in dropout_attributes(module):
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
