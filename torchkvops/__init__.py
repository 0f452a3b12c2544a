"""torchkvops: prefill each prompt once, expand its KV cache to N samples with a custom operator.

`import torchkvops` imports torchkvops.ops, which loads torch and the compiled library (torchkvops._C)
before it registers fake kernels and autograd formulas, so `torch.ops.torchkvops.*` work right after it.
The rest (`Rollout`, `generate`, `patch_forward`, ..., and the subpackages `torchkvops.rollout`,
`torchkvops.distributed`, `torchkvops.models`, ...) is imported on first use (PEP 562 module `__getattr__`):
it needs transformers.

`python -m torchkvops --help` needs no torch. While `python -m` locates a module it imports the module's
packages with sys.argv[0] set to "-m" (documented under Python's -m option); during that import this
package leaves torchkvops.ops for first use too. What runs next is torchkvops/__main__.py, the command
line, which parses its arguments before it imports torchkvops.ops. The marker does not name the module
`-m` runs: in a package started with `python -m pkg` whose __init__ imports torchkvops, the ops load at
the first use of a torchkvops name or module (every module that calls the ops imports torchkvops.ops),
not at the import itself.
"""

import importlib as _importlib
import sys as _sys

__version__ = "0.1.0"

# Public names imported on first use, and the submodule each comes from.
_LAZY_NAMES = {
    "repeat_kv_cache": "ops",
    "repeat_kv_cache_": "ops",
    "merge_attention_states": "ops",
    "paged_attention": "ops",
    "Rollout": "rollout",
    "RolloutConfig": "rollout",
    "RolloutOutput": "rollout",
    "RolloutProfile": "rollout",
    "generate": "hf.generate_patch",
    "patch_generate": "hf.generate_patch",
    "GeneratePatch": "hf.generate_patch",
    "patch_forward": "training.shared_forward",
    "ForwardPatch": "training.shared_forward",
    "SharedForwardConfig": "training.shared_forward",
    "SharedForwardStats": "training.shared_forward",
}
# Submodules reachable as attributes without an import statement (`torchkvops.rollout.Rollout`).
_SUBMODULES = frozenset(
    {"ops", "reference", "fused_attention", "utils", "models", "rollout", "training", "hf", "distributed", "deepspeed"}
)


def has_cuda_kernels() -> bool:
    """True when the CUDA kernels were compiled into torchkvops._C (whether or not a GPU is present)."""
    import torch

    from . import ops  # noqa: F401  (loads the compiled library)

    return torch._C._dispatch_has_kernel_for_dispatch_key("torchkvops::repeat_kv_cache_", "CUDA")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY_NAMES:
        value = globals()[name] = getattr(_importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES) | _SUBMODULES)


__all__ = [
    "generate",
    "patch_generate",
    "GeneratePatch",
    "patch_forward",
    "ForwardPatch",
    "SharedForwardConfig",
    "SharedForwardStats",
    "Rollout",
    "RolloutConfig",
    "RolloutOutput",
    "RolloutProfile",
    "repeat_kv_cache",
    "repeat_kv_cache_",
    "merge_attention_states",
    "paged_attention",
    "has_cuda_kernels",
    "ops",
    "distributed",
    "__version__",
]

if _sys.argv[:1] != ["-m"]:  # not while `python -m` locates a module (see the docstring)
    from .ops import merge_attention_states, paged_attention, repeat_kv_cache, repeat_kv_cache_  # noqa: F401
