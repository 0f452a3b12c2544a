#!/usr/bin/env bash
# The GPU check, in one device call on a machine with a CUDA GPU (made for one H200 with torch 2.11+cu130,
# transformers 5.17, nvcc 13.0, pytest, hypothesis and peft, no network; expecttest, trl and deepspeed
# absent: the tests that need trl or deepspeed skip themselves, and nothing here needs expecttest):
# build the extension, run every CUDA test (`-m cuda`: the kernels, graph decode, the sampler, the fused
# attention, patch_forward, and a one-process NCCL FSDP2 call gathered once and decoded from CUDA graphs),
# then the benchmarks that matter most, smallest sizes that still answer their question: the
# repeat_kv_cache_ bandwidth table, DeepSpeed's OPT-6.7B anchor (graph decode, both KV layouts, HF's
# generate), Qwen3-0.6B long prompts, compaction on spread response lengths, the shared training forward,
# the bf16 log-probability mismatch, the sampler, the float32 head and merge_attention_states.
# Everything lands in OUT_DIR: one log per step, the JSON results, exit_codes.txt and summary.txt. A
# failing step does not stop the next one. Copy OUT_DIR to benchmarks/results/<date>_h200/ and commit it.
#
#   scripts/gpu_check.sh OUT_DIR
#
# Through the device tool, which brings back at most 8 files from $OUT, pack the results, with a call
# timeout_s of 600 (the budget below ends the steps by 9 minutes, the tar runs after):
#   scripts/gpu_check.sh /tmp/gc; tar czf $OUT/gpu_check.tgz -C /tmp gc
#
# Every step runs under `timeout`, clipped to what is left of a GPU_CHECK_BUDGET_S budget (default 520 s:
# the whole default set is sized to finish inside it; a step with under 15 s left is skipped and listed as
# skipped, which does not fail the run). SKIP_BUILD=1 skips the build (already built on this machine).
# GPU_CHECK_STEPS="name ..." runs only the steps named (env always runs), the extra steps below included
# (matrix-125m, anchor-static, train-opt, anchor-compiled: not in the default set, each a minute or more
# of compiling or host-bound timing), e.g. on a still-warm machine after the first call:
#   SKIP_BUILD=1 GPU_CHECK_STEPS="anchor-static anchor-compiled" scripts/gpu_check.sh /tmp/gc2
# Exit code: 0 when every step that ran passed.
set -u -o pipefail

out_arg="${1:?usage: scripts/gpu_check.sh OUT_DIR}"
mkdir -p "$out_arg" && out="$(cd "$out_arg" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
budget="${GPU_CHECK_BUDGET_S:-520}"
start=$SECONDS
failed=0
: > "$out/exit_codes.txt"
rows=()
# Steps outside the default set: run only when GPU_CHECK_STEPS names them.
extras=" matrix-125m anchor-static train-opt anchor-compiled "

# step NAME LIMIT_S COMMAND...: run COMMAND under timeout, log to OUT_DIR/NAME.log, record its exit code.
step() {
  local name=$1 limit=$2
  shift 2
  local selected=1
  if [ -n "${GPU_CHECK_STEPS:-}" ]; then
    [ "$name" = env ] || [[ " $GPU_CHECK_STEPS " == *" $name "* ]] || selected=0
  elif [[ "$extras" == *" $name "* ]]; then
    selected=0
  fi
  if ((!selected)); then
    echo "$name not-selected" >>"$out/exit_codes.txt"
    return 0
  fi
  local left=$((budget - (SECONDS - start)))
  if ((left < 15)); then
    echo "=== $name: skipped, ${left}s of the budget left" | tee "$out/$name.log"
    rows+=("$(printf '%-14s %-8s %6s' "$name" skipped -)")
    echo "$name skipped" >>"$out/exit_codes.txt"
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

step env 20 bash -c "nvidia-smi; '$PY' -c 'import sys, torch, transformers; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); print(\"transformers\", transformers.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\")'; for m in pytest hypothesis peft expecttest trl deepspeed; do '$PY' -c \"import \$m\" 2>/dev/null && echo \"\$m: present\" || echo \"\$m: absent (its tests skip themselves)\"; done; command -v nvcc && nvcc --version | tail -2"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  step build 150 bash -c "'$PY' -m pip install --no-build-isolation --no-deps --no-index -e . && '$PY' -c 'import torchkvops; assert torchkvops.has_cuda_kernels(), \"the CUDA kernels were not compiled in\"; print(\"torchkvops built with CUDA kernels\")'"
fi

if "$PY" -c "import pytest" 2>/dev/null; then
  # First the direct tests of every kernel changed since the last GPU run (2026-11-30, a1b73be: write_kv_,
  # write_kv_slots_ and paged_attention (new), the sampler, merge_attention_states, repeat_kv_cache_, the fused attention's
  # CUDA branch) and the NCCL
  # FSDP2 call (tests/test_agreement.py, which launches its own process): what a timeout must not cut.
  # Then every other CUDA test, its limit sized from how many there are (counted here, at collection) at
  # 1.5 s each: the last run took 66 s for 81 model-level tests (0.8 s each). --durations shows where
  # the time went. --continue-on-collection-errors: a test module whose imports are missing here must
  # not keep the others from running.
  kernel_tests=(tests/test_write_kv.py tests/test_write_kv_slots.py tests/test_paged_attention.py tests/test_sample_tokens.py tests/test_merge_attention_states.py
    tests/test_repeat_kv_cache.py tests/test_fused_attention.py tests/test_agreement.py)
  step pytest-kernels 150 "$PY" -m pytest -q -m cuda -p no:cacheprovider --continue-on-collection-errors -rs \
    --durations=10 "${kernel_tests[@]}"
  ignores=()
  for f in "${kernel_tests[@]}"; do ignores+=(--ignore "$f"); done
  rest=$("$PY" -m pytest --collect-only -q -m cuda -p no:cacheprovider --continue-on-collection-errors \
    "${ignores[@]}" tests/ 2>/dev/null | sed -n -E 's#^([0-9]+)/[0-9]+ tests? collected.*#\1#p')
  rest=${rest:-100}
  echo "gpu_check: $rest other CUDA tests, limit $((rest * 3 / 2 + 30)) s" | tee "$out/pytest-cuda-count.log"
  step pytest-cuda $((rest * 3 / 2 + 30)) "$PY" -m pytest -q -m cuda -p no:cacheprovider \
    --continue-on-collection-errors -rs --durations=15 "${ignores[@]}" tests/
else
  echo "=== pytest-cuda: pytest is not installed here" | tee "$out/pytest-cuda.log"
  rows+=("$(printf '%-14s %-8s %6s' pytest-cuda "missing" -)")
  echo "pytest-cuda missing" >>"$out/exit_codes.txt"
  failed=1
fi

# Issue #52: paged_attention against SDPA on the same rows (log-normal lengths, median 1000 keys), at a
# small and a large budget: SDPA over the budget-wide buffer (today's decode) and over the longest row.
step bench-paged 40 "$PY" benchmarks/bench_paged_attention.py --device cuda --dtype bf16 --rows 64 --heads 16 \
  --kv-heads 2 --head-dim 128 --block-size 16 --mean-length 1000 --capacity 2048 16384 --iters 20
# write_kv_slots_ (the paged layout's writes) against the indexing it replaced: a decode step's and a prefill's.
step bench-write-slots 15 "$PY" benchmarks/bench_write_kv_slots.py --device cuda --cases 256x1,16x1024 --kv-heads 8 \
  --head-dim 128 --dtypes bf16 --iters 100
step bench-op 25 "$PY" -m torchkvops bench-op --device cuda --max-mib 1024 --output "$out/bench_op.json"

# The decode goals of issues #8 and #9, most important first (each JSON has decode ms/step, GB/s and the
# fraction of a copy_ roofline measured in the same run; modes run interleaved).
# DeepSpeed's anchor: OPT-6.7B shape, fp16, B=1 N=4 P=512 R=32 (graph decode without compile; HF's
# generate with its default cache; its static cache, which compiles for half a minute, is anchor-static).
step anchor-6.7b 75 "$PY" -m torchkvops bench --model-shape opt-6.7b --dtype fp16 --device cuda --batch-sizes 1 \
  --samples-per-prompt 4 --prompt-lengths 512 --response-lengths 32 --modes expanded shared prefix hf-generate \
  --warmup 1 --iterations 3 --no-progress --output "$out/anchor_opt6.7b_fp16.json"
# Long prompts, grouped-query attention: Qwen3-0.6B shape, bf16, B=2 N=16 P=4096 R=64.
step long-prompt 70 "$PY" -m torchkvops bench --model-shape qwen3-0.6b --dtype bf16 --device cuda --batch-sizes 2 \
  --samples-per-prompt 16 --prompt-lengths 4096 --response-lengths 64 --modes shared prefix hf-generate \
  --warmup 1 --iterations 2 --no-progress --output "$out/long_prompt_qwen3_bf16.json"
# Issue #19: compaction as responses end, on spread (geometric, mean R/4) lengths: decode time and the
# useful fraction with compaction on and off, interleaved, and HF generate; Qwen3-0.6B shape, bf16,
# B=8 N=16 (128 rows) P=256 R=256.
step compaction 60 "$PY" -m torchkvops bench --model-shape qwen3-0.6b --dtype bf16 --device cuda --batch-sizes 8 \
  --samples-per-prompt 16 --prompt-lengths 256 --response-lengths 256 --length-profile geometric \
  --modes shared shared-nocompact prefix hf-generate --warmup 1 --iterations 2 --no-progress \
  --output "$out/compaction_qwen3_bf16.json"
# Issue #17: shared-prefix forward + backward (patch_forward) against the plain forward, bf16; its CUDA
# tests run in pytest-cuda above. The JSON is rewritten after every case, so a step cut by its limit keeps
# the cases it finished; the tables are in the steps' logs.
step train-llama 45 "$PY" -m torchkvops bench-train --model-shape llama-small --dtype bf16 --device cuda \
  --prompt-lengths 1024 4096 --completion-lengths 256 --group-sizes 8 --warmup 1 --iterations 2 \
  --output "$out/train_llama_small_bf16.json"
# Issue #18: the rollout-vs-trainer log-probability mismatch in bf16 (each layout, with and without the
# float32 LM head, against HF generate on the same tokens).
step mismatch-bf16 50 "$PY" -m torchkvops bench --model-shape qwen3-0.6b --dtype bf16 --device cuda --batch-sizes 2 \
  --samples-per-prompt 8 --prompt-lengths 256 --response-lengths 64 --modes shared prefix hf-generate \
  --warmup 1 --iterations 1 --mismatch --no-progress --output "$out/mismatch_qwen3_bf16.json"
step bench-sampler 20 "$PY" benchmarks/bench_sampler.py --device cuda --rows 64 8 --vocab 151936 50272 --dtype bf16 --iters 30
# What return_logprobs and the float32 head cost per decode step.
step bench-lm-head 25 "$PY" benchmarks/bench_lm_head.py --model-shape qwen3-0.6b --device cuda --rows 4 8 \
  --prompt-length 256 --response-length 64 --rounds 5
step bench-merge 15 "$PY" benchmarks/bench_merge_attention_states.py --device cuda

# Extra steps (GPU_CHECK_STEPS only).
step matrix-125m 70 "$PY" -m torchkvops bench --model-shape opt-125m --dtype bf16 --device cuda --batch-sizes 1 8 \
  --samples-per-prompt 4 16 --prompt-lengths 512 --response-lengths 32 --modes expanded shared prefix hf-generate \
  --warmup 2 --iterations 5 --no-progress --output "$out/matrix_opt125m_bf16.json"
step anchor-static 90 "$PY" -m torchkvops bench --model-shape opt-6.7b --dtype fp16 --device cuda --batch-sizes 1 \
  --samples-per-prompt 4 --prompt-lengths 512 --response-lengths 32 --modes shared hf-static \
  --warmup 2 --iterations 5 --no-progress --output "$out/anchor_opt6.7b_fp16_static.json"
step train-opt 60 "$PY" -m torchkvops bench-train --model-shape opt-125m --dtype bf16 --device cuda \
  --prompt-lengths 256 1024 --completion-lengths 64 256 1024 --group-sizes 4 8 16 --warmup 1 --iterations 3 \
  --output "$out/train_opt125m_bf16.json"
# Compiled decode (about 100 s of compile per mode on this shape, so one mode).
step anchor-compiled 160 "$PY" -m torchkvops bench --model-shape opt-6.7b --dtype fp16 --device cuda --compile \
  --batch-sizes 1 --samples-per-prompt 4 --prompt-lengths 512 --response-lengths 32 --modes shared \
  --warmup 2 --iterations 5 --no-progress --output "$out/anchor_opt6.7b_fp16_compiled.json"

{
  echo "gpu_check: $((SECONDS - start))s; results in $out"
  printf '%-14s %-8s %6s\n' step exit time
  printf '%s\n' "${rows[@]}"
  for f in anchor-6.7b long-prompt compaction mismatch-bf16 matrix-125m anchor-static anchor-compiled; do
    [ -f "$out/$f.log" ] || continue
    echo
    echo "--- $f"
    grep -E '^(B[0-9]+_N|\||tokens:)' "$out/$f.log" | grep -v '^|---' || true
  done
} | tee "$out/summary.txt"
exit "$failed"
