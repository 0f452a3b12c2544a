"""A model's LM head run in float32 while a rollout calls the model (RolloutConfig.lm_head_dtype).

A half-precision head rounds every logit to 8 (bf16) or 11 (fp16) bits before sampling, so the
probabilities a rollout samples from, and the log-probabilities it reports, differ from the ones a
trainer computes by more than the rest of the network does (MiniMax-M1, ScaleRL). TRL's
`cast_lm_head_to_fp32` runs the trainer's head in float32; this does the same on the rollout side: the
head's `forward` is swapped, for the duration of a rollout only, for a float32 linear layer
(`F.linear(hidden.float(), weight32, bias32)`) on a float32 copy of the head's weights. Everything the
model does after its head (logit scaling, say) then runs on float32 logits.

The copy is refreshed at the start of every rollout (one cast of vocab x hidden values: on a GPU well
under a millisecond for a 150k x 1k head), so weights updated in place (an optimizer step, a
`.data.copy_()`) or replaced (`load_state_dict(assign=True)`, a gather into new storage) are always
seen; it keeps its address between rollouts when its shape does, so compiled and CUDA-graphed decode
steps replay on it. A head whose weight is float32 already (TRL's cast) is used as it is, not copied.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Float32LMHead"]

_MISSING = object()


class Float32LMHead:
    """The float32 stand-in for one model's LM head (its `get_output_embeddings()`, an nn.Linear)."""

    def __init__(self, model: nn.Module):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, nn.Linear):
            raise ValueError(
                f"torchkvops: lm_head_dtype=torch.float32 needs the model's LM head "
                f"(get_output_embeddings()) to be an nn.Linear, got {type(head).__name__}"
            )
        self.head = head
        self.weight: Tensor | None = None  # float32 [vocab, hidden]
        self.bias: Tensor | None = None
        self._copies: dict[str, Tensor] = {}  # the float32 buffers this owns, by parameter name
        # One bound method for every rollout: compiled graphs guard on the function they traced.
        self._forward = self._linear

    def _linear(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden.to(torch.float32), self.weight, self.bias)

    def refresh(self) -> None:
        """Make the float32 weights equal the head's current ones (in place when the shape and device
        are unchanged)."""
        self.weight = self._float32("weight")
        self.bias = None if self.head.bias is None else self._float32("bias")

    def _float32(self, name: str) -> Tensor:
        source = getattr(self.head, name)
        if source.dtype == torch.float32:
            return source.detach()
        buffer = self._copies.get(name)
        if buffer is None or buffer.shape != source.shape or buffer.device != source.device:
            buffer = self._copies[name] = torch.empty(source.shape, dtype=torch.float32, device=source.device)
        with torch.no_grad():
            return buffer.copy_(source)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within: the head computes in float32 on freshly copied weights. Whatever `forward` the head
        had as an instance attribute (a patch of someone else's) is put back on leaving."""
        self.refresh()
        previous = vars(self.head).get("forward", _MISSING)
        self.head.forward = self._forward
        try:
            yield
        finally:
            if previous is _MISSING:
                del self.head.forward
            else:
                self.head.forward = previous

    def addresses(self) -> tuple[int, ...]:
        """Where the float32 weights live (a CUDA graph replays on them)."""
        return tuple(t.data_ptr() for t in (self.weight, self.bias) if t is not None)

    def release(self) -> None:
        self.weight = self.bias = None
        self._copies.clear()
