"""The few collectives a synced generate call makes (HF's synced_gpus: FSDP, ZeRO-3), below both
`torchkvops.distributed` (the sharded rollout's exchange) and `torchkvops.hf` (the drop-in's agreement
between processes), which each import them: neither reaches up into the other for them."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["initialized", "collective_device", "all_min", "ended_everywhere"]


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def collective_device(group=None) -> torch.device:
    """Where the group's backend takes tensors: the current CUDA device for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_min(values: list[int], group=None) -> list[int]:
    """The elementwise minimum of every process's `values` (the same length on every process): one
    all_reduce. A call's agreement (hf.generate_contract.agree) sends its flags and counts through it."""
    t = torch.tensor(values, dtype=torch.long, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]  # host sync: a few ints, once per call


def ended_everywhere(ended: bool, group=None) -> bool:
    """Whether every process's rows have ended: the all-ended check of a synced rollout (one all_reduce
    where a rollout alone reads its own flags)."""
    t = torch.tensor([int(ended)], dtype=torch.long, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())
