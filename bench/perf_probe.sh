#!/usr/bin/env bash
# One call on the GPU machine that measures our engine alone, phase by phase, before a full comparison
# with TRL (bench/perf_gpu.sh): the decode-attention kernel against PyTorch's attention (attention), the
# vocabulary pass's kernel and the head's gradient sum against fp32 (vocab),
# generation, the update and the reference pass under the profiler, with the same passes on a plain model
# without FSDP (profile), and the step (step: bench/grpo_step.py --skip-trl). The profile uses the
# benchmark's settings (micro-batches of 64, reference micro-batches of 128, activation budget 0.7).
#   bash bench/perf_probe.sh <tokenizer folder> <output folder> [attention] [vocab] [profile] [step]   (default: all)
set -uo pipefail
TOK=$1
OUT=$2
shift 2
PARTS=${*:-attention vocab profile step}
mkdir -p "$OUT"
if [[ " $PARTS " == *" attention "* ]]; then
  python3 bench/decode_attention_check.py --out "$OUT/decode-attention.json" > "$OUT/decode-attention.log" 2>&1
  echo "decode_attention_check rc=$?"
fi
if [[ " $PARTS " == *" vocab "* ]]; then
  python3 bench/vocab_pass_check.py --out "$OUT/vocab-pass.json" > "$OUT/vocab-pass.log" 2>&1
  echo "vocab_pass_check rc=$?"
fi
if [[ " $PARTS " == *" profile "* ]]; then
  WL=$(mktemp -d)
  python3 bench/grpo_step.py --tokenizer "$TOK" --write-workload "$WL" > /dev/null 2>&1
  python3 bench/profile_update.py configs/default.yaml "actor_rollout_ref.model.path=$WL/model" \
    "data.train_files=[$WL/prompts.parquet]" data.train_batch_size=64 actor_rollout_ref.rollout.n=8 \
    data.max_prompt_length=16 data.max_response_length=256 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=128 \
    actor_rollout_ref.actor.activation_memory_budget=0.7 actor_rollout_ref.rollout.generation_batch_size=512 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.04 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    "custom_reward_function.path=bench/bench_reward.py" custom_reward_function.name=distinct_words \
    --generate --plain > "$OUT/profile.log" 2>&1
  echo "profile_update rc=$?"
fi
if [[ " $PARTS " == *" step "* ]]; then
  python3 bench/grpo_step.py --tokenizer "$TOK" --steps 4 --skip-trl --out "$OUT/grpo-step.json" > "$OUT/grpo-step.log" 2>&1
  echo "grpo_step rc=$?"
fi
