#!/usr/bin/env bash
# transformers' own generation tests for gpt2, opt, llama, qwen3 and mistral (every test marked
# @pytest.mark.generate in tests/models/<family>/test_modeling_<family>.py, which pulls in
# tests/generation/test_utils.py, tests/causal_lm_tester.py and tests/test_modeling_common.py), run twice:
# plainly, then with every GenerationMixin.generate call routed through torchkvops.patch_generate
# (scripts/hf_generate_plugin.py). Prints the tests passing in each run, the regressions (passing
# plainly, not routed) and how many generate calls the rollout served or sent back to HF's generate,
# by cause. Not part of CI; about 10-20 minutes on 2 CPU cores.
#
#   scripts/hf_generation_suite.sh [CHECKOUT [OUT_DIR]]
#
# CHECKOUT: a huggingface/transformers checkout at $COMMIT; the script reads its tests/, utils/ and
# src/transformers/testing_utils.py, and never imports its src/ (the tests run against the installed
# transformers). Without it, one is fetched into OUT_DIR/transformers (network to github.com needed):
#   git clone --filter=blob:none --no-checkout https://github.com/huggingface/transformers CHECKOUT
#   git -C CHECKOUT sparse-checkout set --no-cone /tests/ /utils/ /src/transformers/testing_utils.py
#   git -C CHECKOUT checkout $COMMIT
# COMMIT: e31443976ba8aca39f28c36c97f1805ba8326f43 (huggingface/transformers main of 2026-06-09,
# version 5.10.0.dev0), the newest commit whose tests we could read; the installed transformers is
# 5.24.0. Set HF_SUITE_COMMIT=v5.24.0 to use the tests of the installed release where the tag can be
# fetched (the plugin's compatibility shims then do nothing). Nothing fetched is committed here.
#
# Test-only dependencies the venv lacks (parameterized, timeout_decorator, httpx and its httpcore,
# certifi, sniffio) are installed into OUT_DIR/deps with `pip install --target`, never into the venv.
# Environment: PYTHON (default: .venv/bin/python of this repository), HF_SUITE_TIMEOUT (seconds per run,
# default 3600).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMMIT="${HF_SUITE_COMMIT:-e31443976ba8aca39f28c36c97f1805ba8326f43}"
OUT="$(mkdir -p "${2:-/tmp/hf_generation_suite}" && cd "${2:-/tmp/hf_generation_suite}" && pwd)"
CHECKOUT="${1:-$OUT/transformers}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
FAMILIES=(gpt2 opt llama qwen3 mistral)

if [[ ! -d "$CHECKOUT/tests/generation" ]]; then
  echo "fetching huggingface/transformers@$COMMIT (tests/, utils/, src/transformers/testing_utils.py) into $CHECKOUT"
  git clone --filter=blob:none --no-checkout https://github.com/huggingface/transformers "$CHECKOUT"
  git -C "$CHECKOUT" sparse-checkout set --no-cone /tests/ /utils/ /src/transformers/testing_utils.py
  git -C "$CHECKOUT" checkout --quiet "$COMMIT"
fi

if ! PYTHONPATH="$OUT/deps" "$PY" -c "import parameterized, httpx, timeout_decorator" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-deps --target "$OUT/deps" parameterized timeout_decorator httpx httpcore certifi sniffio
fi

TEST_FILES=()
for family in "${FAMILIES[@]}"; do TEST_FILES+=("tests/models/$family/test_modeling_$family.py"); done

for mode in plain routed; do
  echo "running transformers' generation tests, $mode ($OUT/$mode.log)"
  (cd "$CHECKOUT" && HF_SUITE_ROUTE=$([[ $mode == routed ]] && echo 1 || echo 0) HF_SUITE_REPORT="$OUT/$mode.json" \
    HF_SUITE_CHECKOUT="$CHECKOUT" PYTHONPATH="$OUT/deps:$ROOT/scripts:$ROOT" \
    timeout "${HF_SUITE_TIMEOUT:-3600}" "$PY" -m pytest -p hf_generate_plugin --noconftest -p no:cacheprovider \
    -o addopts="" -q -W ignore::pytest.PytestUnknownMarkWarning --continue-on-collection-errors "${TEST_FILES[@]}" > "$OUT/$mode.log" 2>&1) || true
  tail -n 1 "$OUT/$mode.log"
done

"$PY" - "$OUT/plain.json" "$OUT/routed.json" "$COMMIT" <<'EOF'
import collections, json, sys

plain, routed = (json.load(open(path)) for path in sys.argv[1:3])
print(f"\ntransformers tests at {sys.argv[3]}, against the installed transformers; torchkvops from {routed['torchkvops']}")
for name, run in (("plain", plain), ("routed", routed)):
    counts = collections.Counter(run["tests"].values())
    print(f"{name:7s} " + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped")))
regressions = sorted(t for t, o in plain["tests"].items() if o == "passed" and routed["tests"].get(t) != "passed")
fixed = sorted(t for t, o in plain["tests"].items() if o != "passed" and routed["tests"].get(t) == "passed")
print(f"regressions (pass plainly, not routed): {len(regressions)}")
for t in regressions:
    print(f"  {t}: {routed['tests'].get(t, 'not run')}")
print(f"pass routed only: {len(fixed)}" + "".join(f"\n  {t}" for t in fixed))
calls = routed["calls"]
fallbacks = sum(calls["fallback"].values())
print(f"generate calls routed: {calls['generate']}; served by the rollout: {calls['served']}; "
      f"fell back to HF's generate: {fallbacks}; raised before either: {calls['generate'] - calls['served'] - fallbacks}")
for test, n in calls["served_in"].items():
    print(f"  served {n} in {test}")
print("fallbacks by cause:")
for cause, n in calls["fallback"].items():
    print(f"  {n:4d}  {cause}    e.g. {calls['examples'][cause][:150]}")
EOF
