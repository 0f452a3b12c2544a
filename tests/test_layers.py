"""The packages' import graph goes one way: each module of torchkvops imports (at its top or inside a
function) only from its own unit or from units below it in LAYERS. A new module must be placed here, so
that a newcomer finds where it sits; an arrow up (hf/ importing distributed.py, which imports hf/) fails."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "torchkvops"

# Lowest first: a unit may import from its own layer's units and the layers before it, never after.
LAYERS = [
    {"_C", "utils", "reference", "fused_attention", "collectives", "__version__"},
    {"ops"},
    {"models"},
    {"rollout", "training"},
    {"hf"},
    {"distributed", "deepspeed"},
    {"", "bench"},  # "": the package's own __init__ (its names are imported on first use)
    {"cli", "__main__"},
]
LEVEL = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _unit(module: str) -> str:
    """The unit of a dotted module name under torchkvops: its first part after the package ("" for the
    package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[str]:
    """Every torchkvops module `path` imports, relative imports resolved."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    module = ".".join(rel.parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                if node.module:
                    found.append(".".join([*base, node.module]))
                else:
                    found += [".".join([*base, alias.name]) for alias in node.names]
            elif node.module and node.module.split(".")[0] == "torchkvops":
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "torchkvops"]
    return found


def _modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def test_every_unit_has_a_layer():
    units = {_unit(".".join(p.relative_to(ROOT.parent).with_suffix("").parts)) for p in _modules()}
    units.discard("__init__")  # (torchkvops/__init__.py: the package itself, "")
    assert units <= set(LEVEL), f"place these in tests/test_layers.py's LAYERS: {sorted(units - set(LEVEL))}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_module_imports_from_a_layer_above_its_own(path):
    module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
    unit = _unit(module)
    upward = [m for m in _imports(path) if LEVEL.get(_unit(m), -1) > LEVEL[unit]]
    assert not upward, f"{module} ({unit}, layer {LEVEL[unit]}) imports from above: {upward}"
