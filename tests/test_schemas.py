"""The torchkvops schemas against their registrations: every mutating op (a `Tensor(a!)` argument) has
the Autograd and ADInplaceOrView kernels of csrc/inplace_autograd.cpp, which bump the written tensors'
version counters, and no functional op has them. An op left out of that file's list would otherwise
lose its version bumps silently: a backward that saved the old values would use the new ones."""

import pathlib
import re

import pytest
import torch

import torchkvops  # noqa: F401  (loads _C: the schemas and their kernels)

NAMESPACE = "torchkvops"
CSRC = pathlib.Path(torchkvops.__file__).parent / "csrc"
# The mutating ops of today (torchkvops.cpp): the test must find at least these, so it cannot pass
# by finding nothing.
KNOWN_MUTATING = {"repeat_kv_cache_", "write_kv_", "write_kv_slots_"}
INPLACE_FILE = "inplace_autograd.cpp"


def registered_ops():
    """{"op" or "op.overload": its FunctionSchema} for every operator the dispatcher knows in our namespace."""
    ops = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace != NAMESPACE:
            continue
        op, _, overload = name.partition(".")
        ops[name] = getattr(getattr(torch.ops.torchkvops, op), overload or "default")._schema
    return ops


def is_mutating(schema):
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def source_schemas():
    """{"op" or "op.overload": its FunctionSchema}, parsed from the m.def(...) strings of torchkvops.cpp."""
    text = (CSRC / "torchkvops.cpp").read_text()
    schemas = {}
    for call in re.finditer(r'\bm\.def\(((?:\s*"[^"]*")+)\s*\)', text):
        schema = torch._C.parse_schema(f"{NAMESPACE}::" + "".join(re.findall(r'"([^"]*)"', call.group(1))))
        name = schema.name.partition("::")[2]
        schemas[name + ("." + schema.overload_name if schema.overload_name else "")] = schema
    return schemas


def registered_at(qualified, key):
    """The `file:line` that the dispatcher gives for op's kernel at `key` ("" when there is none)."""
    for line in torch._C._dispatch_dump(qualified).splitlines():
        k, sep, rest = line.partition(": registered at ")
        if sep and k.removesuffix("[alias]") == key:
            return rest.split(" ")[0]
    return ""


def has_autograd_kernel(qualified):
    # The Autograd alias covers every backend; otherwise both backends need their own.
    if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "Autograd"):
        return True
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, k) for k in ("AutogradCPU", "AutogradCUDA"))


OPS = registered_ops()
MUTATING = sorted(name for name, schema in OPS.items() if is_mutating(schema))
FUNCTIONAL = sorted(name for name, schema in OPS.items() if not is_mutating(schema))


def test_finds_every_schema_of_torchkvops_cpp_and_the_known_mutating_ops():
    source = source_schemas()
    assert source, "no m.def(...) found in torchkvops.cpp"
    # Every schema lives in torchkvops.cpp's one TORCH_LIBRARY block, and the dispatcher has them all.
    assert sorted(OPS) == sorted(source)
    assert {name: str(s) for name, s in OPS.items()} == {name: str(s) for name, s in source.items()}
    assert KNOWN_MUTATING <= set(MUTATING)
    assert FUNCTIONAL, "no functional op found"


@pytest.mark.parametrize("name", MUTATING)
def test_mutating_op_has_the_inplace_autograd_kernels(name):
    qualified = f"{NAMESPACE}::{name}"
    schema = OPS[name]
    assert schema.returns == [], f"{name}: a mutating op returns (), got {schema}"
    assert has_autograd_kernel(qualified), (
        f"{name} mutates an argument but has no Autograd kernel: add it to kMutatingOps in csrc/{INPLACE_FILE}"
    )
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "ADInplaceOrView"), (
        f"{name} mutates an argument but has no ADInplaceOrView kernel (its writes would not bump the version "
        f"counter): add it to kMutatingOps in csrc/{INPLACE_FILE}"
    )
    # ... and they are that file's kernels, not some other registration.
    assert INPLACE_FILE in registered_at(qualified, "ADInplaceOrView")
    assert INPLACE_FILE in registered_at(qualified, "Autograd")


@pytest.mark.parametrize("name", FUNCTIONAL)
def test_functional_op_has_no_inplace_kernels(name):
    # A functional op named in kMutatingOps would have its gradient (ops.py's register_autograd)
    # replaced by a kernel that only checks written arguments, of which it has none.
    qualified = f"{NAMESPACE}::{name}"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "ADInplaceOrView")
    assert INPLACE_FILE not in registered_at(qualified, "Autograd")
