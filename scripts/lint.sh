#!/usr/bin/env bash
# The formatters and linter, as CI runs them before the tests (.ci/run): ruff format and ruff check
# (configured in pyproject.toml) over the Python sources, clang-format (.clang-format) over
# torchkvops/csrc. Exits non-zero on the first that would change something; `scripts/lint.sh --fix`
# applies them instead. Needs scripts/setup.sh first (it installs the pinned tools into .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t cxx < <(git ls-files 'torchkvops/csrc/*.cpp' 'torchkvops/csrc/*.h' 'torchkvops/csrc/*.cu' 'torchkvops/csrc/*.cuh')
if [ "${1:-}" = "--fix" ]; then
  .venv/bin/ruff check --fix .
  .venv/bin/ruff format .
  .venv/bin/clang-format -i "${cxx[@]}"
  exit 0
fi
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/clang-format --dry-run --Werror "${cxx[@]}"
echo "lint.sh: ruff format, ruff check and clang-format found nothing to change"
