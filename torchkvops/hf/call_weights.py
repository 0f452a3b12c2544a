"""The weights a served call decodes with: a sharded model's gathered once (hf.sharded), then its LoRA
adapters merged into them (models.lora), both undone when the call ends. patch_generate,
torchkvops.generate and torchkvops.distributed.generate share this."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from torch import nn

from ..models.lora import Merged, merged_lora
from .sharded import GATHER_MODES, Gathered, gathered_weights

__all__ = ["WeightOptions", "CallWeights", "call_weights"]


@dataclasses.dataclass(frozen=True)
class WeightOptions:
    """`gather_weights` ("auto", "once", "per_step") and `gather_budget_bytes` (None: no budget): how a
    sharded model's weights are gathered (hf.sharded); `merge_lora`: PEFT LoRA layers merged for the call
    and restored bit for bit after it (models.lora)."""

    gather_weights: str = "auto"
    gather_budget_bytes: int | None = None
    merge_lora: bool = True

    def check(self, where: str) -> WeightOptions:
        if self.gather_weights not in GATHER_MODES:
            raise ValueError(
                f"{where}: gather_weights must be one of {', '.join(map(repr, GATHER_MODES))}, "
                f"got {self.gather_weights!r}"
            )
        budget = self.gather_budget_bytes
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise ValueError(f"{where}: gather_budget_bytes must be None or an int >= 0 (bytes), got {budget!r}")
        if not isinstance(self.merge_lora, bool):
            raise ValueError(f"{where}: merge_lora must be a bool, got {self.merge_lora!r}")
        return self


@dataclasses.dataclass
class CallWeights:
    """What was done to the weights for one call."""

    gathered: Gathered
    merged: Merged


@contextlib.contextmanager
def call_weights(model: nn.Module, options: WeightOptions) -> Iterator[CallWeights]:
    """Gather (when sharded), then merge LoRA (when asked and served) for the block; undone in reverse."""
    with gathered_weights(model, options.gather_weights, options.gather_budget_bytes) as gathered:
        with merged_lora(model, options.merge_lora) as merged:
            yield CallWeights(gathered, merged)
