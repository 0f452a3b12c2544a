"""The package's architecture, checked from its source: no import cycles, and the layers stay apart
(the library never imports the command line or the benchmark harness; the harness never imports the
command line). Imports are read with `ast`, function-level ones included, so a lazy import that would
close a cycle is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).absolute().parents[1] / "torchkvops"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `root` (a package folder)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its source). Importing a.b.c also
    imports the packages a and a.b; `from p import x` imports p.x when that is a module, else p. A
    module's own parent packages are left out: Python has imported them before the module runs."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                found = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for target in found:
                for candidate in [*_parents(target), target]:
                    # A module's own parent packages are imported before it runs, so they close no cycle.
                    if candidate in modules and candidate != name and candidate not in _parents(name):
                        targets.add(candidate)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from . import a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_import_cycles():
    graph = import_graph(PACKAGE_ROOT)
    assert {"torchkvops.cli.main", "torchkvops.bench.matrix", "torchkvops.rollout"} <= set(graph)
    assert cycles(graph) == []


def test_the_library_never_imports_the_command_line_or_the_harness():
    graph = import_graph(PACKAGE_ROOT)

    def layer(name: str) -> str:
        if name == "torchkvops.__main__":  # `python -m torchkvops`: the command line's entry point
            return "cli"
        for sub in ("cli", "bench"):
            if name == f"torchkvops.{sub}" or name.startswith(f"torchkvops.{sub}."):
                return sub
        return "library"

    allowed = {"library": {"library"}, "bench": {"library", "bench"}, "cli": {"library", "bench", "cli"}}
    wrong = sorted((a, b) for a, targets in graph.items() for b in targets if layer(b) not in allowed[layer(a)])
    assert wrong == []


def layer_of(name: str) -> str:
    """The layer a module belongs to, bottom to top: the operators (the package root, ops, reference,
    fused_attention), the model adapter and the integrations' shared helpers (hf.adapter,
    hf.integration), the rollout engine, the training forward, the integrations above the engine
    (generate's contract and patch, distributed), then the harness and the command line."""
    parts = name.split(".")[1:]
    if not parts or parts[0] in ("ops", "reference", "fused_attention", "_C"):
        return "operators"
    if parts[0] == "__main__":
        return "cli"
    if parts[0] == "hf":
        return "adapter" if parts[1:2] in ([], ["adapter"], ["integration"]) else "integrations"
    return parts[0]  # rollout, training, bench, cli


# What each layer may import (besides itself). The training forward never needs the rollout engine,
# and nothing below the integrations knows generate's contract or patch.
ALLOWED_LAYERS = {
    "operators": set(),
    "adapter": {"operators"},
    "rollout": {"operators", "adapter"},
    "training": {"operators", "adapter"},
    "integrations": {"operators", "adapter", "rollout", "training"},
    "bench": {"operators", "adapter", "rollout", "training", "integrations"},
    "cli": {"operators", "adapter", "rollout", "training", "integrations", "bench"},
}


def test_every_module_is_in_a_subpackage_that_shows_its_layer():
    graph = import_graph(PACKAGE_ROOT)
    top_level = sorted(path.name for path in PACKAGE_ROOT.glob("*.py"))
    assert top_level == ["__init__.py", "__main__.py", "fused_attention.py", "ops.py", "reference.py"]
    assert {layer_of(name) for name in graph} == set(ALLOWED_LAYERS)


def test_each_layer_imports_only_the_layers_below_it():
    graph = import_graph(PACKAGE_ROOT)
    wrong = sorted(
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if layer_of(b) != layer_of(a)
        and layer_of(b) not in ALLOWED_LAYERS[layer_of(a)]
        and b != "torchkvops"  # the package root: `from .. import ops` passes through it
    )
    assert wrong == []


def test_the_layer_rule_would_catch_training_importing_the_rollout():
    assert layer_of("torchkvops.training.shared_forward") == "training"
    assert layer_of("torchkvops.rollout.engine") not in ALLOWED_LAYERS["training"]
    assert layer_of("torchkvops.hf.generate_patch") not in ALLOWED_LAYERS["rollout"]
    assert layer_of("torchkvops.hf.adapter") in ALLOWED_LAYERS["rollout"]


def test_the_integrations_share_a_leaf_and_the_contract_knows_no_patch():
    """hf/integration.py (what patch_generate and patch_forward share) imports no module of the package,
    so that any module may use it; hf/generate_contract.py (HF's generate contract) knows neither patch;
    and the two integrations do not import each other."""
    graph = import_graph(PACKAGE_ROOT)
    contract, patch = "torchkvops.hf.generate_contract", "torchkvops.hf.generate_patch"
    shared, training = "torchkvops.hf.integration", "torchkvops.training.shared_forward"
    assert graph[shared] == set()
    assert {shared, "torchkvops.rollout.engine"} <= graph[contract]
    assert not {patch, training} & graph[contract]
    assert {shared, contract} <= graph[patch]
    assert shared in graph[training]
    assert training not in graph[patch]
    assert patch not in graph[training]


def test_the_flat_paths_of_earlier_releases_import_the_moved_modules(tmp_path):
    """`import torchkvops.<old>` and `from torchkvops.<old> import ...` give the module at its new path
    (one object, which keeps its own name and spec), in a fresh interpreter where neither was imported."""
    import subprocess
    import sys

    import torchkvops

    script = (
        "import importlib, sys\n"
        "import torchkvops\n"
        f"for old, new in {dict(torchkvops._MOVED_MODULES)!r}.items():\n"
        "    aliased = importlib.import_module('torchkvops.' + old)\n"
        "    moved = sys.modules['torchkvops.' + new]\n"
        "    assert aliased is moved and getattr(torchkvops, old) is moved, old\n"
        "    assert moved.__name__ == moved.__spec__.name == 'torchkvops.' + new, old\n"
        "from torchkvops.distributed import generate\n"
        "from torchkvops.hf.distributed import generate as moved\n"
        "assert generate is moved\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.stdout.strip() == "ok", done.stderr
    assert not (PACKAGE_ROOT / "distributed.py").exists()  # the old paths are aliases, not files


def test_the_distribution_holds_every_package_of_the_tree():
    """`pip install .` and a wheel ship the packages pyproject.toml's find rule selects: every folder under
    torchkvops/ with an __init__.py (a list written by hand once left rollout/, hf/ and training/ out, and
    `import torchkvops` failed outside an editable install)."""
    import tomllib
    from setuptools import find_packages

    config = tomllib.loads((PACKAGE_ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = config["packages"]
    assert isinstance(packages, dict), "a hand-written package list: use [tool.setuptools.packages.find]"
    shipped = set(find_packages(str(PACKAGE_ROOT.parent), **packages["find"]))
    tree = {".".join(path.parent.relative_to(PACKAGE_ROOT.parent).parts) for path in PACKAGE_ROOT.rglob("__init__.py")}
    assert shipped == tree and {"torchkvops.rollout", "torchkvops.hf", "torchkvops.training"} <= shipped
