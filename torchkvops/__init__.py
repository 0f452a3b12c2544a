"""torchkvops: prefill each prompt once, expand its KV cache to N samples with a custom operator."""

import torch

try:
    # Loading the compiled library registers the schemas and kernels; ops.py registers against them.
    from . import _C  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "torchkvops: the compiled library torchkvops._C is missing or broken "
        f"({e}); build it with: pip install --no-build-isolation -e ."
    ) from None

from . import ops  # noqa: E402
from .ops import merge_attention_states, repeat_kv_cache, repeat_kv_cache_  # noqa: E402
from .rollout import Rollout, RolloutConfig, RolloutOutput, RolloutProfile  # noqa: E402
from .generation import GeneratePatch, generate, patch_generate  # noqa: E402
from . import distributed  # noqa: E402  (torchkvops.distributed.generate)

__version__ = "0.1.0"


def has_cuda_kernels() -> bool:
    """True when the CUDA kernels were compiled into torchkvops._C (whether or not a GPU is present)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("torchkvops::repeat_kv_cache_", "CUDA")


__all__ = [
    "generate",
    "patch_generate",
    "GeneratePatch",
    "Rollout",
    "RolloutConfig",
    "RolloutOutput",
    "RolloutProfile",
    "repeat_kv_cache",
    "repeat_kv_cache_",
    "merge_attention_states",
    "has_cuda_kernels",
    "ops",
    "distributed",
    "__version__",
]
