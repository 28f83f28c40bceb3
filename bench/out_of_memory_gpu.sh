#!/usr/bin/env bash
# A config made too large for the GPU, trained for real: the fixed workload (bench/grpo_step.py's random
# Qwen3-0.6B architecture, 64 prompts x 8 x 256 tokens) with the whole batch in one update micro-batch and
# every activation kept. The planner says beforehand that it does not fit; the run fails with the worker's
# WorkerOutOfMemory naming the phase, and status.json's diagnosis holds the planner's view and what would fit.
#   bash bench/out_of_memory_gpu.sh <tokenizer folder> <OUT>
set -uo pipefail
TOK=$(realpath "$1")
OUT=$(realpath -m "$2")
shift 2
WORK=${WORK:-/tmp/oom-workload}
mkdir -p "$OUT"
[ -d "$WORK/model" ] || python3 bench/grpo_step.py --tokenizer "$TOK" --write-workload "$WORK" > "$OUT/workload.log" 2>&1
ARGS=(configs/default.yaml "data.train_files=[$WORK/prompts.parquet]" "data.val_files=[]"
      "actor_rollout_ref.model.path=$WORK/model" data.max_prompt_length=16 actor_rollout_ref.rollout.ignore_eos=true
      custom_reward_function.path=bench/bench_reward.py custom_reward_function.name=distinct_words
      data.train_batch_size=64 data.max_response_length=256 actor_rollout_ref.rollout.n=8
      actor_rollout_ref.rollout.generation_batch_size=512 actor_rollout_ref.actor.ppo_mini_batch_size=64
      actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=512 actor_rollout_ref.actor.activation_memory_budget=1.0
      trainer.device=cuda trainer.total_training_steps=2 trainer.val_before_train=false trainer.test_freq=0
      trainer.export_at_end=false "trainer.logger=[console]" "$@")
python3 -m backend plan "${ARGS[@]}" > "$OUT/plan.txt" 2>&1
echo "plan rc=$? (1: does not fit)"
grep -E "^(update|verdict)" "$OUT/plan.txt"
began=$(date +%s)
timeout "${TRAIN_TIMEOUT:-300}" python3 -m backend train "${ARGS[@]}" --run-dir "$OUT/run" --quiet > "$OUT/train.log" 2>&1
echo "train rc=$? after $(( $(date +%s) - began )) s"
grep -E "WorkerOutOfMemory|would fit|planner" "$OUT/train.log" | head -12
python3 -c "import json, sys; s = json.load(open(sys.argv[1])); print(s['state']); print(json.dumps(s.get('diagnosis'), indent=1))" \
  "$OUT/run/status.json"
