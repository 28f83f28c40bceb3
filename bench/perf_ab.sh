#!/usr/bin/env bash
# Before and after a change, in one call on the GPU machine: our step on the workload
# (bench/grpo_step.py --skip-trl) from an earlier tree and from this one. Calls differ by up to 50% in
# update time, so only runs of the same call compare.
#   git archive <commit> | tar -x -C .base      # the earlier tree, carried as an ignored folder
#   bash bench/perf_ab.sh <tokenizer folder> <earlier tree> <output folder> [run ...]
# A run is "<name> <base|new|folder> [grpo_step arguments]", one quoted argument each, in the order given
# (a folder: a third tree, carried as the earlier one is); with none: base and this tree alternately,
# twice each.
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
if [ $# -le 3 ]; then
  set -- "$@" "base-1 base" "new-1 new" "base-2 base" "new-2 new"
fi
shift 3
for run in "$@"; do
  read -r name which args <<< "$run"
  tree=$HERE
  [ "$which" = base ] && tree=$BASE
  [ "$which" != base ] && [ "$which" != new ] && tree=$(realpath "$which")
  # shellcheck disable=SC2086  # the run's arguments split on spaces by design
  step "$tree" "$name" $args
done
