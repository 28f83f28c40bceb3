#!/usr/bin/env bash
# One call on the GPU machine: our engine with 1 worker and (when there are two GPUs) 2 workers on a
# random Qwen3-0.6B-architecture model, then the tiny model in fp32 on 1 and 2 GPUs (the same batches,
# so the first step's numbers must agree closely). Results go to $1 (a JSON file).
#   bash bench/distributed_gpu.sh bench/results/<date>-gpu-distributed.json <tokenizer folder>
set -euo pipefail
OUT=$1
TOK=$2
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
SHAPE="data.train_batch_size=64 actor_rollout_ref.rollout.n=8 data.max_response_length=256
  actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64
  actor_rollout_ref.rollout.generation_batch_size=512 actor_rollout_ref.actor.optim.lr=1e-6"
TINY="actor_rollout_ref.model.path=tiny-qwen3 data.train_batch_size=8 actor_rollout_ref.rollout.n=4
  data.max_response_length=32 actor_rollout_ref.actor.ppo_mini_batch_size=4
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.fsdp_config.param_dtype=fp32
  actor_rollout_ref.actor.optim.lr=1e-4"
for n in $(seq 1 "$GPUS"); do
  python3 bench/engine_step.py configs/default.yaml --steps 3 --random-model qwen3-0.6b --tokenizer "$TOK" \
    --label "qwen3-0.6b-random x$n gpu" --out "$OUT" $SHAPE trainer.n_gpus_per_node=$n trainer.device=cuda
done
for n in $(seq 1 "$GPUS"); do
  python3 bench/engine_step.py configs/default.yaml --steps 2 --label "tiny-qwen3 fp32 x$n gpu" --out "$OUT" \
    $TINY trainer.n_gpus_per_node=$n trainer.device=cuda
done
