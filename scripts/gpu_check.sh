#!/usr/bin/env bash
# The GPU check, in one call on a machine with a CUDA GPU (made for one H200, torch 2.11+cu130,
# nvcc 13.0, no network): build the extension, run the CUDA tests, the repeat_kv_cache_ bandwidth
# table and the rollout A/B matrix in fp16 and bf16. Everything lands in OUT_DIR: one log per step,
# the JSON results, exit_codes.txt and summary.txt. A failing step does not stop the next one.
#
#   scripts/gpu_check.sh OUT_DIR
#
# It ends within 8 minutes: every step runs under `timeout`, clipped to what is left of a
# GPU_CHECK_BUDGET_S budget (default 455 s); a step with under 15 s left is skipped. SKIP_BUILD=1
# skips the build (already built on this machine). Exit code: 0 when every step passed.
set -u -o pipefail

out_arg="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$out_arg" && out="$(cd "$out_arg" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python || command -v python3)}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
budget="${GPU_CHECK_BUDGET_S:-455}"
start=$SECONDS
failed=0
: > "$out/exit_codes.txt"
rows=()

# step NAME LIMIT_S COMMAND...: run COMMAND under timeout, log to OUT_DIR/NAME.log, record its exit code.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - start)))
  if ((left < 15)); then
    echo "=== $name: skipped, ${left}s of the budget left" | tee "$out/$name.log"
    rows+=("$(printf '%-14s %-8s %6s' "$name" skipped -)")
    echo "$name skipped" >>"$out/exit_codes.txt"
    failed=1
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s): $*" | tee "$out/$name.log"
  local t0=$SECONDS rc
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$out/$name.log"
  rc=$?
  ((rc == 124 || rc == 137)) && echo "=== $name: timed out after ${limit}s" | tee -a "$out/$name.log"
  echo "=== $name: exit code $rc after $((SECONDS - t0))s" | tee -a "$out/$name.log"
  rows+=("$(printf '%-14s %-8s %5ss' "$name" "$rc" $((SECONDS - t0)))")
  echo "$name $rc $((SECONDS - t0))" >>"$out/exit_codes.txt"
  ((rc != 0)) && failed=1
  return 0
}

step env 30 bash -c "nvidia-smi; '$PY' -c 'import sys, torch, transformers; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); print(\"transformers\", transformers.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\")'; command -v nvcc && nvcc --version | tail -2"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  step build 200 bash -c "'$PY' -m pip install --no-build-isolation --no-deps --no-index -e . && '$PY' -c 'import torchkvops; assert torchkvops.has_cuda_kernels(), \"the CUDA kernels were not compiled in\"; print(\"torchkvops built with CUDA kernels\")'"
fi

if "$PY" -c "import pytest" 2>/dev/null; then
  # --continue-on-collection-errors: a test module whose imports are missing here (say hypothesis)
  # must not keep the others from running.
  step pytest-cuda 180 "$PY" -m pytest -q -m cuda -p no:cacheprovider --continue-on-collection-errors -rs tests/
else
  echo "=== pytest-cuda: pytest is not installed here" | tee "$out/pytest-cuda.log"
  rows+=("$(printf '%-14s %-8s %6s' pytest-cuda "missing" -)")
  echo "pytest-cuda missing" >>"$out/exit_codes.txt"
  failed=1
fi

step bench-op 60 "$PY" -m torchkvops bench-op --device cuda --output "$out/bench_op.json"

matrix=(--model-shape opt-125m --device cuda --batch-sizes 1 8 --samples-per-prompt 4 16 --prompt-lengths 512
  --response-lengths 32 --modes expanded shared hf-generate --warmup 2 --iterations 5 --no-progress)
step bench-fp16 100 "$PY" -m torchkvops bench "${matrix[@]}" --dtype fp16 --output "$out/bench_fp16.json"
step bench-bf16 100 "$PY" -m torchkvops bench "${matrix[@]}" --dtype bf16 --output "$out/bench_bf16.json"

# Extras, if time is left: a rollout on the GPU, and the compiled rollout (CUDA graphs) on the largest case.
step rollout-cuda 45 "$PY" -m torchkvops rollout --model-shape tiny --device cuda --dtype bf16 -n 4 \
  --max-new-tokens 16 --output "$out/rollout.jsonl"
step bench-compile 150 "$PY" -m torchkvops bench --model-shape opt-125m --device cuda --dtype bf16 --compile \
  --batch-sizes 8 --samples-per-prompt 16 --prompt-lengths 512 --response-lengths 32 --modes expanded shared \
  --warmup 3 --iterations 5 --no-progress --output "$out/bench_compile_bf16.json"

{
  echo "gpu_check: $((SECONDS - start))s; results in $out"
  printf '%-14s %-8s %6s\n' step exit time
  printf '%s\n' "${rows[@]}"
  for f in bench-fp16 bench-bf16 bench-compile; do
    [ -f "$out/$f.log" ] || continue
    echo
    echo "--- $f"
    grep -E '^(B[0-9]+_N|\||tokens:)' "$out/$f.log" | grep -v '^|---' || true
  done
} | tee "$out/summary.txt"
exit "$failed"
