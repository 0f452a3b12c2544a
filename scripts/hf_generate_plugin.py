"""pytest plugin for scripts/hf_generation_suite.sh: runs transformers' own generation tests (those marked
`@pytest.mark.generate`), plainly or with every `GenerationMixin.generate` call routed through
torchkvops, and writes what happened to a JSON report.

Environment:
  HF_SUITE_ROUTE=1       route: each model instance that calls generate is patched with
                         torchkvops.patch_generate (the public API), whose fallback is HF's original
                         generate
  HF_SUITE_REPORT=path   where the JSON report goes: every selected test's outcome, and (routed) how
                         many generate calls the rollout served and how many fell back, by cause
  HF_SUITE_CHECKOUT=dir  the transformers checkout the tests come from (for the compatibility shims)

Compatibility shims: the tests come from a transformers commit older than the installed release, and
import two names that release no longer has. Each is supplied only when missing: `_TEXT_MODEL_TESTER_DEFAULTS`
(read from the checkout's own src/transformers/testing_utils.py) and `_get_parameter_tp_plan` (renamed
`transformers.distributed.parallel_utils._get_parameter_plan`, same signature). And the tests run against
the installed transformers, never the checkout's source: `direct_transformers_import` (with which
test_pipeline_mixin.py loads the checkout's src/transformers) returns the installed package.
"""

from __future__ import annotations

import ast
import collections
import functools
import json
import os
import re
from pathlib import Path

_ROUTE = os.environ.get("HF_SUITE_ROUTE") == "1"
_outcomes: dict[str, str] = {}
_calls = {"generate": 0, "served": 0, "fallback": collections.Counter(), "served_in": collections.Counter()}
_current = {"test": None}  # the test running now
_examples: dict[str, str] = {}  # one full reason per cause


def _install_shims() -> None:
    import transformers
    import transformers.integrations.tensor_parallel as tensor_parallel
    import transformers.testing_utils as testing_utils

    if not hasattr(testing_utils, "_TEXT_MODEL_TESTER_DEFAULTS"):
        source = Path(os.environ["HF_SUITE_CHECKOUT"], "src", "transformers", "testing_utils.py").read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_TEXT_MODEL_TESTER_DEFAULTS":
                testing_utils._TEXT_MODEL_TESTER_DEFAULTS = ast.literal_eval(node.value)
    if not hasattr(tensor_parallel, "_get_parameter_tp_plan"):
        from transformers.distributed.parallel_utils import _get_parameter_plan

        tensor_parallel._get_parameter_tp_plan = _get_parameter_plan
    transformers.utils.direct_transformers_import = lambda path, file="__init__.py": transformers


def _cause(reason: str) -> str:
    """A fallback reason without its values: one bucket per setting or feature."""
    reason = re.sub(r" \(.*", "", reason)  # the explanation in parentheses
    return re.sub(r"=.*", "", reason)  # the value of a setting


def _install_routing() -> None:
    from transformers.generation.utils import GenerationMixin

    import torchkvops
    from torchkvops.hf import generate_patch as generation

    original = GenerationMixin.generate

    @functools.wraps(original)
    def routed(self, *args, **kwargs):
        """The first generate call of each model instance patches it (a deep copy of a patched model
        is unpatched, so it is patched again); the patch's fallback is HF's original generate."""
        if not isinstance(vars(self).get("generate"), generation._PatchedGenerate):
            torchkvops.patch_generate(self).session.original_generate = original.__get__(self)
        return self.generate(*args, **kwargs)

    GenerationMixin.generate = routed

    # Counting only (private hooks of torchkvops.hf.generate_patch): every call passes through `_serve`, a
    # served one returns from `_run`, a fallback passes its reason to `warn_once` (every time, though it
    # warns only the first time); the rest raised before either.
    serve, run, warn_once = generation._serve, generation._run, generation._Session.warn_once

    def counted_serve(*args, **kwargs):
        _calls["generate"] += 1
        return serve(*args, **kwargs)

    def counted_run(*args, **kwargs):
        out = run(*args, **kwargs)
        _calls["served"] += 1
        _calls["served_in"][_current["test"]] += 1
        return out

    def counted_warn_once(self, reason, where="torchkvops.generate", stacklevel=4, **kwargs):
        if where == "torchkvops.generate":
            _calls["fallback"][_cause(reason)] += 1
            _examples.setdefault(_cause(reason), reason)
        return warn_once(self, reason, where, stacklevel + 1, **kwargs)

    generation._serve, generation._run, generation._Session.warn_once = counted_serve, counted_run, counted_warn_once


def pytest_configure(config):
    config.addinivalue_line("markers", "generate: transformers' generation tests")
    _install_shims()
    if _ROUTE:
        _install_routing()


def pytest_collection_modifyitems(config, items):
    """Only transformers' generation tests: those it marks `@pytest.mark.generate`."""
    selected = [item for item in items if item.get_closest_marker("generate") is not None]
    config.hook.pytest_deselected(items=[item for item in items if item not in selected])
    items[:] = selected


def pytest_runtest_logstart(nodeid, location):
    _current["test"] = nodeid


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":  # a failed or skipped setup is the test's outcome
        if report.nodeid not in _outcomes or _outcomes[report.nodeid] == "passed":
            _outcomes[report.nodeid] = report.outcome


def pytest_sessionfinish(session):
    path = os.environ.get("HF_SUITE_REPORT")
    if path:
        import torchkvops

        calls = dict(
            _calls,
            fallback=dict(_calls["fallback"].most_common()),
            examples=_examples,
            served_in=dict(_calls["served_in"]),
        )
        report = {"routed": _ROUTE, "torchkvops": torchkvops.__file__, "tests": _outcomes, "calls": calls}
        Path(path).write_text(json.dumps(report, indent=1))
