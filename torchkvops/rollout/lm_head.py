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

Float32 means float32: a trainer that allows TF32 (`torch.backends.cuda.matmul.allow_tf32`,
`torch.set_float32_matmul_precision("high")`, which also lets oneDNN round float32 matmuls on a CPU)
would otherwise round the head's inputs to 10 bits. The head's matmul runs at full float32 precision
and the caller's settings are put back after it, exactly, in eager and CUDA-graphed decode (a graph keeps
the kernel chosen while it was captured); code that torch.compile traces keeps the process's setting
(Inductor drops a setting changed inside the graph).

A LoRA adapter on the head (PEFT's lora.Linear around it) stays in the forward: the float32 layer
stands in for its base layer, so the adapter's output is added to float32 logits (and when the call
merges LoRA, models.lora, the copy is made of the merged weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Float32LMHead", "full_float32_matmuls"]

_MISSING = object()


@contextlib.contextmanager
def full_float32_matmuls() -> Iterator[None]:
    """Float32 matmuls at full precision within the block (no TF32 on CUDA, no bf16 or TF32 rounding by
    oneDNN on a CPU), and afterwards the caller's settings exactly as they were. torch holds a global
    setting (`set_float32_matmul_precision`) and per-backend ones (`torch.backends.*.matmul.
    fp32_precision`) and raises where a caller reads or uses one after setting the other to disagree, so
    this changes only the API the caller's settings are read through: the global one when it reads
    (setting it sets the backends' too), else the backends' alone; and restores in that order."""
    backends = [b for b in (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul) if hasattr(b, "fp32_precision")]
    own = [b.fp32_precision for b in backends]
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # the caller set the per-backend API to disagree with the global one
        legacy = None
    if legacy in (None, "highest") and all(p in ("ieee", "none") for p in own):
        yield  # (full precision already: the common case costs a few reads)
        return
    if legacy is not None:
        torch.set_float32_matmul_precision("highest")
    for backend in backends:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for backend, precision in zip(backends, own):
            backend.fp32_precision = precision


class Float32LMHead:
    """The float32 stand-in for one model's LM head (its `get_output_embeddings()`, an nn.Linear)."""

    def __init__(self, model: nn.Module):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        base = head.get_base_layer() if callable(getattr(head, "get_base_layer", None)) else head  # PEFT's tuner
        if not isinstance(base, nn.Linear):
            kind = "nothing" if head is None else f"{type(head).__module__}.{type(head).__qualname__}"
            wraps = "" if base is head else f" around {type(base).__module__}.{type(base).__qualname__}"
            raise ValueError(
                f"torchkvops: lm_head_dtype=torch.float32 needs the model's LM head (get_output_embeddings()) "
                f"to be a torch.nn.Linear (or a PEFT adapter layer around one), got {kind}{wraps}; leave "
                "lm_head_dtype unset to sample from the head's own dtype"
            )
        self.head = base
        self.weight: Tensor | None = None  # float32 [vocab, hidden]
        self.bias: Tensor | None = None
        self._copies: dict[str, Tensor] = {}  # the float32 buffers this owns, by parameter name
        # One bound method for every rollout: compiled graphs guard on the function they traced.
        self._forward = self._linear

    def _linear(self, hidden: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # (Inductor would drop the precision setting: module docstring)
            return F.linear(hidden.to(torch.float32), self.weight, self.bias)
        with full_float32_matmuls():
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
