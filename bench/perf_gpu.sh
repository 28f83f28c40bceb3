#!/usr/bin/env bash
# One call on the GPU machine for the performance workload: ours vs TRL on the workload (bench/grpo_step.py),
# our first step vs a plain fp32 step (bench/reference_step.py), and the planner against measured peaks on
# three configs (bench/plan_check.py). Each part runs even when an earlier one failed.
#   bash bench/perf_gpu.sh <tokenizer folder> <output folder>
set -uo pipefail
TOK=$1
OUT=$2
mkdir -p "$OUT"
python3 bench/grpo_step.py --tokenizer "$TOK" --steps 4 --out "$OUT/grpo-step.json" > "$OUT/grpo-step.log" 2>&1
echo "grpo_step rc=$?"
WL=$(mktemp -d)
python3 bench/grpo_step.py --tokenizer "$TOK" --write-workload "$WL" > /dev/null 2>&1
python3 bench/reference_step.py configs/default.yaml "actor_rollout_ref.model.path=$WL/model" \
  "data.train_files=[$WL/prompts.parquet]" data.train_batch_size=16 actor_rollout_ref.rollout.n=8 \
  data.max_prompt_length=16 data.max_response_length=256 actor_rollout_ref.actor.ppo_mini_batch_size=16 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.kl_loss_coef=0.04 \
  "custom_reward_function.path=bench/bench_reward.py" custom_reward_function.name=distinct_words \
  --json "$OUT/reference-step.json" > "$OUT/reference-step.log" 2>&1
echo "reference_step rc=$?"
python3 bench/plan_check.py --tokenizer "$TOK" --out "$OUT/plan.json" > "$OUT/plan.log" 2>&1
echo "plan_check rc=$?"
