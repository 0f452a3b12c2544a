"""torchkvops.rollout.state: the decode state declaration: a DecodeState holds exactly the tensors DecodeState.FIELDS
declares, with the shapes its DecodeShape gives, and compaction (`gather_into`) moves every per-row
field with its row and every per-prompt field with its prompt, whatever fields are declared. The decode
loop itself is tested through Rollout (tests/test_rollout.py, test_compaction.py, test_logprobs.py)."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from torchkvops.rollout.state import DecodeShape, DecodeState

SHAPES = {
    "copy": DecodeShape(rows=6, key_columns=16, max_new_tokens=5, dtype=torch.bfloat16, logprobs=True),
    "prefix": DecodeShape(rows=6, key_columns=8, max_new_tokens=5, dtype=torch.float32, prompts=3, prompt_len=16),
}


@pytest.mark.parametrize("layout", list(SHAPES))
def test_a_state_holds_what_its_fields_declare(layout):
    shape = SHAPES[layout]
    state = DecodeState(shape, torch.device("cpu"))
    declared = {f.name for f in DecodeState.FIELDS}
    tensors = {name for name, value in vars(state).items() if isinstance(value, torch.Tensor)}
    assert tensors <= declared
    assert state.bias.shape == (6, 1, 1, shape.key_columns) and state.bias.dtype == shape.dtype
    assert (state.logprobs is not None) == shape.logprobs
    assert (state.prompt_bias is not None) == (layout == "prefix")
    assert state.slot_rows is None  # only a compacted prefix-layout batch has query slots
    assert len(state.tensors()) == len(tensors)


@pytest.mark.parametrize("layout", list(SHAPES))
def test_gather_moves_every_field_with_its_row_or_prompt(layout):
    shape = SHAPES[layout]
    old = DecodeState(shape, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for t in old.tensors():
        t.copy_(torch.randint(0, 2 if t.dtype == torch.bool else 1000, t.shape, generator=g).to(t.dtype))
    rows, groups = torch.tensor([4, 1, 5]), torch.tensor([2, 0]) if layout == "prefix" else None
    new = DecodeState(dataclasses.replace(shape, rows=3, prompts=2 if groups is not None else 0), torch.device("cpu"))
    old.gather_into(new, rows, groups)
    for f in DecodeState.FIELDS:
        src, dst = getattr(old, f.name), getattr(new, f.name)
        if src is None:
            continue
        if f.per == "row":
            assert torch.equal(dst, src[rows]), f.name
        elif f.per == "prompt":
            assert torch.equal(dst, src[groups]), f.name
    moved = {f.name for f in DecodeState.FIELDS if f.per in ("row", "prompt")}
    assert {"tokens", "position_ids", "bias", "finished", "sample_keys", "nonfinite_step", "responses", "step"} <= moved


# --- a join or leave of rows is written once ----------------------------------------------------------------
PACKAGE = Path(__file__).absolute().parents[1] / "torchkvops"
FIELD_NAMES = {f.name for f in DecodeState.FIELDS}
STATE_NAMES = {"s", "state", "new", "sub", "first", "smaller"}  # what the package calls a DecodeState
IN_PLACE = re.compile(r"^[a-z_]+_$")  # torch's in-place methods: copy_, fill_, index_copy_, ...
# Where a state's rows may be written: the batch (joins, leaves), the state itself (its declaration and
# moves) and the decode step (every row advanced by one token).
ALLOWED = {("rollout/batch.py", None), ("rollout/state.py", None), ("rollout/decode.py", "DecodeStep")}


def _is_state(node) -> bool:
    if isinstance(node, ast.Name):
        return node.id in STATE_NAMES
    return isinstance(node, ast.Attribute) and node.attr in ("state", "first")


def _written_field(target) -> str | None:
    """The DecodeState field that `target` (an assignment target or an in-place call's object) writes."""
    while isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Attribute) and target.attr in FIELD_NAMES and _is_state(target.value):
        return target.attr
    return None


def state_row_writes(source: str, path: str) -> list[str]:
    """'path:line field' for every write of a DecodeState field outside the allowed places."""
    found = []

    def visit(node, cls):
        if isinstance(node, ast.ClassDef):
            cls = node.name
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [t for t in targets if isinstance(t, ast.Subscript)]  # (binding a name is no write)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and IN_PLACE.match(node.func.attr):
            targets = [node.func.value]
        for t in targets:
            field = _written_field(t)
            if field and (path, None) not in ALLOWED and (path, cls) not in ALLOWED:
                found.append(f"{path}:{node.lineno} {field}")
        for child in ast.iter_child_nodes(node):
            visit(child, cls)

    visit(ast.parse(source), None)
    return found


def test_the_checker_finds_a_row_write():
    source = (
        "def start(state, rows):\n    state.bias[rows] = 0\n    state.finished[rows].fill_(True)\n    x = state.bias\n"
    )
    assert state_row_writes(source, "rollout/streaming.py") == [
        "rollout/streaming.py:2 bias",
        "rollout/streaming.py:3 finished",
    ]
    assert state_row_writes(source, "rollout/batch.py") == []


def test_only_the_batch_writes_a_states_rows():
    """Rows join and leave through DecodeBatch only: no other module of the package writes a decode
    state's fields (the decode step advances every row and is allowed)."""
    writes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        writes += state_row_writes(path.read_text(), rel)
    assert writes == []


def private_rollout_uses(source: str) -> list[str]:
    """'line name' for every underscored member read through a variable called rollout (or x.rollout)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "rollout") or (
            isinstance(owner, ast.Attribute) and owner.attr == "rollout"
        ):
            found.append(f"{node.lineno} {node.attr}")
    return sorted(found)


def test_integrations_use_the_rollouts_named_entry_points():
    """Outside the engine, no module reads a Rollout's private members: the integrations call
    `generate_rows`, `extend_turn` and `history`."""
    assert private_rollout_uses("out = rollout._generate(ids)\nh = self.rollout._history\n") == [
        "1 _generate",
        "2 _history",
    ]
    uses = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "rollout" not in path.relative_to(PACKAGE).parts[:1]:
            found = private_rollout_uses(path.read_text())
            if found:
                uses[path.relative_to(PACKAGE).as_posix()] = found
    assert uses == {}
