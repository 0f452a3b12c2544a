#!/usr/bin/env bash
# Sets up .venv (torch, transformers, test tools, trl) and builds torchkvops._C into it. Idempotent and cheap
# when nothing changed: it installs only what is missing and rebuilds only when a C++/CUDA source,
# setup.py, pyproject.toml or the torch version changed.
set -euo pipefail
cd "$(dirname "$0")/.."
export MAX_JOBS="${MAX_JOBS:-2}"

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python

# torch 2.14.1 (a CUDA build, so the CUDA kernels compile here) lies on this machine's disk.
if ! "$py" -c "import torch, transformers, ninja, pytest, expecttest, hypothesis" >/dev/null 2>&1; then
  "$py" -m pip install -q --disable-pip-version-check "torch>=2.11,<=2.14.1" "transformers>=5.0" ninja pytest expecttest hypothesis
fi
# TRL (with accelerate and datasets) for tests/test_trl.py and examples/grpo_trl.py: the `trl` extra.
if ! "$py" -c "import trl, accelerate, datasets; from trl import GRPOTrainer" >/dev/null 2>&1; then
  "$py" -m pip install -q --disable-pip-version-check "trl>=1.16" "torch>=2.11,<=2.14.1"
fi

stamp=build/.torchkvops-built
# pyproject.toml too: it names the packages and the console script that the install writes.
want="$("$py" -c 'import torch; print(torch.__version__)') $(cat setup.py pyproject.toml torchkvops/csrc/*.* torchkvops/csrc/*/*.* | sha1sum)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! ls torchkvops/_C*.so >/dev/null 2>&1; then
  "$py" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
  mkdir -p build && echo "$want" > "$stamp"
fi
# out/ (git-ignored): where the README's benchmark commands write their JSON.
mkdir -p out
"$py" -c "import torchkvops; print('torchkvops ready: torch', torchkvops.torch.__version__, '| CUDA kernels compiled in:', torchkvops.has_cuda_kernels())"
