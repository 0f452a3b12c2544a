"""Whether a model's weights are sharded (FSDP2, FSDP1, DeepSpeed ZeRO-3), read from its modules and
parameters: what the model layer needs to know (the gathers themselves are `torchkvops.hf.sharded`'s)."""

from __future__ import annotations

from torch import nn

__all__ = ["fsdp2_modules", "fsdp2_param_groups", "fsdp1_modules", "zero3_parameters", "is_sharded"]


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules (`fully_shard`) among `model`'s modules, outermost first; [] without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without torch.distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp2_param_groups(module: nn.Module) -> list:
    """An FSDP2 module's parameter groups (`FSDPParamGroup`s), from FSDP's own state. The one place that
    reads this private: torch 2.11-2.13 keep one optional group (`FSDPState._fsdp_param_group`), later
    releases a list (`_fsdp_param_groups`); [] for a module whose state holds none (a root without
    parameters of its own)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def fsdp1_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP1 wrappers (`FullyShardedDataParallel`) among `model`'s modules, outermost first."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - a torch without torch.distributed
        return []
    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def zero3_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters DeepSpeed ZeRO-3 partitions (they carry its `ds_id` and `ds_status`); [] without
    ZeRO-3 (checked by attribute, so that deepspeed need not be installed)."""
    return [p for p in model.parameters() if hasattr(p, "ds_id") and hasattr(p, "ds_status")]


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP (fully_shard, or the FullyShardedDataParallel wrapper) or DeepSpeed ZeRO-3 manages the
    model's weights: every forward gathers them."""
    return bool(fsdp2_modules(model) or fsdp1_modules(model) or zero3_parameters(model))
