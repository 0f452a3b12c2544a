"""The dtype a model's parameters compute in when a sharding engine casts them for the forward: FSDP2's
and FSDP1's mixed precision gather fp32 shards as `param_dtype` (bf16, say), so the K and V a forward
produces, and the logits, are in that dtype, not in the dtype `model.parameters()` shows between forwards.
Read from the engines' own state by attribute, so that nothing here imports them."""

from __future__ import annotations

import torch
from torch import nn

from .sharding import fsdp2_param_groups

__all__ = ["forward_dtypes", "compute_dtype"]


def forward_dtypes(model: nn.Module) -> dict[int, torch.dtype]:
    """id(parameter) -> the dtype the forward sees it in, for each floating-point parameter that FSDP2
    (`fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=...))`) or FSDP1 (`mixed_precision=
    MixedPrecision(param_dtype=...)`) casts; parameters no engine casts are absent. Keyed by the
    parameter objects `model.parameters()` yields between forwards (FSDP2's sharded DTensors)."""
    dtypes: dict[int, torch.dtype] = {}
    for module in model.modules():  # outermost first: an inner FSDP1 wrapper's policy overrides its parent's
        if callable(getattr(module, "_get_fsdp_state", None)):  # FSDP2
            for group in fsdp2_param_groups(module):
                param_dtype = group.mp_policy.param_dtype
                if param_dtype is None:
                    continue
                for param in group.fsdp_params:
                    if param.sharded_param.dtype.is_floating_point:
                        dtypes[id(param.sharded_param)] = param_dtype
        elif type(module).__name__ == "FullyShardedDataParallel":  # FSDP1
            param_dtype = getattr(getattr(module, "mixed_precision", None), "param_dtype", None)
            if param_dtype is not None:
                for param in module.parameters():
                    if param.dtype.is_floating_point:
                        dtypes[id(param)] = param_dtype
    return dtypes


def compute_dtype(model: nn.Module, param: torch.Tensor | None = None) -> torch.dtype | None:
    """The dtype `param` (default: the model's first parameter) computes in: the engine's param_dtype
    where FSDP casts it, else its own dtype; None for a model without parameters."""
    param = next(model.parameters(), None) if param is None else param
    if param is None:
        return None
    return forward_dtypes(model).get(id(param), param.dtype)
