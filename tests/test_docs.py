"""The README's and docs/'s examples: the commands and snippets a user pastes run or parse as written,
their output paths, names, links and anchors hold, and the README holds the commands CI runs."""

from pathlib import Path

import pytest
from cli_helpers import ROOT

from torchkvops.cli import main as cli

README = ROOT / "README.md"
DOCS = ROOT / "docs"


def doc_files() -> list[Path]:
    """README.md and the docs/ pages it links to: the examples a user pastes live in all of them."""
    pages = sorted(DOCS.glob("*.md"))
    assert len(pages) >= 9, pages
    return [README, *pages]


def docs_text() -> str:
    return "\n".join(page.read_text() for page in doc_files())


def shell_commands(text: str) -> list[list[str]]:
    """The commands of every ```bash block, continuation lines joined, comments dropped, as words."""
    import re
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            if words := shlex.split(line, comments=True):
                commands.append(words)
    return commands


def test_readme_commands_write_their_files_under_the_ignored_out_folder():
    """A pasted example must not leave files in the repository's root: every --output, --trace and --plot
    path in the README and docs/ lies in out/, which .gitignore covers and scripts/setup.sh creates."""
    import re

    paths = re.findall(r"--(?:output|trace|plot) ([^\s`)]+)", docs_text())
    assert len(paths) >= 5
    assert [p for p in paths if not p.startswith("out/")] == []
    assert "/out/" in (ROOT / ".gitignore").read_text().split()
    assert "mkdir -p out" in (ROOT / "scripts" / "setup.sh").read_text()


def test_readme_lists_every_model_shape():
    """Wherever the README or docs/ spell out the --model-shape names, they are the library's, in order."""
    import re

    from torchkvops.models import MODEL_SHAPES

    lists = re.findall(r"\(`--model-shape ([a-z0-9.| \n-]+)`\)", docs_text())
    assert lists
    for listed in lists:
        assert [name.strip() for name in listed.split("|")] == list(MODEL_SHAPES)


def first_python_block(page: Path, heading: str) -> str:
    text = page.read_text().split(f"\n{heading}\n")[1]
    return text.split("```python\n")[1].split("```")[0]


@pytest.mark.parametrize(
    "page, heading",
    [(README, "### A rollout: N samples per prompt from one KV cache"), (DOCS / "rollout.md", "## The API")],
    ids=["README", "docs/rollout.md"],
)
def test_readme_rollout_snippet_runs_as_written(page, heading):
    """The README's Rollout quick start and docs/rollout.md's example, pasted as they are (each builds its
    own model and prompts)."""
    code = first_python_block(page, heading)
    scope: dict = {}
    exec(compile(code, f"{page.name} ({heading})", "exec"), scope)
    out, rows = scope["out"], scope["input_ids"].shape[0] * 4
    assert out.responses.shape == (rows, 32) and out.sequences.shape == (rows, scope["input_ids"].shape[1] + 32)
    assert scope["profile"].prefill_ms > 0


def test_readme_holds_the_commands_ci_and_a_new_user_run():
    """.ci/run runs the README's test command: the README must hold that line exactly, and the main job's."""
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("bash ")]
    assert ci == ["bash scripts/setup.sh && bash scripts/lint.sh && .venv/bin/python -m pytest -q -n 2 --dist loadfile"]
    commands = [" ".join(words) for words in shell_commands(README.read_text())]
    assert ci[0] in commands
    assert "bash scripts/setup.sh && .venv/bin/python -m torchkvops" in commands


def test_readme_torchkvops_commands_parse():
    """Every `-m torchkvops` command in the README and docs/ passes the command line's parser and its
    checks as written (placeholders such as /path/ckpt and HOST:PORT aside); --help exits 0."""
    checked = 0
    for words in shell_commands(docs_text()):
        if "torchkvops" not in words or any("/path/" in w or w.startswith("HOST:") for w in words):
            continue
        at = words.index("torchkvops")
        assert words[at - 1] == "-m", words
        argv = words[at + 1 :] or ["bench", *cli.DEFAULT_BENCH_ARGS]
        if "--help" in argv:
            with pytest.raises(SystemExit) as exc:
                cli.parse_args(argv)
            assert exc.value.code == 0, words
        else:
            cli.parse_args(argv)  # a refused command exits 2
        checked += 1
    assert checked >= 15


def test_readme_and_docs_name_no_machine_paths():
    """Commands run from the repository's root: no absolute path of one machine in what a user reads."""
    import re

    for page in [*doc_files(), ROOT / "CHANGELOG.md"]:
        found = re.findall(r"(?<![\w.])/(?:work|root|tmp|home|Users|mnt)/[^\s`)]*", page.read_text())
        assert found == [], f"{page.name}: {found}"


def test_readme_and_docs_name_only_real_module_paths():
    """Every dotted `torchkvops.<...>` path the README and docs/ name (not an operator under torch.ops, not
    a file) is a module of the package, or a name one of them defines: the modules live where the text
    says, with no alias resolving an old path."""
    import importlib
    import re

    paths = set(re.findall(r"(?<![\w./])torchkvops(?:\.[A-Za-z_]\w*)+", docs_text()))
    assert {"torchkvops.distributed.generate", "torchkvops.models"} <= paths
    wrong = []
    for path in sorted(paths):
        parts = path.split(".")
        for end in range(len(parts), 0, -1):  # the longest prefix that is a module, then its attributes
            try:
                found = importlib.import_module(".".join(parts[:end]))
                break
            except ModuleNotFoundError:
                continue
        for name in parts[end:]:
            found = getattr(found, name, None)
        if found is None:
            wrong.append(path)
    assert wrong == []


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_and_docs_links_resolve():
    """Every relative link of the README, CHANGELOG.md and docs/ names a file that exists, and its #anchor
    a heading of that file."""
    import re

    checked = 0
    for page in [*doc_files(), ROOT / "CHANGELOG.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: {target}"
            if anchor:
                body = re.sub(r"```.*?```", "", linked.read_text(), flags=re.S)
                anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", body, re.M)}
                assert anchor in anchors, f"{page.name}: {target}"
            checked += 1
    assert checked >= 30


def test_rollout_extend_snippet_runs_as_written():
    """docs/rollout.md's multi-turn example: 4 rows, then 3, 1, none (finished) and 0 appended tokens."""
    code = first_python_block(DOCS / "rollout.md", "## Multi-turn: `Rollout.extend`")
    scope: dict = {}
    exec(compile(code, "rollout.md (Rollout.extend)", "exec"), scope)
    out = scope["out"]
    assert out.responses.shape == (4, 8 + 3 + 6)
    assert out.response_mask[0].tolist() == [1] * 8 + [0] * 3 + [1] * 6
    assert out.response_mask[2].tolist() == [1] * 8 + [0] * 9  # finished: its first turn only
    assert out.response_mask.sum(dim=1).tolist() == [14, 14, 8, 14]


PACKAGE = ROOT / "torchkvops"


def package_modules() -> list[str]:
    """Every .py file of the package, as its path under torchkvops/ in posix form (`ops.py`, `rollout/engine.py`,
    `cli/__init__.py`)."""
    return sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py"))


def named_module_paths(text: str) -> set[str]:
    """The backticked `.py` paths of `text` that name a module of the package, as paths under torchkvops/: a
    bare `name.py`, a path whose first folder is one of the package's subpackages (`rollout/engine.py`), or
    any path spelled from `torchkvops/`. Paths under other folders (`tests/...`, `scripts/...`,
    `benchmarks/...`, `examples/...`) are not the package's and are left out."""
    import re

    subpackages = {path.parent.relative_to(PACKAGE).parts[0] for path in PACKAGE.glob("*/__init__.py")}
    named = set()
    for token in re.findall(r"`([\w./-]+\.py)`", text):
        inside = token.startswith("torchkvops/")
        path = token.removeprefix("torchkvops/")
        folders = path.split("/")[:-1]
        if inside or not folders or folders[0] in subpackages:
            named.add(path)
    return named


def test_the_module_path_reader_keeps_only_the_packages_paths():
    text = (
        "`rollout/engine.py`, `ops.py`, `torchkvops/cli/main.py`, `tests/test_docs.py`, `scripts/x.py`, "
        "`benchmarks/bench_op.py`, `examples/grpo_trl.py`, `rollout/`, `python -m torchkvops`, "
        "`hf/gone.py` and not backticked models/shapes.py"
    )
    assert named_module_paths(text) == {"rollout/engine.py", "ops.py", "cli/main.py", "hf/gone.py"}


def test_architecture_names_every_module_and_no_other():
    """docs/architecture.md names every .py file under torchkvops/ by its path there (`rollout/engine.py`, in
    backticks), so that a new module is placed in the module map when it is added; and every such path it
    names exists (a bare `name.py` is a module at the package's top, or a file at the repository's root),
    so that a module moved or removed leaves no stale name behind."""
    named = named_module_paths((DOCS / "architecture.md").read_text())
    modules = package_modules()
    assert {"ops.py", "rollout/engine.py", "cli/main.py"} <= set(modules)
    missing = [path for path in modules if path not in named]
    stale = sorted(
        path for path in named if not (PACKAGE / path).is_file() and not ("/" not in path and (ROOT / path).is_file())
    )
    assert missing == [], f"modules docs/architecture.md does not name (add them to its module map): {missing}"
    assert stale == [], f"paths docs/architecture.md names that are no module of torchkvops/: {stale}"
