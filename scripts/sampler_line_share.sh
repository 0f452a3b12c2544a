#!/usr/bin/env bash
# What share of the CUDA sampler's logic lines the CPU tests execute (docs/operators.md, "What the CPU
# tests run of the CUDA sampler"). Builds a gcov copy of the emulator (csrc/cpu/sample_tokens_emulated.cpp
# and the headers it includes, -O0 --coverage, as its own op library) in a scratch folder outside the
# repository, runs tests/test_sample_tokens_cuda_emulated.py against it, and counts:
#   shared lines: the non-blank, non-comment lines of sample_tokens_row.h, sample_tokens.h and
#     device_math.h inside the functions that the emulator's translation unit instantiates (the ones
#     the CUDA kernel's row body and its op call; the CPU kernel's own helpers are not among them);
#     executed when gcov counts the line, or for a line gcov does not count (a brace, a declaration)
#     when its function ran;
#   CUDA-only lines: every non-blank, non-comment line of cuda/sample_tokens.cu, and the device branch
#     of device_math.h's wrappers.
# Takes about two minutes on two cores. Needs scripts/setup.sh first (torchkvops._C for the tests' imports).
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
export TORCHKVOPS_REPO="$repo" SCRATCH="$scratch"

cat > "$scratch/schema.cpp" <<'EOF'
#include <torch/library.h>
TORCH_LIBRARY(torchkvops_cov, m) {
  m.def("_sample_tokens_cuda_emulated(Tensor logits, Tensor keys, Tensor step, float temperature, int top_k, "
        "float top_p, bool with_logprobs) -> (Tensor, Tensor)");
}
EOF

.venv/bin/python - <<'EOF'
import os
from torch.utils.cpp_extension import load
repo, scratch = os.environ["TORCHKVOPS_REPO"], os.environ["SCRATCH"]
os.makedirs(f"{scratch}/build")
# The namespace renamed, so that the copy registers its own op beside torchkvops._C's.
load(name="sampler_cov", sources=[f"{repo}/torchkvops/csrc/cpu/sample_tokens_emulated.cpp", f"{scratch}/schema.cpp"],
     extra_cflags=["-O0", "--coverage", "-Dtorchkvops=torchkvops_cov"], extra_ldflags=["--coverage"],
     extra_include_paths=[f"{repo}/torchkvops/csrc"], is_python_module=False, build_directory=f"{scratch}/build")
EOF
rm -f "$scratch"/build/*.gcda  # loading ran static initializers: count the tests alone

.venv/bin/python - <<'EOF'
import glob, os, sys
import pytest
import torch
repo, scratch = os.environ["TORCHKVOPS_REPO"], os.environ["SCRATCH"]
torch.ops.load_library(glob.glob(f"{scratch}/build/sampler_cov*.so")[0])
sys.path.insert(0, f"{repo}/tests")
import test_sample_tokens_cuda_emulated as tests  # noqa: E402  (pytest reuses this module)
tests.EMULATED = torch.ops.torchkvops_cov._sample_tokens_cuda_emulated.default
code = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", repo, f"{repo}/tests/test_sample_tokens_cuda_emulated.py"])
if code != 0:
    sys.exit(code)
EOF

.venv/bin/python - <<'EOF'
import gzip, json, os, pathlib, subprocess
repo, scratch = os.environ["TORCHKVOPS_REPO"], os.environ["SCRATCH"]
csrc, build = pathlib.Path(repo) / "torchkvops" / "csrc", pathlib.Path(scratch) / "build"


def logic_lines(path):
    """Numbers of the non-blank lines that are not // comments (the sources have no /* */ comments)."""
    lines = path.read_text().splitlines()
    return {i for i, text in enumerate(lines, 1) if text.strip() and not text.strip().startswith("//")}


subprocess.run(["gcov", "--json-format", "-o", str(build), str(csrc / "cpu" / "sample_tokens_emulated.cpp")],
               cwd=build, check=True, capture_output=True)
data = json.load(gzip.open(build / "sample_tokens_emulated.gcov.json.gz"))
shared = executed = 0
for f in data["files"]:
    name = pathlib.Path(f["file"]).name
    if name not in ("sample_tokens_row.h", "sample_tokens.h", "device_math.h"):
        continue
    counts = {}
    for line in f["lines"]:  # one entry per line and template instantiation
        counts[line["line_number"]] = counts.get(line["line_number"], 0) + line["count"]
    ranges = [(fn["start_line"], fn["end_line"], fn["execution_count"]) for fn in f["functions"]]
    used = {n for a, b, _ in ranges for n in range(a, b + 1)} & logic_lines(csrc / name)
    ran = {n for n in used if counts.get(n, 0) > 0 or (n not in counts and any(a <= n <= b and c for a, b, c in ranges))}
    print(f"{name}: {len(used)} shared logic lines, {len(ran)} executed by the CPU tests")
    for n in sorted(used - ran):
        print(f"  not executed: {name}:{n}: {(csrc / name).read_text().splitlines()[n - 1].strip()}")
    shared, executed = shared + len(used), executed + len(ran)
cu = len(logic_lines(csrc / "cuda" / "sample_tokens.cu"))
text = (csrc / "device_math.h").read_text().splitlines()
start = next(i for i, t in enumerate(text) if t.startswith("#if defined(__CUDA_ARCH__)"))
end = next(i for i, t in enumerate(text) if i > start and t.startswith("#else"))
device_branch = sum(1 for t in text[start + 1 : end] if t.strip() and not t.strip().startswith("//"))
total = shared + cu + device_branch
print(f"cuda/sample_tokens.cu: {cu} logic lines; device_math.h's device branch: {device_branch} (CUDA only)")
print(f"The CUDA sampler's {total} logic lines: {shared} shared ({100 * shared / total:.1f}%), "
      f"{executed} shared and executed by the CPU tests ({100 * executed / total:.1f}%)")
EOF
