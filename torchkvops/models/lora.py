"""LoRA merged into the weights a rollout reads, and those weights put back bit for bit after the call.

Decoding through PEFT's unmerged adapters runs two extra small matmuls per LoRA layer and token. The
usual fix, merge then unmerge by subtracting the same delta (PEFT's `unmerge_adapter`, HybridEngine's
unfuse), does not give the weights back in half precision: `(w + d) - d != w` once `w + d` rounds, and
training then goes on from weights that are no longer its own.

`merged_lora(model)` points each plain LoRA linear layer's base weight (and bias) at a copy, merges the
adapters into the copy with PEFT's own merge (`merge(safe_merge=False)`: the weights PEFT's
`merge_and_unload()` makes, rounded once into the weight's dtype, and no NaN check: an adapter holding a
NaN decodes as PEFT's forward does, with NaN there), and keeps the original tensor objects; leaving the
block points the layers back at them. Nothing is subtracted and the originals are never written, so
every parameter is bit-identical (and at the same address) after the call, in any dtype. Cost: one
merged copy of each LoRA-wrapped weight for the call's duration (for all of a model's linear layers,
about the size of the model's weights; `merge_bytes`), and one `B @ A` per layer and call, small next
to a rollout's decode. Under sharding the merge runs after the gather (hf.sharded), on the gathered
weights.

What merging keeps: the merged layer computes `x @ (W + s B A)^T` where PEFT computes `x @ W^T + s (x @
A^T) @ B^T`. In float32 the two differ by float32 rounding. In bf16 or fp16 the merged weight is rounded
once to 8 or 11 bits, while PEFT adds the adapter's output in the adapter's dtype (float32 by PEFT's
default `autocast_adapter_dtype`): logits differ at that rounding's scale, so greedy tokens can differ
at near ties; the tokens are those of the model `merge_and_unload()` returns. `merge_lora=False` runs
PEFT's own layers (its generate's computation). The merge is exact only where the adapter's forward is
linear in its input with nothing random: an adapter whose dropout is active (a module in train mode
with `lora_dropout > 0`, or any dropout module but nn.Identity and nn.Dropout) runs unmerged, drawing
its dropout as PEFT's forward does.

Served: PEFT's `lora.Linear` with vanilla LoRA (no DoRA or other variant) on active, enabled adapters.
Other tuner layers (variants, embeddings, convolutions) keep running unmerged: correct, just not fused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator

import torch
from torch import nn

from .precision import forward_dtypes

__all__ = ["Merged", "mergeable_lora_layers", "merged_lora", "merge_bytes"]


@dataclasses.dataclass
class Merged:
    """What `merged_lora` did for one call: `layers` LoRA layers merged (0: none), `bytes` the merged
    weights it allocated, `ms` the time the merge took (host clock, after a device sync)."""

    layers: int = 0
    bytes: int = 0
    ms: float = 0.0


def _is_vanilla_lora_linear(module: nn.Module) -> bool:
    """PEFT's lora.Linear (checked by what merging reads, so that peft need not be importable here)."""
    if type(module).__name__ != "Linear" or not type(module).__module__.startswith("peft.tuners.lora"):
        return False
    return all(hasattr(module, name) for name in ("lora_A", "lora_B", "merged_adapters", "get_base_layer", "merge"))


def _is_sharded(weight: torch.Tensor) -> bool:
    """A weight FSDP2 holds sharded (a DTensor) or ZeRO-3 holds partitioned (not AVAILABLE): merged only
    once gathered (hf.sharded)."""
    if type(weight).__name__ == "DTensor" or type(weight.data).__name__ == "DTensor":
        return True
    status = getattr(weight, "ds_status", None)
    return status is not None and getattr(status, "name", "") != "AVAILABLE"


def _linear_without_noise(dropout: nn.Module | None) -> bool:
    """Whether an adapter's dropout leaves its input as it is: nn.Identity, or an nn.Dropout that draws
    nothing (p = 0 or eval mode). Any other module may be random or non-linear: not merged."""
    if dropout is None or isinstance(dropout, nn.Identity):
        return True
    return type(dropout) is nn.Dropout and (dropout.p == 0 or not dropout.training)


def _adapters_to_merge(module: nn.Module, sharded_too: bool = False) -> list[str]:
    """The active adapters of a LoRA layer that the forward runs unmerged now, [] when it runs none or
    one of them cannot be merged exactly: a variant (DoRA, ...) whose merge this module does not serve, or
    an adapter whose dropout is active (module docstring). A layer whose base weight is sharded now counts
    only with `sharded_too` (it is merged once gathered)."""
    if getattr(module, "disable_adapters", False):
        return []
    if not sharded_too and _is_sharded(module.get_base_layer().weight):
        return []
    active = [name for name in module.active_adapters if name in module.lora_A and name not in module.merged_adapters]
    if any(name in getattr(module, "lora_variant", {}) for name in active):
        return []
    dropouts = getattr(module, "lora_dropout", {})
    if not all(_linear_without_noise(dropouts[name] if name in dropouts else None) for name in active):
        return []
    return active


def mergeable_lora_layers(model: nn.Module, sharded_too: bool = False) -> list[tuple[nn.Module, list[str]]]:
    """Each LoRA layer `merged_lora` would merge, with the adapters it would merge into it; with
    `sharded_too`, also those whose weights are sharded now (merged once gathered)."""
    layers = []
    for module in model.modules():
        if _is_vanilla_lora_linear(module):
            adapters = _adapters_to_merge(module, sharded_too)
            if adapters:
                layers.append((module, adapters))
    return layers


def merge_bytes(model: nn.Module) -> int:
    """The bytes `merged_lora(model)` will allocate for its merged copies once the weights are gathered:
    each mergeable layer's whole base weight (and bias), in the dtype the forward sees it in (FSDP's
    mixed-precision param_dtype; a ZeRO-3 partition's full `ds_shape`)."""
    dtypes = forward_dtypes(model)
    total = 0
    for module, _ in mergeable_lora_layers(model, sharded_too=True):
        base = module.get_base_layer()
        for tensor in (base.weight, getattr(base, "bias", None)):
            if tensor is not None:
                shape = getattr(tensor, "ds_shape", None) or tensor.shape
                total += math.prod(shape) * dtypes.get(id(tensor), tensor.dtype).itemsize
    return total


@contextlib.contextmanager
def merged_lora(model: nn.Module, enabled: bool = True) -> Iterator[Merged]:
    """Within the block, `model`'s plain LoRA linear layers run with their active adapters merged into
    the base weights; after it, the layers run unmerged on their original, untouched weight tensors
    (module docstring). Yields what was merged (`Merged.layers == 0`: nothing)."""
    layers = mergeable_lora_layers(model) if enabled else []
    if not layers:
        yield Merged()
        return
    device = next(model.parameters()).device
    kept = []  # (layer, merged_adapters before, its base layer's weight and bias tensors)
    start = time.perf_counter()
    merged_bytes = 0
    try:
        with torch.no_grad():
            for module, adapters in layers:
                base = module.get_base_layer()
                bias = base.bias.data if getattr(base, "bias", None) is not None else None
                kept.append((module, list(module.merged_adapters), base.weight.data, bias))
                # PEFT's plain merge adds into `.data` in place: into copies, so that the originals stay.
                base.weight.data = base.weight.data.clone()
                if bias is not None:
                    base.bias.data = bias.clone()
                module.merge(safe_merge=False, adapter_names=adapters)
                merged_bytes += base.weight.numel() * base.weight.element_size()
                if bias is not None:
                    merged_bytes += base.bias.numel() * base.bias.element_size()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        yield Merged(len(layers), merged_bytes, (time.perf_counter() - start) * 1e3)
    finally:
        for module, merged_before, weight, bias in reversed(kept):
            base = module.get_base_layer()
            base.weight.data = weight
            if bias is not None:
                base.bias.data = bias
            module.merged_adapters[:] = merged_before
