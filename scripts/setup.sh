#!/usr/bin/env bash
# Sets up .venv (torch, transformers, test tools, trl, peft, deepspeed, ruff, clang-format) and builds torchkvops._C into it. Idempotent and
# cheap when nothing changed (about 2 s, the final import check): it installs only what is missing and
# rebuilds only when a C++/CUDA source, setup.py or the torch version changed (and then reuses a build of
# the same sources made on this machine before, from a cache outside the clone; an edit of pyproject.toml
# installs the same build again).
set -euo pipefail
cd "$(dirname "$0")/.."
export MAX_JOBS="${MAX_JOBS:-2}"

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
# --no-compile: the modules are byte-compiled when first imported, not every file of torch and transformers
# at install time (most are never imported here).
pip_install() { "$py" -m pip install -q --disable-pip-version-check --no-compile "$@"; }

# What the environment needs, in two groups, each with the imports that prove it is installed.
# torch 2.14.1 (a CUDA build, so the CUDA kernels compile here) lies on this machine's disk.
# pytest-xdist: the README's test command runs the suite in two processes (`-n 2`: 18.8 min against 23.7 in
# one, the same 2-core machine and day; docs/benchmarks.md, "The suite's wall time").
base_reqs=("torch>=2.11,<=2.14.1" "transformers>=5.0" ninja pytest pytest-xdist expecttest hypothesis)
base_check="import torch, transformers, ninja, pytest, xdist, expecttest, hypothesis"
# TRL (with accelerate and datasets) for tests/test_trl.py and examples/grpo_trl.py: the `trl` extra;
# peft (LoRA adapters) for the tests that use one: in the `test` extra; DeepSpeed for tests/test_zero3.py
# (ZeRO-3 on its CPU accelerator): the `deepspeed` extra.
trl_reqs=("trl>=1.16" "peft>=0.13" "deepspeed>=0.19" "torch>=2.11,<=2.14.1")
trl_check="import trl, accelerate, datasets, peft, deepspeed; from trl import GRPOTrainer"
# The formatter and linters that scripts/lint.sh (and .ci/run, before the tests) runs, pinned: another
# version may format otherwise.
lint_reqs=("ruff==0.17.6" "clang-format==23.1.5")
lint_check="import ruff, clang_format"

# The installs are skipped without importing anything when the venv holds the same distributions as
# after the last run that ended well (importing trl alone takes 13 s on a small machine). The key: the
# requirements above and the venv's *.dist-info folder names (one per installed distribution and version).
deps_stamp=.venv/.torchkvops-deps
deps_key() {
  { printf '%s\n' "${base_reqs[@]}" "$base_check" "${trl_reqs[@]}" "$trl_check" "${lint_reqs[@]}" "$lint_check"
    ls -d .venv/lib/python3*/site-packages/*.dist-info 2>/dev/null; } | sha1sum
}
if [ ! -f "$deps_stamp" ] || [ "$(cat "$deps_stamp")" != "$(deps_key)" ]; then
  if ! "$py" -c "$base_check" >/dev/null 2>&1; then
    echo "setup.sh: installing torch, transformers and the test tools into .venv"
    pip_install "${base_reqs[@]}"
  fi
  if ! "$py" -c "$trl_check" >/dev/null 2>&1; then
    echo "setup.sh: installing trl, peft and deepspeed into .venv"
    pip_install "${trl_reqs[@]}"
  fi
  if ! "$py" -c "$lint_check" >/dev/null 2>&1 || ! .venv/bin/ruff --version | grep -q "^ruff 0.17.6$"; then
    echo "setup.sh: installing ruff and clang-format into .venv"
    pip_install "${lint_reqs[@]}"
  fi
fi

stamp=build/.torchkvops-built
torch_version="$(sed -n "s/^__version__ = '\(.*\)'$/\1/p" .venv/lib/python3*/site-packages/torch/version.py)"
# What the library is compiled from: setup.py and the C++/CUDA sources and headers (not csrc's README).
sources="$torch_version $(find setup.py torchkvops/csrc -type f \( -name setup.py -o -name '*.h' -o -name '*.cpp' \
  -o -name '*.cu' -o -name '*.cuh' \) | LC_ALL=C sort | xargs cat | sha1sum)"
# When to install again: the sources, or pyproject.toml (it names the packages and the console script that
# the install writes).
want="$sources $(sha1sum < pyproject.toml)"
# A build of the same sources is kept outside the clone, keyed by everything it is compiled from (the
# sources above, the Python, and the settings setup.py reads; not pyproject.toml, whose edit only installs
# the same build again), as ccache keeps a compiler's: a fresh clone on a machine that built these sources
# once installs the same library without compiling it again (2-5 minutes of a 2-core machine).
# TORCHKVOPS_NO_BUILD_CACHE=1 always compiles; the cache is ${TORCHKVOPS_BUILD_CACHE:-~/.cache/torchkvops/builds},
# one folder per key.
build_key="$(printf '%s|%s|%s|%s|%s|%s' "$sources" "$("$py" -c 'import sys; print(sys.version)')" \
  "${TORCH_CUDA_ARCH_LIST:-}" "${TORCHKVOPS_NO_CUDA:-}" "${DEBUG:-}" "${CUDA_HOME:-}" | sha1sum | cut -c1-20)"
cached="${TORCHKVOPS_BUILD_CACHE:-$HOME/.cache/torchkvops/builds}/$build_key"
needs_build() { [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! ls torchkvops/_C*.so >/dev/null 2>&1; }
mkdir -p build
log=build/torchkvops-build.log
if needs_build && [ "${TORCHKVOPS_NO_BUILD_CACHE:-0}" != "1" ] && ls "$cached"/_C*.so >/dev/null 2>&1; then
  echo "setup.sh: these sources were built here before: installing that build ($cached;"
  echo "  TORCHKVOPS_NO_BUILD_CACHE=1 compiles them again)"
  cp "$cached"/_C*.so torchkvops/
  # The editable install without compiling (setup.py leaves the extension out): the package, its console
  # script and its metadata, as a build installs them.
  if ! TORCHKVOPS_PREBUILT=1 "$py" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
      -e . >"$log" 2>&1; then
    echo "setup.sh: the install failed; the end of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
if needs_build; then
  echo "setup.sh: building torchkvops._C (the C++ kernels, and the CUDA kernels when torch is a CUDA build and a"
  echo "  toolkit is found) with MAX_JOBS=$MAX_JOBS: 3 minutes on an idle 2-core machine, up to 10 while other jobs"
  echo "  share it; ninja's [done/total] steps follow (the CUDA files take longest), the full log goes to $log"
  # pip -v shows ninja's lines as they come; only their step counter and the file compiled are printed.
  if ! "$py" -m pip install -v --disable-pip-version-check --no-build-isolation --no-deps -e . 2>&1 | tee "$log" \
      | sed -u -n -E -e "s#$PWD/##g" -e 's#^ *(\[[0-9]+/[0-9]+\]) .* -c ([^ ]+) .*#  \1 \2#p'; then
    echo "setup.sh: the build failed; the end of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
  if [ "${TORCHKVOPS_NO_BUILD_CACHE:-0}" != "1" ]; then  # (kept for the next clone; a failed copy is no error)
    mkdir -p "$cached.tmp$$" && cp torchkvops/_C*.so "$cached.tmp$$"/ && mv -T "$cached.tmp$$" "$cached" 2>/dev/null \
      || rm -rf "$cached.tmp$$"
  fi
fi
# out/ (git-ignored): where the README's benchmark commands write their JSON.
mkdir -p out
"$py" -c "import torch, torchkvops; print('torchkvops ready: torch', torch.__version__, '| CUDA kernels compiled in:', torchkvops.has_cuda_kernels())"
deps_key > "$deps_stamp"
