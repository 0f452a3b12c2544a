"""The weights a served call decodes with: a sharded model's gathered once (hf.sharded), then its LoRA
adapters merged into them (models.lora), both undone when the call ends. patch_generate,
torchkvops.generate and torchkvops.distributed.generate share this."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from torch import nn

from ..models.lora import Merged, merge_bytes, merged_lora
from .sharded import GATHER_MODES, Gathered, GatherVote, Settled, gathered_weights, vote

__all__ = ["WeightOptions", "CallWeights", "call_weights", "gather_vote"]


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


def _merge_bytes(model: nn.Module, options: WeightOptions) -> int:
    return merge_bytes(model) if options.merge_lora else 0


def gather_vote(model: nn.Module, options: WeightOptions) -> GatherVote:
    """This process's vote on gathering `model` for a call (hf.sharded.vote; no collective), the merged
    LoRA copies the call allocates next counted against the budget and the free memory."""
    return vote(model, options.gather_weights, options.gather_budget_bytes, _merge_bytes(model, options))


@contextlib.contextmanager
def call_weights(model: nn.Module, options: WeightOptions, settled: Settled | None = None) -> Iterator[CallWeights]:
    """Gather (when sharded), then merge LoRA (when asked and served) for the block; undone in reverse.
    `settled`: the gather decision every process already agreed on for this call; None: the processes
    agree here (a collective every process must join; hf.sharded.gathered_weights)."""
    extra = _merge_bytes(model, options) if settled is None else 0
    with gathered_weights(
        model, options.gather_weights, options.gather_budget_bytes, extra_bytes=extra, settled=settled
    ) as gathered:
        with merged_lora(model, options.merge_lora) as merged:
            yield CallWeights(gathered, merged)
