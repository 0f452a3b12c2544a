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
    "generate": "hf.generate_patch",
    "patch_generate": "hf.generate_patch",
    "GeneratePatch": "hf.generate_patch",
    "patch_forward": "training.shared_forward",
    "ForwardPatch": "training.shared_forward",
    "SharedForwardConfig": "training.shared_forward",
    "SharedForwardStats": "training.shared_forward",
}
_OPS_NAMES = frozenset({"torch", "ops", "repeat_kv_cache", "repeat_kv_cache_", "merge_attention_states"})
# Subpackages reachable as attributes without an import statement (`torchkvops.rollout.Rollout`).
_SUBMODULES = frozenset({"rollout", "hf", "training", "reference", "fused_attention"})
# The flat paths the modules had before they were sorted into subpackages, kept as aliases of the
# same module objects: `import torchkvops.distributed`, `from torchkvops.kv_cache import ...`, the
# attribute `torchkvops.distributed` and pickles that name the old paths all keep working.
_MOVED_MODULES = {
    "distributed": "hf.distributed",
    "generation": "hf.generate_patch",
    "generate_contract": "hf.generate_contract",
    "integration": "hf.integration",
    "shared_forward": "training.shared_forward",
    "prefix_groups": "training.prefix_groups",
    "prefix_attention": "training.prefix_attention",
    "attention": "rollout.attention",
    "compaction": "rollout.compaction",
    "decode": "rollout.decode",
    "kv_cache": "rollout.kv_cache",
    "lm_head": "rollout.lm_head",
    "profiling": "rollout.profiling",
    "sampling": "rollout.sampling",
    "models": "bench.models",
    "atomic_write": "cli.atomic_write",
}


class _MovedModuleFinder:
    """Resolves `torchkvops.<old name>` to the module now at its new path: a meta path finder whose
    loader hands back that module itself, so both names are one module object."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _MOVED_MODULES:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, _MovedModuleFinder)

    @staticmethod
    def create_module(spec):
        _load_ops()
        import importlib

        module = importlib.import_module(f"{__name__}.{_MOVED_MODULES[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system sets __spec__ to this alias's spec next
        return module

    @staticmethod
    def exec_module(module):
        module.__spec__ = module.__spec__.loader_state  # already executed: keep its own spec


if not any(finder is _MovedModuleFinder for finder in _sys.meta_path):
    _sys.meta_path.append(_MovedModuleFinder)
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
    if name in _SUBMODULES or name in _MOVED_MODULES:
        _load_ops()
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_NAMES) | _OPS_NAMES | _SUBMODULES | set(_MOVED_MODULES))


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
