#!/usr/bin/env bash
# The floor check: the tests that depend most on other libraries' versions (sharded models in two gloo
# processes, hybrids, every family's coverage, Hugging Face's generate contract, TRL), run against the
# lowest versions pyproject.toml admits: torch 2.11 and transformers 5.17, what the GPU machine has, with
# trl, peft and deepspeed at versions that install beside them. CI runs the newest; this runs the floor.
#
#   bash scripts/floor_check.sh              # the default selection below
#   bash scripts/floor_check.sh tests/test_fsdp.py -k lora   # pytest arguments of your own instead
#
# The environment is cached in .floor/ (git-ignored; FLOOR_DIR moves it): a virtual environment with the
# floor versions (about 6 GB; created once, 2-3 minutes with the wheels downloaded) and a copy of this
# checkout's files, built there against torch 2.11 (so that the checkout's own build for .venv stays as it
# is), rebuilt only when a C++/CUDA source or setup.py changed: 3-10 minutes on a 2-core machine. The
# Python files are copied again on every run. The last line says what ran and how it ended.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
floor="${FLOOR_DIR:-$root/.floor}"
venv=$floor/venv
src=$floor/src
export MAX_JOBS="${MAX_JOBS:-2}" PIP_DISABLE_PIP_VERSION_CHECK=1

# The floor: torch and transformers at pyproject.toml's lowest admitted versions (the GPU machine's);
# trl, peft and deepspeed at the lowest versions of their extras that work beside those.
floor_reqs=(
  "torch==2.11.0" "transformers==5.17.0" ninja "setuptools>=64" wheel pytest expecttest hypothesis
  "trl==1.16.0" "peft==0.13.0" "deepspeed==0.19.0"
)
check="import torch, transformers, trl, peft, deepspeed, pytest, expecttest, hypothesis"

if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$floor"
  python3 -m venv "$venv"
fi
py=$venv/bin/python
stamp=$venv/.floor-reqs
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${floor_reqs[*]}" ] || ! "$py" -c "$check" >/dev/null 2>&1; then
  echo "floor_check: installing ${floor_reqs[*]} into $venv"
  "$py" -m pip install -q "${floor_reqs[@]}"
  echo "${floor_reqs[*]}" > "$stamp"
fi

# This checkout's files (tracked and untracked, not ignored) into $src, its Python files removed first so
# that a file removed here is gone there too (the build's outputs stay).
mkdir -p "$src"
find "$src" -name '*.py' -not -path "$src/build/*" -delete
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$src"
# out/ (git-ignored, made by setup.sh in a checkout): where the docs' commands, which tests/test_docs.py
# parses, write their files.
mkdir -p "$src/out"
built=$src/build/.floor-built
want="$("$py" -c 'import torch; print(torch.__version__)') $(cat setup.py pyproject.toml torchkvops/csrc/*.* torchkvops/csrc/*/*.* | sha1sum)"
if [ ! -f "$built" ] || [ "$(cat "$built")" != "$want" ] || ! ls "$src"/torchkvops/_C*.so >/dev/null 2>&1; then
  mkdir -p "$src/build"
  echo "floor_check: building torchkvops._C against $("$py" -c 'import torch; print(torch.__version__)') in $src (log: $src/build/floor-build.log)"
  if ! (cd "$src" && "$py" -m pip install -v --no-build-isolation --no-deps -e . >build/floor-build.log 2>&1); then
    tail -n 40 "$src/build/floor-build.log" >&2
    echo "floor_check: the build failed" >&2
    exit 1
  fi
  echo "$want" > "$built"
fi

versions="$("$py" -c 'import torch, transformers, trl, peft, deepspeed; print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, peft {peft.__version__}, deepspeed {deepspeed.__version__}")' 2>/dev/null | tail -n 1)"
echo "floor_check: $versions"
if [ "$#" -eq 0 ]; then
  # Sharded (FSDP2, FSDP1, ZeRO-3, data parallel: two gloo processes each), hybrids, the coverage table,
  # the generate contract, the TRL runs, and the newest operator (its registration, fake kernel and
  # opcheck against torch 2.11's dispatcher).
  set -- tests/test_fsdp.py tests/test_zero3.py tests/test_distributed.py tests/test_agreement.py \
    tests/test_trl_sharded.py tests/test_hybrid.py tests/test_coverage.py tests/test_generate_contract.py \
    tests/test_trl.py tests/test_floor.py tests/test_paged_attention.py tests/test_widening.py
fi
start=$SECONDS
set +e
(cd "$src" && HF_HUB_OFFLINE=1 "$py" -m pytest -q -rs -p no:cacheprovider "$@") 2>&1 | tee "$floor/last.log"
rc=${PIPESTATUS[0]}
set -e
echo "floor_check: $(tail -n 1 "$floor/last.log" | sed 's/=//g; s/^ *//; s/ *$//') on $versions ($((SECONDS - start)) s; rc $rc)"
exit "$rc"
