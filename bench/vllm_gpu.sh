#!/usr/bin/env bash
# vLLM on the GPU machine, once its wheels are in /tmp/vllm_carry (they travel in parts over back-to-back
# calls, built by bench/vllm_carry.py; docs/performance.md says how): install them into /tmp/site, run the
# performance workload with vLLM generating (bench/grpo_step.py --rollout vllm), then the vLLM tests
# (tests/test_vllm_rollout.py, and multi-turn episodes through vLLM in tests/test_multi_turn_runs.py).
#   bash bench/vllm_gpu.sh <tokenizer folder> <output folder>
set -uo pipefail
TOK=$(realpath "$1")
OUT=$(realpath -m "$2")
mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
CARRY_DIR=${CARRY_DIR:-/tmp/vllm_carry} bash "${CARRY_DIR:-/tmp/vllm_carry}/install.sh" > "$OUT/install.log" 2>&1
# Its closing import check fails until the extra wheels below are in (rc=1, "No module named 'llguidance'").
echo "install rc=$?"
# Wheels of packages found missing after that set was planned (bench/vllm_missing_modules.py names them).
if compgen -G "${CARRY_DIR:-/tmp/vllm_carry}/extra/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${CARRY_DIR:-/tmp/vllm_carry}"/extra/*.whl \
    >> "$OUT/install.log" 2>&1
  echo "extra install rc=$?"
fi
export PYTHONPATH="$SITE:$PWD"
python3 bench/vllm_missing_modules.py 2>&1 | grep -v "^ok" | tail -12
# vLLM's FlashInfer sampler would compile its kernels on first use; its own PyTorch sampler needs nothing.
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
# RUN_STEP=0 runs the tests alone.
if [ "${RUN_STEP:-1}" = 1 ]; then
  # The device's own memory use, sampled while the workload runs: PyTorch's counters include vLLM's pool
  # even while it sleeps, so they cannot show what the update really holds.
  nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/device-memory.csv" \
    2>/dev/null &
  SMI=$!
  timeout "${STEP_TIMEOUT:-330}" python3 bench/grpo_step.py --tokenizer "$TOK" --steps 4 --skip-trl --rollout vllm \
    --out "$OUT/vllm-step.json" > "$OUT/vllm-step.log" 2>&1
  echo "bench rc=$?"
  kill "$SMI" 2>/dev/null
  grep -E "^\|" "$OUT/vllm-step.log" || tail -40 "$OUT/vllm-step.log"
fi
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_vllm_rollout.py \
  tests/test_multi_turn_runs.py -k "vllm_in_the_workers or grpo_run_with_vllm or vllm_sync or vllm_plays_episodes" \
  > "$OUT/vllm-tests.log" 2>&1
echo "tests rc=$?"
tail -30 "$OUT/vllm-tests.log"
