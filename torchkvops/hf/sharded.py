"""Weights gathered once per call for a sharded model, as DeepSpeed's HybridEngine does.

Under FSDP2 (`fully_shard`) every forward all-gathers each sharded unit's parameters through FSDP's
hooks and frees them after: a rollout of R tokens gathers every layer R times. `gathered_weights(model)`
gathers each FSDP module's parameters once before the call (`set_reshard_after_forward(False)`, then
`unshard()`, the order FSDP's docstring gives "for running evals"), so the call's forwards issue no
parameter collective (FSDP's hooks find the parameters unsharded and return), and after the call
reshards them and puts back each module's own reshard-after-forward setting, so that the next training
step runs as it would have.

`gather_weights`: "auto" gathers once when the gathered weights fit (a memory budget the caller may set;
on CUDA also the device's free memory), else keeps FSDP's per-step gathers with one warning that says
why; "once" gathers once or raises when they do not fit; "per_step" leaves FSDP's hooks to gather at
every forward (today's behaviour).

Under DeepSpeed ZeRO-3 every module's forward hook fetches its parameters and releases them after:
`gathered_weights` gathers every partitioned parameter once (`deepspeed.zero.GatheredParameters`) and
takes ZeRO-3's module hooks off for the call, as TRL's `unwrap_model_for_generation` does with
`ds3_gather_for_generation=True`; the parameters are partitioned again when the call ends.

Under FSDP1 (`FullyShardedDataParallel` wrappers inside the model, the root's parameters summoned by the
caller as TRL does) each wrapper's parameters are summoned whole once and its forward bypassed for the
call (FSDP1's forward refuses to run while they are summoned).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Iterator

import torch
from torch import nn

__all__ = [
    "GATHER_MODES",
    "Gathered",
    "gathered_weights",
    "fsdp2_modules",
    "fsdp1_modules",
    "zero3_parameters",
    "is_sharded",
]

GATHER_MODES = ("auto", "once", "per_step")


@dataclasses.dataclass
class Gathered:
    """What `gathered_weights` did for one call: `units` gathered (FSDP2 modules, FSDP1 wrappers or ZeRO-3
    parameters; 0: none), `bytes` their gathered parameters' size, `ms` the time the gather took (host
    clock, after a device sync)."""

    units: int = 0
    bytes: int = 0
    ms: float = 0.0


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules (`fully_shard`) among `model`'s modules, outermost first; [] without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without torch.distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp1_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP1 wrappers (`FullyShardedDataParallel`) among `model`'s modules, outermost first."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - a torch without torch.distributed
        return []
    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def _fsdp1_unsharded_bytes(modules: list[nn.Module]) -> int:
    """The bytes the wrappers' flat parameters take once gathered (unpadded)."""
    total = 0
    for module in modules:
        handle = getattr(module, "_handle", None)
        if handle is not None:
            total += handle.flat_param._unpadded_unsharded_size.numel() * handle.flat_param.element_size()
    return total


def _unsharded_bytes(modules: list[nn.Module]) -> int:
    """The bytes the modules' parameters take once gathered (in the dtype FSDP gathers them in)."""
    total = 0
    for module in modules:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                dtype = param.param_dtype or param.orig_dtype
                total += param._orig_size.numel() * dtype.itemsize
    return total


def _fits(need: int, budget: int | None, device: torch.device) -> str | None:
    """None when `need` bytes fit, else why not."""
    if budget is not None and need > budget:
        return f"the gathered weights ({need / 2**20:.1f} MiB) exceed gather_budget_bytes ({budget / 2**20:.1f} MiB)"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            return f"the gathered weights ({need / 2**20:.1f} MiB) exceed the device's free memory ({free / 2**20:.1f} MiB)"
    return None


def _agree(why_not: str | None, device: torch.device) -> str | None:
    """Every process gathers or none does (a gather is a collective): `why_not` where this process's
    weights fit on every process, else the reason (another process's, if only its did not fit)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return why_not
    flag = torch.tensor([0 if why_not is None else 1], device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and why_not is None:
        return "the gathered weights do not fit on another process"
    return why_not


def _reshard_settings(module: nn.Module) -> tuple:
    """An FSDP module's reshard-after-forward setting as FSDP holds it (set_reshard_after_forward
    overwrites it and has no getter)."""
    state = module._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups]


def _restore_reshard_settings(module: nn.Module, saved: tuple) -> None:
    state = module._get_fsdp_state()
    state._auto_reshard_after_forward, infos = saved
    for group, info in zip(state._fsdp_param_groups, infos):
        group.post_forward_mesh_info = info


def zero3_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters DeepSpeed ZeRO-3 partitions (they carry its `ds_id` and `ds_status`); [] without
    ZeRO-3 (checked by attribute, so that deepspeed need not be installed)."""
    return [p for p in model.parameters() if hasattr(p, "ds_id") and hasattr(p, "ds_status")]


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP (fully_shard, or the FullyShardedDataParallel wrapper) or DeepSpeed ZeRO-3 manages the
    model's weights: every forward gathers them."""
    return bool(fsdp2_modules(model) or fsdp1_modules(model) or zero3_parameters(model))


@contextlib.contextmanager
def _zero3_hooks_suspended(model: nn.Module) -> Iterator[None]:
    """ZeRO-3's module hooks (fetch before a module's forward, release after it, and their backward
    counterparts; all defined in deepspeed.runtime.zero) taken off every module for the block and put back
    in their places after it, as TRL's unwrap_model_for_generation removes and re-adds them: with the
    parameters gathered for the whole call, a hook would release them after the first forward. The
    coordinator never sees the call's forwards, so its recorded trace of the training forward stays valid."""
    saved = []
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            if any(getattr(hook, "__module__", "").startswith("deepspeed.") for hook in hooks.values()):
                saved.append((hooks, list(hooks.items())))
                for key, hook in list(hooks.items()):
                    if getattr(hook, "__module__", "").startswith("deepspeed."):
                        del hooks[key]
    try:
        yield
    finally:
        for hooks, items in saved:
            added = [(key, hook) for key, hook in hooks.items() if key not in dict(items)]
            hooks.clear()
            hooks.update(items + added)


def _fall_back(why_not: str, mode: str, engine: str) -> None:
    if mode == "once":
        raise ValueError(f"torchkvops: gather_weights='once', but {why_not}")
    warnings.warn(
        f"torchkvops: decode gathers the sharded weights at every step ({engine}'s own hooks), because {why_not}; "
        "raise gather_budget_bytes or pass gather_weights='per_step' to silence this",
        RuntimeWarning,
        stacklevel=4,
    )


@dataclasses.dataclass
class _GatherPlan:
    """How one engine gathers a model's weights: the `engine`'s name (for the fallback warning), the
    `units` it gathers and their `need` bytes, the `device` they live on, and `gather`, a context manager
    within which they stay gathered."""

    engine: str
    units: int
    need: int
    device: torch.device
    gather: contextlib.AbstractContextManager


def _gather_plan(model: nn.Module, device: torch.device | None) -> _GatherPlan | None:
    """The plan of the engine that shards `model` (FSDP2, ZeRO-3 or FSDP1), None when none does."""
    modules = fsdp2_modules(model)
    if modules:
        # FSDP initializes its root (the outermost FSDP module: dtypes, streams) at its first forward; the
        # gather may come first (a fresh model's first call). Idempotent.
        modules[0]._get_fsdp_state()._lazy_init()
        device = device or next(model.parameters()).device
        return _GatherPlan("FSDP", len(modules), _unsharded_bytes(modules), device, _fsdp2_gathered(modules))
    params = zero3_parameters(model)
    if params:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        # What is partitioned now (TRL's ds3_gather_for_generation may have gathered everything already).
        partitioned = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        need = sum(p.ds_numel * p.element_size() for p in partitioned)
        gather = _zero3_gathered(partitioned, model)
        return _GatherPlan("ZeRO-3", len(partitioned), need, device or params[0].device, gather)
    wrappers = fsdp1_modules(model)
    if wrappers:
        handles = [w._handle for w in wrappers if w._handle is not None]
        device = device or (handles[0].flat_param.device if handles else torch.device("cpu"))
        return _GatherPlan("FSDP", len(wrappers), _fsdp1_unsharded_bytes(wrappers), device, _fsdp1_gathered(wrappers))
    return None


@contextlib.contextmanager
def gathered_weights(
    model: nn.Module, mode: str = "auto", budget_bytes: int | None = None, device: torch.device | None = None
) -> Iterator[Gathered]:
    """Within the block, `model`'s FSDP2-, FSDP1- or ZeRO-3-sharded parameters stay gathered (module
    docstring). Yields what was gathered (`Gathered.units == 0`: nothing, the model is not sharded or mode
    is "per_step" or the weights did not fit or were gathered already)."""
    if mode not in GATHER_MODES:
        raise ValueError(
            f"torchkvops: gather_weights must be one of {', '.join(map(repr, GATHER_MODES))}, got {mode!r}"
        )
    plan = None if mode == "per_step" else _gather_plan(model, device)
    if plan is None:
        yield Gathered()
        return
    why_not = _agree(_fits(plan.need, budget_bytes, plan.device), plan.device)
    if why_not is not None:
        _fall_back(why_not, mode, plan.engine)
        yield Gathered()
        return
    start = time.perf_counter()
    with plan.gather:
        if plan.device.type == "cuda":
            torch.cuda.synchronize(plan.device)
        yield Gathered(plan.units, plan.need, (time.perf_counter() - start) * 1e3 if plan.units else 0.0)


@contextlib.contextmanager
def _fsdp2_gathered(modules: list[nn.Module]) -> Iterator[None]:
    """FSDP2: each module's reshard-after-forward turned off and its parameters unsharded; after the block,
    resharded and each module's own setting put back."""
    saved = [(m, _reshard_settings(m)) for m in modules]
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        yield
    finally:
        for m, settings in saved:
            m.reshard()
            _restore_reshard_settings(m, settings)


@contextlib.contextmanager
def _fsdp1_gathered(wrappers: list[nn.Module]) -> Iterator[None]:
    """FSDP1: each outermost wrapper's parameters summoned whole once (`summon_full_params(recurse=True,
    writeback=False)`), and every wrapper's forward pointed at the module it wraps for the block (FSDP1's
    own forward refuses to run while its parameters are summoned, and would gather them again); put back
    and resharded after. The root wrapper is not inside the model a caller patches (TRL summons its
    parameters, `recurse=False`, around generate)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    inside = {id(m) for w in wrappers for m in w.modules() if m is not w}
    with contextlib.ExitStack() as stack:
        for wrapper in wrappers:
            if id(wrapper) not in inside:  # the outermost: recurse=True summons those inside it
                stack.enter_context(FullyShardedDataParallel.summon_full_params(wrapper, recurse=True, writeback=False))
        try:
            for wrapper in wrappers:
                wrapper.forward = wrapper._fsdp_wrapped_module.forward
            yield
        finally:
            for wrapper in wrappers:
                vars(wrapper).pop("forward", None)


@contextlib.contextmanager
def _zero3_gathered(partitioned: list[nn.Parameter], model: nn.Module) -> Iterator[None]:
    """ZeRO-3: the partitioned parameters gathered by one `deepspeed.zero.GatheredParameters` (partitioned
    again when it ends), with ZeRO-3's module hooks off for the block. Parameters ZeRO-3 keeps whole
    (persistent, below its threshold) are left as they are."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, enabled=bool(partitioned)):
        with _zero3_hooks_suspended(model):
            yield
