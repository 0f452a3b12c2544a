"""The package's architecture, checked from its source: no import cycles, and the layers stay apart,
operators < model adapter and utilities < rollout engine < training forward / integrations < benchmark
harness < command line, with no exception (each layer imports only those below it; the training forward
never imports the rollout). Imports are read with `ast`, function-level ones included, so a lazy import
that would close a cycle or cross a layer is caught too. Also: the distribution holds every package,
and the package imports from a built tree as a wheel lays it out."""

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


# The layer of each top-level module and subpackage, bottom to top: the operators (the package root,
# ops, reference, fused_attention, the compiled _C; collectives, synced generation's few all_reduces); the model adapter and the small helpers below the
# engine (models/, utils); the rollout engine; the training forward; the integrations above the engine
# (hf/: generate's contract and patch; distributed; deepspeed); the harness; the command line. A new top-level
# module or subpackage has no layer until it is added here, and the tests below fail.
LAYERS = {
    "ops": "operators",
    "reference": "operators",
    "fused_attention": "operators",
    "_C": "operators",
    "collectives": "operators",
    "models": "models",
    "utils": "models",
    "rollout": "rollout",
    "training": "training",
    "hf": "integrations",
    "distributed": "integrations",
    "deepspeed": "integrations",
    "bench": "bench",
    "cli": "cli",
    "__main__": "cli",
}


def layer_of(name: str) -> str:
    """The layer of a module of the package, by its top-level name (LAYERS); the package root is the
    operators' (importing torchkvops imports torchkvops.ops, nothing else)."""
    parts = name.split(".")[1:]
    return LAYERS[parts[0]] if parts else "operators"


# What each layer may import (besides itself). The training forward never needs the rollout engine,
# and nothing below the integrations knows generate's contract or patch.
ALLOWED_LAYERS = {
    "operators": set(),
    "models": {"operators"},
    "rollout": {"operators", "models"},
    "training": {"operators", "models"},
    "integrations": {"operators", "models", "rollout", "training"},
    "bench": {"operators", "models", "rollout", "training", "integrations"},
    "cli": {"operators", "models", "rollout", "training", "integrations", "bench"},
}


def test_the_layers_are_an_order():
    """No two layers may import each other, even through a third: the allowed imports have no cycle."""
    assert cycles(ALLOWED_LAYERS) == []
    assert set(LAYERS.values()) == set(ALLOWED_LAYERS)


def test_every_module_is_in_a_subpackage_or_a_top_level_module_that_shows_its_layer():
    """The modules at the top are the operators', the public modules whose paths are a contract
    (`torchkvops.distributed`, whose `generate` users call; `torchkvops.deepspeed`, whose `TorchkvopsRollout`
    DeepSpeed users name) or that every layer above the operators shares (`torchkvops.utils`), and the entry
    points; everything else sits in a subpackage named for its layer."""
    graph = import_graph(PACKAGE_ROOT)
    top_level = sorted(path.name for path in PACKAGE_ROOT.glob("*.py"))
    assert top_level == [
        "__init__.py",
        "__main__.py",
        "collectives.py",
        "deepspeed.py",
        "distributed.py",
        "fused_attention.py",
        "ops.py",
        "reference.py",
        "utils.py",
    ]
    assert {layer_of(name) for name in graph} == set(ALLOWED_LAYERS)


def test_each_layer_imports_only_the_layers_below_it():
    graph = import_graph(PACKAGE_ROOT)
    wrong = sorted(
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if layer_of(b) != layer_of(a) and layer_of(b) not in ALLOWED_LAYERS[layer_of(a)]
    )
    assert wrong == []


def test_the_layer_rule_would_catch_an_engine_or_training_import_from_above():
    assert layer_of("torchkvops.training.shared_forward") == "training"
    assert layer_of("torchkvops.rollout.engine") not in ALLOWED_LAYERS["training"]
    for integration in ("torchkvops.hf.generate_patch", "torchkvops.hf.generate_contract", "torchkvops.distributed"):
        assert layer_of(integration) not in ALLOWED_LAYERS["rollout"] | ALLOWED_LAYERS["training"]
    for below in ("torchkvops.models.adapter", "torchkvops.models.forward_modes", "torchkvops.utils"):
        assert layer_of(below) in ALLOWED_LAYERS["rollout"] & ALLOWED_LAYERS["training"]
    assert layer_of("torchkvops.rollout") not in ALLOWED_LAYERS["models"]


def test_the_shared_helpers_are_leaves_and_the_contract_knows_no_patch():
    """torchkvops.utils and models/forward_modes.py (what the engine, patch_generate and patch_forward
    share) import no module of the package, so that any module may use them; hf/generate_contract.py
    (HF's generate contract) knows neither patch; the two integrations do not import each other; and hf/
    imports neither distributed.py nor deepspeed.py, which import it."""
    graph = import_graph(PACKAGE_ROOT)
    contract, patch = "torchkvops.hf.generate_contract", "torchkvops.hf.generate_patch"
    utils, modes = "torchkvops.utils", "torchkvops.models.forward_modes"
    training = "torchkvops.training.shared_forward"
    assert graph[utils] == set() and graph[modes] == set()
    assert {utils, modes, "torchkvops.models.adapter", "torchkvops.rollout"} <= graph[contract]
    assert not {patch, training} & graph[contract]
    assert {utils, contract} <= graph[patch]
    assert {utils, modes} <= graph[training]
    # hf/ is below distributed.py and deepspeed.py, which import it: neither the other way (#54's arrow up,
    # hf/generate_contract.py importing distributed for its collectives, now in collectives.py).
    hf = [name for name in graph if name == "torchkvops.hf" or name.startswith("torchkvops.hf.")]
    assert not {t for name in hf for t in graph[name]} & {"torchkvops.distributed", "torchkvops.deepspeed"}
    assert training not in graph[patch]
    assert patch not in graph[training]


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


def test_the_built_package_imports_outside_the_repository(tmp_path):
    """setuptools' build_py (what a wheel's pure-Python part is built by, with pyproject.toml's settings)
    copies the package to a folder; with the compiled library beside it, a Python that cannot see the
    repository (-I: no PYTHONPATH, no current folder; the build first on sys.path) imports torchkvops and
    every public subpackage from that folder."""
    import shutil
    import subprocess
    import sys

    build = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            "import sys\n"
            "from setuptools.dist import Distribution\n"
            "dist = Distribution({'script_name': 'setup.py'})\n"
            "dist.parse_config_files()\n"  # pyproject.toml: the package list and data
            "dist.get_command_obj('egg_info').egg_base = sys.argv[1]\n"  # nothing written in the repository
            "dist.get_command_obj('build_py').build_lib = sys.argv[2]\n"
            "dist.run_command('build_py')\n",
            str(tmp_path),
            str(tmp_path / "lib"),
        ],
        cwd=PACKAGE_ROOT.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    built = tmp_path / "lib" / "torchkvops"
    (library,) = PACKAGE_ROOT.glob("_C*.so")
    shutil.copy(library, built)
    script = (
        "import importlib, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import torch, torchkvops\n"
        "names = ['torchkvops.rollout', 'torchkvops.hf', 'torchkvops.training', 'torchkvops.models',\n"
        "         'torchkvops.distributed', 'torchkvops.hf.generate_patch', 'torchkvops.cli.main']\n"
        "modules = [torchkvops] + [importlib.import_module(name) for name in names]\n"
        "outside = [m.__name__ for m in modules if not m.__file__.startswith(sys.argv[1] + '/')]\n"
        "assert not outside, (outside, torchkvops.__file__)\n"
        "c = torch.arange(48.0).reshape(4, 2, 3, 2)\n"
        "torch.ops.torchkvops.repeat_kv_cache_(c, 2, 2, 3)\n"
        "assert torch.equal(c[1], c[0]) and callable(torchkvops.distributed.generate)\n"
        "print(torchkvops.__file__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", script, str(tmp_path / "lib")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(built / "__init__.py")
