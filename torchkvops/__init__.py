"""torchkvops: prefill each prompt once, expand its KV cache to N samples with a custom operator.

`import torchkvops` loads torch and the compiled library, so `torch.ops.torchkvops.*` work right after
it. What needs transformers (`Rollout`, `RolloutConfig`, `RolloutOutput`, `RolloutProfile`, `generate`,
`patch_generate`, `GeneratePatch`, `patch_forward`, `ForwardPatch`, `torchkvops.distributed`, ...) is imported on first use (PEP 562 module
`__getattr__`).
"""

import sys as _sys

__version__ = "0.1.0"

# Public names imported on first use, and the submodule each comes from.
_LAZY_NAMES = {
    "Rollout": "rollout",
    "RolloutConfig": "rollout",
    "RolloutOutput": "rollout",
    "RolloutProfile": "rollout",
    "generate": "generation",
    "patch_generate": "generation",
    "GeneratePatch": "generation",
    "patch_forward": "shared_forward",
    "ForwardPatch": "shared_forward",
    "SharedForwardConfig": "shared_forward",
    "SharedForwardStats": "shared_forward",
}
_OPS_NAMES = frozenset({"torch", "ops", "repeat_kv_cache", "repeat_kv_cache_", "merge_attention_states"})
# Submodules reachable as attributes without an import statement (`torchkvops.distributed.generate`).
_SUBMODULES = frozenset(
    {
        "rollout",
        "hf",
        "kv_cache",
        "profiling",
        "sampling",
        "attention",
        "decode",
        "generation",
        "distributed",
        "models",
        "shared_forward",
        "prefix_attention",
        "prefix_groups",
    }
)
_loaded = False


def _load_ops() -> None:
    """Import torch, the compiled library (its schemas and kernels), then ops.py, which registers fake
    kernels and autograd formulas against those schemas. Does nothing the second time."""
    global _loaded, torch, ops, repeat_kv_cache, repeat_kv_cache_, merge_attention_states
    if _loaded:
        return
    import importlib

    import torch

    try:
        # Loading the compiled library registers the schemas and kernels; ops.py registers against them.
        importlib.import_module(f"{__name__}._C")
    except ImportError as e:  # pragma: no cover - exercised only on a broken install
        raise ImportError(
            "torchkvops: the compiled library torchkvops._C is missing or broken "
            f"({e}); build it with: pip install --no-build-isolation -e ."
        ) from None

    # (importlib, not `from . import ops`: that would ask this module's __getattr__ for "ops" first)
    ops = importlib.import_module(f"{__name__}.ops")
    repeat_kv_cache, repeat_kv_cache_ = ops.repeat_kv_cache, ops.repeat_kv_cache_
    merge_attention_states = ops.merge_attention_states
    _loaded = True


def _started_by_python_m() -> bool:
    """True only while `python -m torchkvops` imports this package to find its __main__.py.

    During that import the interpreter has set sys.argv[0] to "-m" (it becomes the path of __main__.py
    once the module is found) and sys.orig_argv names the module. What runs next is always
    torchkvops/__main__.py, i.e. torchkvops.cli.main, which parses its arguments before it loads the
    library with `_load_ops()`: so `python -m torchkvops --help` and argument errors need no torch.
    Any other import of torchkvops (user code, tests, the `torchkvops` console script) loads it at once.
    """
    if _sys.argv[:1] != ["-m"]:
        return False
    args = iter(getattr(_sys, "orig_argv", [])[1:])
    for arg in args:
        if arg == "--check-hash-based-pycs":
            next(args, None)
        elif arg.startswith("--"):
            continue
        elif arg.startswith("-") and len(arg) > 1:  # a cluster of short options, e.g. -I, -Bm, -Wignore
            for k, ch in enumerate(arg[1:], start=1):
                rest = arg[k + 1 :]
                if ch == "m":
                    return (rest or next(args, "")) in ("torchkvops", "torchkvops.__main__")
                if ch == "c":
                    return False
                if ch in "WX":  # takes a value: the rest of the cluster or the next argument
                    if not rest:
                        next(args, None)
                    break
        else:
            return False  # a script or "-": not -m
    return False


def has_cuda_kernels() -> bool:
    """True when the CUDA kernels were compiled into torchkvops._C (whether or not a GPU is present)."""
    _load_ops()
    return torch._C._dispatch_has_kernel_for_dispatch_key("torchkvops::repeat_kv_cache_", "CUDA")


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        _load_ops()
        import importlib

        value = globals()[name] = getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
        return value
    if name in _OPS_NAMES:  # missing only in the `python -m torchkvops` process, before the CLI loads them
        _load_ops()
        return globals()[name]
    if name in _SUBMODULES:
        _load_ops()
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES) | _OPS_NAMES | _SUBMODULES)


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
    "has_cuda_kernels",
    "ops",
    "distributed",
    "__version__",
]

if not _started_by_python_m():
    _load_ops()
