#!/usr/bin/env bash
# One call on the GPU machine: a sweep on a Ray cluster (`ray start --head` here, with its dashboard, which
# takes the trials as Ray jobs) packs its trials onto the cluster's GPU by Ray's fractional GPUs: the sweep reads
# the GPU's memory on its node, each trial asks for the planner's prediction as a share of it (docs/sweeps.md).
#   bash bench/cluster_gpu.sh OUT [sweep_gpu.py options and overrides]
set -uo pipefail
OUT=$(realpath -m "$1")
shift
mkdir -p "$OUT"
PORT=${PORT:-6390}
export RAY_AUTH_MODE=disabled
python3 -m ray.scripts.scripts start --head --port="$PORT" --include-dashboard=true --disable-usage-stats \
  > "$OUT/head.log" 2>&1 || { cat "$OUT/head.log"; exit 1; }
python3 -c "from backend.services import sweeps; print(sweeps._cluster_gpus('127.0.0.1:$PORT'))" | tee "$OUT/gpus.txt"
python3 bench/sweep_gpu.py packed --out "$OUT/cluster.json" "trainer.ray_address=127.0.0.1:$PORT" "$@" \
  > "$OUT/cluster.log" 2>&1
echo "sweep rc=$?"
tail -3 "$OUT/cluster.log"
python3 - "$OUT/cluster.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{r['state']}: first launch to last end {r['first_launch_to_last_end_s']} s, best {r['best']}")
t0 = min(t["start"] for t in r["trials"] if t["start"])
for t in r["trials"]:
    print(t["number"], t["values"], t["state"], t.get("gpu_share"), t.get("predicted_gib"), t["gpu_peak_reserved_gib"],
          round(t["start"] - t0, 1) if t["start"] else None, round(t["end"] - t0, 1) if t["end"] else None)
PY
python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
