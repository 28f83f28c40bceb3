#!/usr/bin/env bash
# GPU runs behind docs/results.md and docs/algorithms.md: SmolLM2-135M-Instruct trained by the project's own
# commands. Run directories go to /tmp/learning-runs; their small files (metrics, status, config, report,
# plots, logs, rollouts) are copied to OUT, the weights are not.
#   bash bench/learning_gpu.sh compare <gsm8k train.jsonl> <OUT> [seconds]
#       six runs at once on the one GPU, stopped after [seconds] (default 500): the arithmetic recipe with
#       GRPO (at its learning rate and at 1e-5), PPO (critic + GAE), RLOO and DAPO, and the GSM8K recipe.
#   bash bench/learning_gpu.sh solo <OUT>
#       the arithmetic recipe alone (its time is the recipe's time), the export loaded by plain
#       transformers, then the LoRA memory record.
# EXTRA (optional): overrides added to every run, e.g. for a dry run of the script on the CPU:
#   EXTRA="actor_rollout_ref.model.path=tiny-qwen3 trainer.device=cpu" bash bench/learning_gpu.sh compare ...
set -uo pipefail
MODE=$1
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
RUNS=${RUNS:-/tmp/learning-runs}
mkdir -p "$RUNS"

collect() {  # copy each run's small files to $1/runs/<name>
  for run in "$RUNS"/*/; do
    name=$(basename "$run")
    mkdir -p "$1/runs/$name"
    for item in metrics.jsonl status.json config.yaml recipe.json plots logs rollouts; do
      [ -e "$run/$item" ] && cp -r "$run/$item" "$1/runs/$name/"
    done
  done
}

recipe() {  # recipe NAME RUN [overrides...]: one run in the background, its console in RUNS/NAME.log
  local name=$1 run=$2
  shift 2
  python3 -m backend recipe "$name" --run-dir "$RUNS/$run" --quiet "$@" "${EXTRA_ARGS[@]}" > "$RUNS/$run.log" 2>&1 &
}

if [ "$MODE" = compare ]; then
  GSM8K=$2 OUT=$3 LIMIT=${4:-500}
  NO_EXPORT=(trainer.export_at_end=false trainer.total_training_steps=400)
  recipe arithmetic grpo "${NO_EXPORT[@]}"
  recipe arithmetic grpo-lr1e-5 actor_rollout_ref.actor.optim.lr=1e-5 "${NO_EXPORT[@]}"
  recipe arithmetic ppo algorithm.adv_estimator=gae "${NO_EXPORT[@]}"
  recipe arithmetic rloo algorithm.adv_estimator=rloo "${NO_EXPORT[@]}"
  # DAPO as its paper runs it: clip-higher, token-mean loss (the recipe's), dynamic sampling, overlong
  # shaping over the last 64 tokens, no KL term.
  recipe arithmetic dapo actor_rollout_ref.actor.clip_ratio_high=0.28 algorithm.filter_groups.enable=true \
    reward.overlong_buffer.enable=true reward.overlong_buffer.len=64 actor_rollout_ref.actor.use_kl_loss=false \
    "${NO_EXPORT[@]}"
  recipe gsm8k gsm8k --gsm8k-jsonl "$GSM8K" --data-dir /tmp/learning-data "${NO_EXPORT[@]}"
  sleep $((LIMIT / 2))
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  sleep $((LIMIT - LIMIT / 2))
  # SIGTERM: each run stops between steps and records `stopped`; metrics up to there are whole.
  pkill -TERM -f "backend recipe" ; sleep 15
  collect "$OUT"
  cp "$RUNS"/*.log "$OUT/runs/" 2>/dev/null
elif [ "$MODE" = solo ]; then
  OUT=$2
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
  collect "$OUT"
  cp "$RUNS"/*.log "$OUT/runs/"
  python3 bench/lora_memory.py --tokenizer .gpu/smollm2-tokenizer --ranks 16 --out "$OUT/lora-memory.json" \
    > "$OUT/lora-memory.log" 2>&1
  echo "lora rc=$?"
else
  echo "mode must be compare or solo" >&2
  exit 2
fi
