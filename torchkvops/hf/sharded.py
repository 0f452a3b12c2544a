"""Weights gathered once per call for a sharded model, as DeepSpeed's HybridEngine does.

Under FSDP2 (`fully_shard`) every forward all-gathers each sharded unit's parameters through FSDP's
hooks and frees them after: a rollout of R tokens gathers every layer R times. `gathered_weights(model)`
gathers each FSDP module's parameters once before the call (`set_reshard_after_forward(False)`, then
`unshard()`, the order FSDP's docstring gives "for running evals"), takes FSDP's forward hooks off for the
call (with the parameters in place they would only make FSDP's all-gather streams wait on the current
stream, which forks them into a CUDA graph being captured; the mixed-precision input and output casts
they apply are applied by hooks of ours meanwhile), and after the call reshards them and puts back each
module's hooks and reshard-after-forward setting, so that the next training step runs as it would have.

`gather_weights`: "auto" gathers once when the gathered weights fit (a memory budget the caller may set;
on CUDA also the device's free memory; both counting the merged LoRA copies the call adds), else keeps
FSDP's per-step gathers with one warning that says why; "once" gathers once or raises when they do not
fit; "per_step" leaves FSDP's hooks to gather at every forward.

Under DeepSpeed ZeRO-3 every module's forward hook fetches its parameters and releases them after:
`gathered_weights` gathers every partitioned parameter once (`deepspeed.zero.GatheredParameters`) and
takes ZeRO-3's module hooks off for the call, as TRL's `unwrap_model_for_generation` does with
`ds3_gather_for_generation=True`; the parameters are partitioned again when the call ends.

Under FSDP1 (`FullyShardedDataParallel` wrappers inside the model, the root's parameters summoned by the
caller as TRL does) each wrapper's parameters are summoned whole once and its forward bypassed for the
call (FSDP1's forward refuses to run while they are summoned).

A gather is a collective: every process gathers or none does. Each process votes (`GatherVote`: whether
it has something to gather, whether its mode allows it, whether the weights fit, whether it demands
"once"); the votes meet in one all_reduce whose occurrence never depends on what a process found
locally (patch_generate folds it into the call's agreement, hf.generate_contract.agree), and `settle`
turns them into the same decision on every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..models.sharding import fsdp1_modules, fsdp2_modules, fsdp2_param_groups, is_sharded, zero3_parameters

__all__ = [
    "GATHER_MODES",
    "Gathered",
    "GatherVote",
    "Settled",
    "gathered_weights",
    "vote",
    "settle",
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


def _fsdp1_unsharded_bytes(modules: list[nn.Module]) -> int:
    """The bytes the wrappers' flat parameters take once gathered (unpadded)."""
    total = 0
    for module in modules:
        handle = getattr(module, "_handle", None)
        if handle is not None:
            total += handle.flat_param._unpadded_unsharded_size.numel() * handle.flat_param.element_size()
    return total


def _fsdp2_lazy_init(modules: list[nn.Module]) -> None:
    """FSDP initializes each root (an FSDP module inside no other) at its first forward, the gather may
    come first (a fresh model's first call), and a model whose decoder layers are sharded but not the
    model itself has one root per layer. Outermost first, so that a root's initialization marks the
    modules inside it as non-roots before their turn; idempotent."""
    for module in modules:
        module._get_fsdp_state()._lazy_init()


def _unsharded_bytes(modules: list[nn.Module]) -> int:
    """The bytes the modules' parameters take once gathered, in the dtype FSDP gathers them in (its
    mixed-precision param_dtype for floating-point parameters; read from the policy, which FSDP sets at
    fully_shard, not from the parameters' own dtype attributes, which it sets at its lazy init)."""
    total = 0
    for module in modules:
        for group in fsdp2_param_groups(module):
            param_dtype = group.mp_policy.param_dtype
            for param in group.fsdp_params:
                dtype = param.sharded_param.dtype
                if param_dtype is not None and dtype.is_floating_point:
                    dtype = param_dtype
                total += param._orig_size.numel() * dtype.itemsize
    return total


def _fits(need: int, extra: int, budget: int | None, device: torch.device) -> str | None:
    """None when `need` gathered bytes and `extra` bytes allocated next (merged LoRA copies) fit, else why not."""
    what = f"the gathered weights ({need / 2**20:.1f} MiB)"
    if extra:
        what = f"the gathered weights and merged LoRA copies ({need / 2**20:.1f} + {extra / 2**20:.1f} MiB)"
    if budget is not None and need + extra > budget:
        return f"{what} exceed gather_budget_bytes ({budget / 2**20:.1f} MiB)"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need + extra > free:
            return f"{what} exceed the device's free memory ({free / 2**20:.1f} MiB)"
    return None


def _reshard_settings(module: nn.Module) -> tuple:
    """An FSDP module's reshard-after-forward setting as FSDP holds it (set_reshard_after_forward
    overwrites it and has no getter)."""
    state = module._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in fsdp2_param_groups(module)]


def _restore_reshard_settings(module: nn.Module, saved: tuple) -> None:
    state = module._get_fsdp_state()
    state._auto_reshard_after_forward, infos = saved
    for group, info in zip(fsdp2_param_groups(module), infos):
        group.post_forward_mesh_info = info


def _defined_in(prefix: str) -> Callable[[int, object], bool]:
    """Whether a hook was defined in a module whose name starts with `prefix` (a bound method or a
    functools.wraps wrapper carries its function's __module__)."""

    def owned(key: int, hook: object) -> bool:
        module = getattr(hook, "__module__", None)
        return module is not None and module.startswith(prefix)

    return owned


def _fsdp2_hooks(modules: list[nn.Module]) -> Callable[[int, object], bool]:
    """Whether a hook is one of FSDP2's forward hooks on `modules`: by the handles FSDP keeps of the hooks
    it registered (whatever wraps their functions), or by where the hook was defined."""
    keys = set()
    for module in modules:
        state = module._get_fsdp_state()
        for handle in (
            getattr(state, "_pre_forward_hook_handle", None),
            getattr(state, "_post_forward_hook_handle", None),
        ):
            for h in getattr(handle, "handles", (handle,)):  # one handle, or a group's (_MultiHandle)
                if h is not None and hasattr(h, "id"):
                    keys.add(h.id)
    defined_in_fsdp = _defined_in("torch.distributed.fsdp._fully_shard")
    return lambda key, hook: key in keys or defined_in_fsdp(key, hook)


@contextlib.contextmanager
def _forward_hooks_suspended(model: nn.Module, owned: Callable[[int, object], bool]) -> Iterator[None]:
    """Every forward pre-hook and forward hook for which `owned(key, hook)` holds taken off every module
    for the block and put back in its place after it (hooks registered meanwhile are kept, after them).
    Their with-kwargs and always-called flags are keyed by the same ids and stay where they are."""
    saved = []
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            if any(owned(key, hook) for key, hook in hooks.items()):
                saved.append((hooks, list(hooks.items())))
                for key, hook in list(hooks.items()):
                    if owned(key, hook):
                        del hooks[key]
    try:
        yield
    finally:
        for hooks, items in saved:
            added = [(key, hook) for key, hook in hooks.items() if key not in dict(items)]
            hooks.clear()
            hooks.update(items + added)


@contextlib.contextmanager
def _fsdp2_casts(modules: list[nn.Module]) -> Iterator[None]:
    """The dtype casts FSDP2's forward hooks apply under a mixed-precision policy (floating-point inputs to
    param_dtype when cast_forward_inputs, outputs to output_dtype), as hooks of ours for the block: what
    FSDP's hooks would still do with the parameters gathered, without their stream waits."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    handles = []
    try:
        for module in modules:
            policy = module._get_fsdp_state()._mp_policy
            if policy.cast_forward_inputs and policy.param_dtype is not None:
                cast = lambda t, dtype=policy.param_dtype: _cast_fp_tensor(dtype, t)  # noqa: E731
                handles.append(
                    module.register_forward_pre_hook(
                        lambda m, args, kwargs, cast=cast: (
                            _apply_to_tensors(cast, args),
                            _apply_to_tensors(cast, kwargs),
                        ),
                        prepend=True,
                        with_kwargs=True,
                    )
                )
            if policy.output_dtype is not None:
                cast = lambda t, dtype=policy.output_dtype: _cast_fp_tensor(dtype, t)  # noqa: E731
                handles.append(module.register_forward_hook(lambda m, i, out, cast=cast: _apply_to_tensors(cast, out)))
        yield
    finally:
        for handle in handles:
            handle.remove()


# --- what a process would gather, and the decision every process takes from the votes ---------------
@dataclasses.dataclass
class _GatherPlan:
    """How one engine gathers a model's weights: the `engine`'s name (for the fallback warning), the
    `units` it gathers and their `need` bytes, the `device` they live on, and `gather()`, a context
    manager within which they stay gathered."""

    engine: str
    units: int
    need: int
    device: torch.device
    gather: Callable[[], contextlib.AbstractContextManager]


def _gather_plan(model: nn.Module, device: torch.device | None) -> _GatherPlan | None:
    """The plan of the engine that shards `model` (FSDP2, ZeRO-3 or FSDP1), None when none does. No
    collective."""
    modules = fsdp2_modules(model)
    if modules:
        _fsdp2_lazy_init(modules)
        device = device or next(model.parameters()).device
        return _GatherPlan(
            "FSDP", len(modules), _unsharded_bytes(modules), device, lambda: _fsdp2_gathered(model, modules)
        )
    params = zero3_parameters(model)
    if params:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        # What is partitioned now (TRL's ds3_gather_for_generation may have gathered everything already).
        partitioned = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        need = sum(p.ds_numel * p.element_size() for p in partitioned)
        gather = lambda: _zero3_gathered(partitioned, model)  # noqa: E731
        return _GatherPlan("ZeRO-3", len(partitioned), need, device or params[0].device, gather)
    wrappers = fsdp1_modules(model)
    if wrappers:
        handles = [w._handle for w in wrappers if w._handle is not None]
        device = device or (handles[0].flat_param.device if handles else torch.device("cpu"))
        need = _fsdp1_unsharded_bytes(wrappers)
        return _GatherPlan("FSDP", len(wrappers), need, device, lambda: _fsdp1_gathered(wrappers))
    return None


@dataclasses.dataclass(frozen=True)
class GatherVote:
    """One process's say in whether a call gathers: `units` (it has weights to gather), `allowed` (its
    gather_weights is not "per_step"), `why_not` (why its weights would not fit, None: they fit), `once`
    (it demands a gather). Sent to the others as `ints()`, combined by an elementwise MIN. `plan`: how this
    process would gather (None: its model is not sharded), which a decision to gather carries on."""

    units: bool
    allowed: bool
    why_not: str | None
    once: bool
    mode: str = "auto"
    plan: _GatherPlan | None = None

    def ints(self) -> list[int]:
        return [int(self.units), int(self.allowed), int(self.why_not is None), -int(self.once)]


# What a process whose call falls back sends: it changes no MIN (every process falls back anyway).
NEUTRAL_VOTE = [1, 1, 1, 0]


def vote(
    model: nn.Module,
    mode: str = "auto",
    budget_bytes: int | None = None,
    extra_bytes: int = 0,
    device: torch.device | None = None,
) -> GatherVote:
    """This process's vote on gathering `model`'s weights for a call (no collective). `extra_bytes`: what
    the call allocates next to the gathered weights (merged LoRA copies), counted against the budget."""
    _check_mode(mode)
    plan = _gather_plan(model, device)
    if plan is None or plan.units == 0:
        return GatherVote(False, mode != "per_step", None, mode == "once", mode, plan)
    why_not = None if mode == "per_step" else _fits(plan.need, extra_bytes, budget_bytes, plan.device)
    return GatherVote(True, mode != "per_step", why_not, mode == "once", mode, plan)


@dataclasses.dataclass(frozen=True)
class Settled:
    """What every process decided for a call: `gather` (gather once, as `plan` says), else `why_not` (None
    when there was nothing to gather)."""

    gather: bool
    why_not: str | None = None
    plan: _GatherPlan | None = None


def settle(local: GatherVote, everyone: list[int]) -> Settled:
    """The decision from this process's vote and the MIN of every process's `ints()` (the same list on
    every process, so the same decision everywhere, and every process raises if any does). Raises
    ValueError when a process demanded "once" and the weights are not gathered; warns once per call
    where this process's mode is "auto" and the weights stay sharded."""
    units, allowed, fits, not_once = everyone
    if not units:
        return Settled(False)
    if allowed and fits:
        return Settled(True, plan=local.plan)
    if local.why_not is not None:
        why_not = local.why_not
    elif not allowed:
        why_not = "a process gathers at every step (gather_weights='per_step')"
    else:
        why_not = "the gathered weights do not fit on another process"
    if not_once < 0:
        raise ValueError(f"torchkvops: gather_weights='once' (on at least one process), but {why_not}")
    if local.mode == "auto":
        warnings.warn(
            f"torchkvops: decode gathers the sharded weights at every step ({local.plan.engine}'s own hooks), "
            f"because {why_not}; raise gather_budget_bytes or pass gather_weights='per_step' to silence this",
            RuntimeWarning,
            stacklevel=4,
        )
    return Settled(False, why_not)


def _settle_here(local: GatherVote, device: torch.device) -> Settled:
    """`settle` with every process's votes, gathered by one all_reduce (none in a single process).
    Every process must call it: the gather that follows is a collective too."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return settle(local, local.ints())
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    votes = torch.tensor(local.ints(), dtype=torch.long, device=on)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN)
    return settle(local, votes.tolist())  # host sync: four ints, once per call


def _check_mode(mode: str) -> None:
    if mode not in GATHER_MODES:
        raise ValueError(
            f"torchkvops: gather_weights must be one of {', '.join(map(repr, GATHER_MODES))}, got {mode!r}"
        )


@contextlib.contextmanager
def gathered_weights(
    model: nn.Module,
    mode: str = "auto",
    budget_bytes: int | None = None,
    device: torch.device | None = None,
    *,
    extra_bytes: int = 0,
    settled: Settled | None = None,
) -> Iterator[Gathered]:
    """Within the block, `model`'s FSDP2-, FSDP1- or ZeRO-3-sharded parameters stay gathered (module
    docstring). `settled`: the decision the processes already agreed on for this call (`settle`); None:
    agree here (one all_reduce that every process must join). Yields what was gathered
    (`Gathered.units == 0`: nothing, the model is not sharded or the weights stay sharded)."""
    _check_mode(mode)
    if settled is None:
        local = vote(model, mode, budget_bytes, extra_bytes, device)
        settled = Settled(False) if local.plan is None else _settle_here(local, local.plan.device)
    plan = settled.plan if settled.gather else None
    if plan is None or plan.units == 0:
        yield Gathered()
        return
    start = time.perf_counter()
    with plan.gather():
        if plan.device.type == "cuda":
            torch.cuda.synchronize(plan.device)
        yield Gathered(plan.units, plan.need, (time.perf_counter() - start) * 1e3)


# --- each engine's gather ------------------------------------------------------------------------------
@contextlib.contextmanager
def _fsdp2_gathered(model: nn.Module, modules: list[nn.Module]) -> Iterator[None]:
    """FSDP2: each module's reshard-after-forward turned off and its parameters unsharded, then FSDP's
    forward hooks off for the block (their mixed-precision casts applied by ours, `_fsdp2_casts`); after
    the block, the hooks back, each module resharded and its own setting put back."""
    saved = [(m, _reshard_settings(m)) for m in modules]
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        with _forward_hooks_suspended(model, _fsdp2_hooks(modules)), _fsdp2_casts(modules):
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
    again when it ends), with ZeRO-3's module hooks (fetch before a module's forward, release after it,
    all defined in deepspeed.runtime.zero) off for the block, as TRL's unwrap_model_for_generation removes
    and re-adds them: with the parameters gathered for the whole call, a hook would release them after
    the first forward. The coordinator never sees the call's forwards, so its recorded trace of the
    training forward stays valid. Parameters ZeRO-3 keeps whole (persistent, below its threshold) are
    left as they are."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, enabled=bool(partitioned)):
        with _forward_hooks_suspended(model, _defined_in("deepspeed.")):
            yield
