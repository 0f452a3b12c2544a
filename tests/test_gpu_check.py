"""scripts/gpu_check.sh, the one device call a lent GPU gets: the direct tests of every CUDA kernel run
first, in a step of their own (issue #51: pytest ran every CUDA test in one step, files alphabetically,
so the direct test of the changed write_kv_ kernel was what the step's timeout cut), and the other CUDA
tests get a limit sized from their count."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).absolute().parents[1]
SCRIPT = (ROOT / "scripts" / "gpu_check.sh").read_text()


def steps() -> list[str]:
    """The names of the script's steps, in the order they run."""
    return re.findall(r"^\s*step ([\w-]+) ", SCRIPT, flags=re.M)


def first_step_files() -> list[str]:
    match = re.search(r"kernel_tests=\(([^)]*)\)", SCRIPT)
    assert match, "gpu_check.sh names its first test files in kernel_tests=(...)"
    return match.group(1).split()


def test_the_kernels_direct_tests_run_before_any_other_test():
    order = steps()
    assert order.index("pytest-kernels") < order.index("pytest-cuda")
    assert [s for s in order[: order.index("pytest-kernels")] if s.startswith(("pytest", "bench"))] == []


def test_every_cuda_kernel_has_its_direct_test_in_the_first_step():
    kernels = sorted(p.stem for p in (ROOT / "torchkvops" / "csrc" / "cuda").glob("*.cu"))
    assert kernels, "no CUDA kernel found"
    files = first_step_files()
    for kernel in kernels:
        test = f"tests/test_{kernel}.py"
        assert (ROOT / test).exists(), f"{kernel}.cu has no direct test {test}"
        assert test in files, f"{test} is not in gpu_check.sh's first test step"
    assert "tests/test_agreement.py" in files  # the NCCL FSDP2 call
    assert all((ROOT / f).exists() for f in files), files


def test_the_other_cuda_tests_get_a_limit_from_their_count():
    """The second step leaves the first step's files out and takes a limit computed from the count that
    pytest collects, not a constant."""
    joined = SCRIPT.replace("\\\n", " ")  # (continued lines as one)
    line = next(line for line in joined.splitlines() if re.match(r"\s*step pytest-cuda ", line))
    assert re.search(r"step pytest-cuda \$\(\(rest \* \d+ / \d+ \+ \d+\)\)", line), line
    assert "--collect-only" in SCRIPT and '"${ignores[@]}"' in line
