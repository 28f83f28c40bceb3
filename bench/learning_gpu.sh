#!/usr/bin/env bash
# GPU runs behind docs/results.md and docs/algorithms.md: SmolLM2-135M-Instruct trained by the project's own
# `python -m backend recipe` on the one GPU. Run directories go to $RUNS (default /tmp/learning-runs); their
# small files (metrics, status, config, report, plots, logs) are packed into OUT/<mode>-runs.tgz, one file
# because the device tool brings back only a few files; weights and rollouts stay behind.
#
#   bash bench/learning_gpu.sh runs <OUT> <seconds> <run>...
#       the named runs at once, each stopped (SIGTERM: it ends between steps as `stopped`) after <seconds>:
#       grpo, grpo-lr5e-6, rloo, ppo, dapo (the arithmetic recipe with that algorithm, all else equal) and
#       gsm8k (the GSM8K recipe; set GSM8K to its train.jsonl). Three at once fit in an H200's memory;
#       six did not (two failed out of memory).
#   bash bench/learning_gpu.sh solo <OUT>
#       the arithmetic recipe alone, whole (its time is the recipe's time), its export loaded by plain
#       transformers, then the LoRA memory record.
#
# EXTRA (optional): overrides added to every run, e.g. for a dry run of the script on the CPU:
#   EXTRA="actor_rollout_ref.model.path=tiny-qwen3 trainer.device=cpu" bash bench/learning_gpu.sh runs ...
set -uo pipefail
MODE=$1
OUT=$2
RUNS=${RUNS:-/tmp/learning-runs}
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
mkdir -p "$RUNS" "$OUT"

pack() {
  (cd "$RUNS" && tar czf "$OUT/$MODE-runs.tgz" --exclude='*/checkpoints' --exclude='*/export' --exclude='*/rollouts' .)
}

PIDS=()
start() {  # start RUN RECIPE [overrides...]: one run in the background, its console in $RUNS/RUN.log
  local run=$1 recipe=$2
  shift 2
  python3 -m backend recipe "$recipe" --run-dir "$RUNS/$run" --quiet "$@" "${EXTRA_ARGS[@]}" \
    > "$RUNS/$run.log" 2>&1 &
  PIDS+=($!)
}

if [ "$MODE" = runs ]; then
  LIMIT=$3
  shift 3
  OPEN=(trainer.export_at_end=false trainer.total_training_steps=1000)
  for run in "$@"; do
    case $run in
      grpo) start grpo arithmetic "${OPEN[@]}" ;;
      grpo-lr5e-6) start grpo-lr5e-6 arithmetic actor_rollout_ref.actor.optim.lr=5e-6 "${OPEN[@]}" ;;
      rloo) start rloo arithmetic algorithm.adv_estimator=rloo "${OPEN[@]}" ;;
      ppo) start ppo arithmetic algorithm.adv_estimator=gae "${OPEN[@]}" ;;
      # DAPO as its paper runs it: clip-higher, token-mean loss (the recipe's), dynamic sampling, overlong
      # shaping over the last 64 tokens, no KL term.
      dapo) start dapo arithmetic actor_rollout_ref.actor.clip_ratio_high=0.28 algorithm.filter_groups.enable=true \
              reward.overlong_buffer.enable=true reward.overlong_buffer.len=64 \
              actor_rollout_ref.actor.use_kl_loss=false "${OPEN[@]}" ;;
      gsm8k) start gsm8k gsm8k --gsm8k-jsonl "${GSM8K:?set GSM8K to GSM8K\'s train.jsonl}" \
               --data-dir "$RUNS/data" "${OPEN[@]}" ;;
      *) echo "unknown run $run" >&2; exit 2 ;;
    esac
  done
  sleep $((LIMIT / 2))
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  sleep $((LIMIT - LIMIT / 2))
  kill -TERM "${PIDS[@]}"
  wait
  pack
elif [ "$MODE" = solo ]; then
  python3 -m backend recipe arithmetic --run-dir "$RUNS/arithmetic" --quiet > "$RUNS/arithmetic.log" 2>&1
  echo "recipe rc=$?"
  python3 - "$RUNS/arithmetic/export" > "$OUT/export-check.txt" 2>&1 <<'EOF'
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = sys.argv[1]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
messages = [{"role": "user", "content": "Tom has 23 apples. He buys 9 more. How many apples does Tom have now? "
                                        "Give the final number after '####'."}]
ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=64, do_sample=False)
print("loaded by plain transformers:", type(model).__name__, sum(p.numel() for p in model.parameters()), "parameters")
print("answer:", repr(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)))
EOF
  echo "export check rc=$?"
  pack
  python3 bench/lora_memory.py --tokenizer .gpu/smollm2-tokenizer --ranks 16 --out "$OUT/lora-memory.json" \
    > "$OUT/lora-memory.log" 2>&1
  echo "lora rc=$?"
else
  echo "mode must be runs or solo" >&2
  exit 2
fi
