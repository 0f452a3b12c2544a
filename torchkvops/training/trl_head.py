"""TRL's fused LM head on the CPU: score only the positions it keeps, as it does on GPUs.

TRL's trainers replace the model's forward with a fused LM head (`trl.trainer.utils.add_fused_lm_head`):
`model(..., labels=labels, fused_lm_head=True)` runs the backbone, then projects hidden states through
the LM head in tiles and returns per-token log-probabilities. Which positions it projects depends on the
device: where Triton runs (CUDA, XPU) only those whose label is not -100 (a GRPO pass: the completion
tokens); elsewhere every position, so that the tile shapes do not change from batch to batch (a
compiler's concern on Neuron), and the others are zeroed after. On a CPU a GRPO pass over P-token prompts
and C-token completions then projects P + C positions per row instead of C: on SmolLM2-135M with
474-token prompts and 48-token completions, 11x the head's work, most of each log-prob pass and of the
backward (docs/benchmarks.md). That cost is the same with or without the shared forward, and hides its
gain.

`compact_fused_head(device)` (entered by `patch_forward`'s hooks around each call of a patched model that
TRL's fused head serves) makes TRL take its own compact branch on the CPU for that call: the same
function over the kept positions, and the positions it drops are 0 either way. Only TRL's device test is
answered for the CPU, while the call runs; its kernels still choose Triton or torch ops by their own
test. The kept positions' log-probabilities are those of the full projection up to float rounding (a
position's does not depend on the others', but a matrix product of other rows may round it otherwise);
tests/test_trl.py checks them. Nothing happens where TRL is absent, its head is not in use, or the model
is not on the CPU.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import torch

__all__ = ["compact_fused_head", "uses_trl_fused_head"]

_lock = threading.Lock()
_depth = 0
_trl_device_test = None  # TRL's own `_use_triton`, while a compact call runs


def uses_trl_fused_head(kwargs: dict) -> bool:
    """Whether a causal LM call's keyword arguments ask for TRL's fused LM head."""
    return kwargs.get("fused_lm_head") is True


def _trl_utils():
    """trl.trainer.utils if TRL is imported and has the device test this module answers, else None."""
    utils = sys.modules.get("trl.trainer.utils")
    return utils if utils is not None and callable(getattr(utils, "_use_triton", None)) else None


def _compact_on_cpu(device: torch.device) -> bool:
    return device.type == "cpu" or _trl_device_test(device)


@contextlib.contextmanager
def compact_fused_head(device: torch.device) -> Iterator[None]:
    """While the block runs, TRL's fused head projects only the positions it keeps for CPU tensors too
    (module docstring). Nested and concurrent blocks share one replacement of TRL's test."""
    global _depth, _trl_device_test
    utils = _trl_utils()
    if utils is None or device.type != "cpu":
        yield
        return
    with _lock:
        if _depth == 0:
            _trl_device_test = utils._use_triton
            utils._use_triton = _compact_on_cpu
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                utils._use_triton = _trl_device_test
                _trl_device_test = None
