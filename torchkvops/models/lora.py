"""LoRA merged into the weights a rollout reads, and those weights put back bit for bit after the call.

Decoding through PEFT's unmerged adapters runs two extra small matmuls per LoRA layer and token. The
usual fix, merge then unmerge by subtracting the same delta (PEFT's `unmerge_adapter`, HybridEngine's
unfuse), does not give the weights back in half precision: `(w + d) - d != w` once `w + d` rounds, and
training then goes on from weights that are no longer its own.

`merged_lora(model)` merges each plain LoRA linear layer with PEFT's safe merge, which writes the merged
weight into a new tensor (`base_layer.weight.data = w.clone() + delta`), and keeps the original tensor
objects; leaving the block points the layers back at those objects. Nothing is subtracted and the
originals are never written, so every parameter is bit-identical (and at the same address) after the
call, in any dtype. Cost: one merged copy of each LoRA-wrapped weight for the call's duration (for all
of a model's linear layers, about the size of the model's weights), and one `B @ A` per layer and call,
small next to a rollout's decode. Under sharding the merge runs after the gather (hf.sharded), on the
gathered weights.

Served: PEFT's `lora.Linear` with vanilla LoRA (no DoRA or other variant) on active, enabled adapters.
Other tuner layers (variants, embeddings, convolutions) keep running unmerged: correct, just not fused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["Merged", "mergeable_lora_layers", "merged_lora"]


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


def _adapters_to_merge(module: nn.Module) -> list[str]:
    """The active adapters of a LoRA layer that the forward runs unmerged now, [] when it runs none or
    one of them is a variant (DoRA, ...) whose merge this module does not serve."""
    if getattr(module, "disable_adapters", False) or _is_sharded(module.get_base_layer().weight):
        return []
    active = [name for name in module.active_adapters if name in module.lora_A and name not in module.merged_adapters]
    if any(name in getattr(module, "lora_variant", {}) for name in active):
        return []
    return active


def mergeable_lora_layers(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """Each LoRA layer `merged_lora` would merge, with the adapters it would merge into it."""
    layers = []
    for module in model.modules():
        if _is_vanilla_lora_linear(module):
            adapters = _adapters_to_merge(module)
            if adapters:
                layers.append((module, adapters))
    return layers


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
                module.merge(safe_merge=True, adapter_names=adapters)
                if base.weight.data.data_ptr() == kept[-1][2].data_ptr():
                    # A merge that wrote the original tensor cannot be undone exactly: refuse it loudly.
                    raise RuntimeError(
                        "torchkvops: PEFT merged a LoRA layer in place; the weights cannot be restored bit for bit "
                        "(pass merge_lora=False)"
                    )
                merged_bytes += base.weight.numel() * base.weight.element_size()
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
