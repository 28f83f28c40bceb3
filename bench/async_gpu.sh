#!/usr/bin/env bash
# Rollout and training at the same time on two GPUs (trainer.rollout_mode=async, docs/cluster.md), in one call:
#   fixed   the performance workload (bench/grpo_step.py, ours only): synchronous colocated on 1 GPU, on 2 GPUs, and
#           async on 1 actor GPU + 1 rollout GPU; OUT/fixed.json holds the three rows and OUT/fixed-ratio.json the
#           async step over each synchronous one.
#   recipe  the arithmetic recipe, STEPS steps with its validation every 10: synchronous on 1 GPU against async on
#           1 + 1; OUT/recipe.json holds each one's wall time and held-out accuracy curve.
#
#   bash bench/async_gpu.sh <tokenizer> <OUT> [fixed] [recipe] [overrides...]
#
# On the CPU (two gloo processes; the venv's python first on PATH), a dry run of each part:
#   SMALL=1 FIXED_STEPS=3 bash bench/async_gpu.sh <tokenizer> /tmp/out fixed trainer.device=cpu \
#     actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
#   STEPS=2 bash bench/async_gpu.sh <tokenizer> /tmp/out recipe trainer.device=cpu actor_rollout_ref.model.path=tiny-qwen3 \
#     data.train_batch_size=2 data.max_response_length=8 data.val_max_samples=4 actor_rollout_ref.actor.ppo_mini_batch_size=2
set -uo pipefail
TOK=$1
OUT=$2
shift 2
PARTS=()
while [ $# -gt 0 ] && { [ "$1" = fixed ] || [ "$1" = recipe ]; }; do PARTS+=("$1"); shift; done
[ ${#PARTS[@]} -eq 0 ] && PARTS=(fixed recipe)
STEPS=${STEPS:-60}
SMALL=${SMALL:+--small}
mkdir -p "$OUT"
for part in "${PARTS[@]}"; do
  if [ "$part" = fixed ]; then
    rm -f "$OUT/fixed.json"
    FIXED=(python3 bench/grpo_step.py --tokenizer "$TOK" --steps "${FIXED_STEPS:-6}" --skip-trl $SMALL --out "$OUT/fixed.json")
    "${FIXED[@]}" "$@" > "$OUT/fixed-1gpu.log" 2>&1
    echo "synchronous, 1 GPU rc=$?"
    "${FIXED[@]}" trainer.n_gpus_per_node=2 "$@" > "$OUT/fixed-2gpu.log" 2>&1
    echo "synchronous, 2 GPUs rc=$?"
    "${FIXED[@]}" trainer.rollout_mode=async "$@" > "$OUT/fixed-async.log" 2>&1
    echo "async, 1 + 1 GPUs rc=$?"
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [r for r in json.loads((out / "fixed.json").read_text())]
step = {("async" if "trainer.rollout_mode=async" in r["ours"]["overrides"] else f"sync x{r['ours']['workers']}"):
        r["ours"] for r in rows}
ratio = {f"async / {k}": round(step["async"]["median_step_s"] / v["median_step_s"], 3)
         for k, v in step.items() if k != "async"}
summary = {name: {k: r.get(k) for k in ("median_step_s", "median_gen_s", "median_ref_s", "median_update_actor_s",
                                        "median_weight_push_s", "step_times_s", "rollout/staleness",
                                        "rollout/is_weight_mean", "rollout/is_weight_max", "rollout/is_clipfrac",
                                        "rollout/log_prob_diff_mean")} for name, r in step.items()}
(out / "fixed-ratio.json").write_text(json.dumps({"steps": summary, "ratios": ratio}, indent=1))
print(json.dumps(ratio))
PY
  else
    for mode in colocated async; do
      start=$(date +%s)
      python3 -m backend recipe arithmetic --quiet trainer.total_training_steps="$STEPS" trainer.export_at_end=false \
        trainer.save_freq=0 trainer.rollout_mode=$mode "$@" --run-dir "$OUT/recipe-$mode" > "$OUT/recipe-$mode.log" 2>&1
      echo "recipe $mode rc=$? in $(( $(date +%s) - start )) s"
      echo $(( $(date +%s) - start )) > "$OUT/recipe-$mode.wall"
    done
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
result = {}
for mode in ("colocated", "async"):
    run = out / f"recipe-{mode}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    result[mode] = {"wall_s": int((out / f"recipe-{mode}.wall").read_text()), "val_accuracy": val,
                    "median_step_s": sorted(r["timing_s/step"] for r in rows if "timing_s/step" in r)[len(rows) // 2],
                    "staleness": sorted({r.get("rollout/staleness") for r in rows} - {None})}
(out / "recipe.json").write_text(json.dumps(result, indent=1))
print(json.dumps({m: (r["wall_s"], r["val_accuracy"]) for m, r in result.items()}))
PY
  fi
done
