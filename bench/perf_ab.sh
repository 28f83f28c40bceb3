#!/usr/bin/env bash
# Before and after a change, in one call on the GPU machine: our step on the workload
# (bench/grpo_step.py --skip-trl) from an earlier tree and from this one, alternating, then this tree at
# micro-batches of 64 and this tree's update and generation under the profiler (bench/profile_update.py).
# Calls differ by up to 50% in update time, so only runs of the same call compare.
#   git archive <commit> | tar -x -C .base      # the earlier tree, carried as an ignored folder
#   bash bench/perf_ab.sh <tokenizer folder> <earlier tree> <output folder>
set -uo pipefail
TOK=$(realpath "$1")
BASE=$(realpath "$2")
OUT=$(realpath -m "$3")
HERE=$PWD
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
step() {  # step <tree> <name> [grpo_step args]
  local tree=$1 name=$2
  shift 2
  # Ray workers import backend from the driver's working directory, so each tree runs from its own folder.
  (cd "$tree" && PYTHONPATH="$SITE:$tree" python3 bench/grpo_step.py --tokenizer "$TOK" --steps 4 --skip-trl \
    --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1)
  local rc=$?
  echo "$name rc=$rc $(python3 -c "import json,sys; t=json.load(open(sys.argv[1]))[-1]['table']; print({k: v[0] for k, v in t.items()})" "$OUT/$name.json" 2>&1 | tail -1)"
}
step "$BASE" base-1
step "$HERE" new-1
step "$BASE" base-2
step "$HERE" new-2
step "$HERE" new-micro64 --micro-batch 64
WL=$(mktemp -d)
PYTHONPATH="$SITE:$HERE" python3 bench/grpo_step.py --tokenizer "$TOK" --write-workload "$WL" > /dev/null 2>&1
PYTHONPATH="$SITE:$HERE" python3 bench/profile_update.py configs/default.yaml "actor_rollout_ref.model.path=$WL/model" \
  "data.train_files=[$WL/prompts.parquet]" data.train_batch_size=64 actor_rollout_ref.rollout.n=8 \
  data.max_prompt_length=16 data.max_response_length=256 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64 \
  actor_rollout_ref.rollout.generation_batch_size=512 actor_rollout_ref.actor.kl_loss_coef=0.04 \
  "custom_reward_function.path=bench/bench_reward.py" custom_reward_function.name=distinct_words \
  --generate > "$OUT/profile.log" 2>&1
echo "profile_update rc=$?"
