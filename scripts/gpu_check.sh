#!/usr/bin/env bash
# The GPU check, in one call on a machine with a CUDA GPU (made for one H200, torch 2.11+cu130,
# nvcc 13.0, no network, no trl): build the extension, run the CUDA tests (graph decode, the sampler,
# merge_attention_states, the KV ops), the repeat_kv_cache_ bandwidth table, the decode benchmarks of
# issues #8 and #9 (OPT-6.7B anchor, Qwen3-0.6B long prompts, OPT-125m matrix; CUDA-graph decode, both
# KV layouts, HF generate with its default and static cache), issue #19's compaction on spread response
# lengths, the sampler and merge benchmarks, the log-probability mismatch and float32-head cost of issue
# #18, and the compiled anchor if time is left. Everything lands in OUT_DIR: one log per step, the JSON
# results, exit_codes.txt and summary.txt. A failing step does not stop the next one. Copy OUT_DIR to
# benchmarks/results/<date>_h200/ and commit it.
#
#   scripts/gpu_check.sh OUT_DIR
#
# Through the device tool, which brings back at most 8 files from $OUT, pack the results (and give the
# call timeout_s >= 540, so that the tar runs after the budget below):
#   scripts/gpu_check.sh /tmp/gc; tar czf $OUT/gpu_check.tgz -C /tmp gc
#
# It ends within 8 minutes: every step runs under `timeout`, clipped to what is left of a
# GPU_CHECK_BUDGET_S budget (default 470 s); a step with under 15 s left is skipped. SKIP_BUILD=1
# skips the build (already built on this machine). GPU_CHECK_STEPS="name ..." runs only the steps named
# (env always runs): the steps' limits add up to more than one call's budget, so a second call on the
# still-warm machine can run what the first skipped, e.g.
#   SKIP_BUILD=1 GPU_CHECK_STEPS="train-llama train-opt mismatch-bf16 bench-lm-head" scripts/gpu_check.sh /tmp/gc2
# Exit code: 0 when every step that ran passed.
set -u -o pipefail

out_arg="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$out_arg" && out="$(cd "$out_arg" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
budget="${GPU_CHECK_BUDGET_S:-470}"
start=$SECONDS
failed=0
: > "$out/exit_codes.txt"
rows=()

# step NAME LIMIT_S COMMAND...: run COMMAND under timeout, log to OUT_DIR/NAME.log, record its exit code.
step() {
  local name=$1 limit=$2
  shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [ "$name" != env ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
    echo "$name not-selected" >>"$out/exit_codes.txt"
    return 0
  fi
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
  step pytest-cuda 150 "$PY" -m pytest -q -m cuda -p no:cacheprovider --continue-on-collection-errors -rs tests/
else
  echo "=== pytest-cuda: pytest is not installed here" | tee "$out/pytest-cuda.log"
  rows+=("$(printf '%-14s %-8s %6s' pytest-cuda "missing" -)")
  echo "pytest-cuda missing" >>"$out/exit_codes.txt"
  failed=1
fi

step bench-op 40 "$PY" -m torchkvops bench-op --device cuda --max-mib 4096 --output "$out/bench_op.json"

# The decode goals of issues #8 and #9, most important first (each JSON has decode ms/step, GB/s and the
# fraction of a copy_ roofline measured in the same run; modes run interleaved).
# DeepSpeed's anchor: OPT-6.7B shape, fp16, B=1 N=4 P=512 R=32 (graph decode without compile; HF's
# generate with its default and its static cache).
step anchor-6.7b 120 "$PY" -m torchkvops bench --model-shape opt-6.7b --dtype fp16 --device cuda --batch-sizes 1 \
  --samples-per-prompt 4 --prompt-lengths 512 --response-lengths 32 --modes expanded shared prefix hf-generate \
  hf-static --warmup 2 --iterations 5 --no-progress --output "$out/anchor_opt6.7b_fp16.json"
# Long prompts, grouped-query attention: Qwen3-0.6B shape, bf16, B=2 N=16 P=4096 R=64.
step long-prompt 130 "$PY" -m torchkvops bench --model-shape qwen3-0.6b --dtype bf16 --device cuda --batch-sizes 2 \
  --samples-per-prompt 16 --prompt-lengths 4096 --response-lengths 64 --modes shared prefix hf-generate hf-static \
  --warmup 1 --iterations 3 --no-progress --output "$out/long_prompt_qwen3_bf16.json"
# The OPT-125m bf16 matrix of the first GPU run.
step matrix-125m 70 "$PY" -m torchkvops bench --model-shape opt-125m --dtype bf16 --device cuda --batch-sizes 1 8 \
  --samples-per-prompt 4 16 --prompt-lengths 512 --response-lengths 32 --modes expanded shared prefix hf-generate \
  --warmup 2 --iterations 5 --no-progress --output "$out/matrix_opt125m_bf16.json"
# Issue #19: compaction as responses end, on spread (geometric, mean R/4) lengths: decode time and the
# useful fraction with compaction on and off, interleaved, and HF generate; Qwen3-0.6B shape, bf16,
# B=8 N=16 (128 rows) P=256 R=256.
step compaction 120 "$PY" -m torchkvops bench --model-shape qwen3-0.6b --dtype bf16 --device cuda --batch-sizes 8 \
  --samples-per-prompt 16 --prompt-lengths 256 --response-lengths 256 --length-profile geometric \
  --modes shared shared-nocompact prefix prefix-nocompact hf-generate --warmup 1 --iterations 3 --no-progress \
  --output "$out/compaction_qwen3_bf16.json"
# Issue #17: shared-prefix forward + backward (patch_forward) against the plain forward, the issue's matrix
# P x C x G, bf16; its CUDA tests run in pytest-cuda above. opt-125m has 2048 positions: P <= 1024 there.
# The JSON is rewritten after every case, so a step cut by its limit keeps the cases it finished; the
# tables are in the steps' logs.
step train-llama 90 "$PY" -m torchkvops bench-train --model-shape llama-small --dtype bf16 --device cuda \
  --prompt-lengths 256 1024 4096 --completion-lengths 64 256 1024 --group-sizes 4 8 16 --warmup 1 --iterations 3 \
  --output "$out/train_llama_small_bf16.json"
step train-opt 60 "$PY" -m torchkvops bench-train --model-shape opt-125m --dtype bf16 --device cuda \
  --prompt-lengths 256 1024 --completion-lengths 64 256 1024 --group-sizes 4 8 16 --warmup 1 --iterations 3 \
  --output "$out/train_opt125m_bf16.json"
step bench-sampler 30 "$PY" benchmarks/bench_sampler.py --device cuda --rows 64 8 --vocab 151936 50272 --dtype bf16 --iters 50
# Issue #18: the rollout-vs-trainer log-probability mismatch in bf16 (each layout, with and without the
# float32 LM head, against HF generate on the same tokens), and what return_logprobs and the float32
# head cost per decode step.
step mismatch-bf16 100 "$PY" -m torchkvops bench --model-shape qwen3-0.6b --dtype bf16 --device cuda --batch-sizes 2 \
  --samples-per-prompt 8 --prompt-lengths 256 --response-lengths 64 --modes expanded shared prefix hf-generate \
  --warmup 1 --iterations 2 --mismatch --no-progress --output "$out/mismatch_qwen3_bf16.json"
step bench-lm-head 40 "$PY" benchmarks/bench_lm_head.py --model-shape qwen3-0.6b --device cuda --rows 4 8 \
  --prompt-length 256 --response-length 64 --rounds 10
step bench-merge 20 "$PY" benchmarks/bench_merge_attention_states.py --device cuda
# Compiled decode (about 100 s of compile per mode on this shape, so one mode): last, skipped when the
# budget is spent.
step anchor-compiled 160 "$PY" -m torchkvops bench --model-shape opt-6.7b --dtype fp16 --device cuda --compile \
  --batch-sizes 1 --samples-per-prompt 4 --prompt-lengths 512 --response-lengths 32 --modes shared \
  --warmup 2 --iterations 5 --no-progress --output "$out/anchor_opt6.7b_fp16_compiled.json"

{
  echo "gpu_check: $((SECONDS - start))s; results in $out"
  printf '%-14s %-8s %6s\n' step exit time
  printf '%s\n' "${rows[@]}"
  for f in anchor-6.7b long-prompt matrix-125m compaction mismatch-bf16 anchor-compiled; do
    [ -f "$out/$f.log" ] || continue
    echo
    echo "--- $f"
    grep -E '^(B[0-9]+_N|\||tokens:)' "$out/$f.log" | grep -v '^|---' || true
  done
} | tee "$out/summary.txt"
exit "$failed"
