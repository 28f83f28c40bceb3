#!/usr/bin/env bash
# Before and after a change, in one call on the GPU machine: our step on the workload
# (bench/grpo_step.py --skip-trl) from an earlier tree and from this one, alternating, then this tree at
# micro-batches of 64, with PyTorch's default allocator and with expandable segments (bench/perf_probe.sh
# profiles). Calls differ by up to 50% in update time, so only runs of the same call compare.
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
step "$HERE" new-micro64 --micro-batch 64
step "$BASE" base-2
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step "$HERE" new-micro64-expandable --micro-batch 64
