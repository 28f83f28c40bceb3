"""A sweep's throughput on one machine: its trials packed by the planner against the same trials one after
another, and with early stopping against the full grid (docs/sweeps.md, "Measured").

    python bench/sweep_gpu.py packed  --out OUT/packed.json  [sweep options] [config overrides]
    python bench/sweep_gpu.py alone   --out OUT/alone.json   [sweep options] --only KEY=VALUE [overrides]
    python bench/sweep_gpu.py halving --out OUT/halving.json [sweep options] [config overrides]
    python bench/sweep_gpu.py report OUT/packed*.json OUT/alone.json OUT/halving*.json --out OUT/sweep.json

`packed` runs the grid with as many trials at once as the planner fits (or `--parallel N`); `halving` does the
same with successive-halving early stopping; `alone` runs trials one at a time. With `--only KEY=VALUE` a mode
runs only the grid points where KEY has VALUE: a part of the grid, when the whole does not fit in the time one
call has. Each writes the sweep's wall time (from the first trial's launch to the last one's end) and each
trial's settings, state, result, steps, run time, the planner's prediction, and where its start-up went
(launch to the first step's start, the first step, torch.compile's seconds over the trial). `report` adds up
the parts of the packed grid given to it (their walls, their trials, the best of all), predicts the sequential
time of that grid from the alone trials (each packed trial costs what an alone trial with the same value of
`--by` cost, on average), and compares each halving sweep given to it (one call each, of the same sweep) with the
full grid: its time's shares of the full grid's and its best setting, then each share's median over the calls.

Stopped by SIGINT (Ctrl-C, or `timeout -s INT` under a machine's time limit), a mode still writes its JSON, with
state `interrupted`, the steps each trial had done, and running trials' times up to then; `report` lists such
files under `interrupted`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.core.config import load_config  # noqa: E402
from backend.core.runs import read_metrics  # noqa: E402
from backend.services import launcher, sweeps  # noqa: E402

RECIPE = "configs/recipes/arithmetic.yaml"
GRID = ["actor_rollout_ref.actor.optim.lr=3e-6,1e-5,3e-5,1e-4", "actor_rollout_ref.rollout.n=4,8"]


def run(mode: str, args: argparse.Namespace) -> dict:
    params = sweeps.parse_grid(args.grid)
    if args.only:
        (only,) = sweeps.parse_grid([args.only])
        params = [only if p.key == only.key else p for p in params]
    spec = sweeps.SweepSpec(params=params, metric=args.metric, direction="max", steps=args.steps,
                            parallel=1 if mode == "alone" else args.parallel,
                            early_stopping="halving" if mode == "halving" else "off", min_steps=args.min_steps)
    base = load_config(args.config, args.overrides)
    runs_root = Path(args.runs_root)
    name = f"{mode}-{time.strftime('%H%M%S')}"
    folder = sweeps.create_sweep(base, spec, name=name, runs_root=runs_root)
    began = time.time()
    try:
        state = sweeps.run_sweep(folder, on_change=lambda s: print(progress(s), flush=True))
    except KeyboardInterrupt:
        # A time limit (`timeout -s INT`) cut the sweep: what ran until then is still worth its JSON. The trials
        # keep running in their own process groups, and `python -m backend sweep --resume` takes the sweep up.
        state = "interrupted"
    ended = time.time()
    wall = ended - began
    sweep = sweeps.read_sweep(folder)
    trials = []
    for t in sweep["trials"]:
        status = launcher.read_run(t.run)["status"] if t.run else {}
        start, end = status.get("created"), status.get("finished")
        if state == "interrupted" and start and not end:
            end = ended
        rows = read_metrics(t.run) if t.run else []
        trials.append({"number": t.number, "values": t.values, "state": t.state, "value": t.value, "step": t.step,
                       "reason": t.reason, "start": start, "end": end,
                       "run_s": round(end - start, 1) if start and end else None,
                       "steps_done": status.get("step"), "gpu_peak_reserved_gib": peak(rows),
                       **start_up(rows, start), **trial_attrs(folder, t.number)})
    best = sweep["best"]
    launched = [t for t in trials if t["run_s"] is not None]
    return {"mode": mode, "state": state, "sweep_wall_s": round(wall, 1),
            "first_launch_to_last_end_s": round(max(t["end"] for t in launched) - min(t["start"] for t in launched), 1)
            if launched else None, "config": args.config,
            "overrides": args.overrides, "grid": args.grid, "only": args.only, "steps": args.steps,
            "parallel": spec.parallel, "min_steps": args.min_steps,
            "metric": args.metric, "best": {"values": best.values, "value": best.value} if best else None,
            "trial_s_total": round(sum(t["run_s"] or 0 for t in trials), 1), "trials": trials}


def trial_attrs(folder: Path, number: int) -> dict:
    """What the sweep recorded when it placed the trial: its GPU, the planner's prediction, who was beside it, and
    on a Ray cluster the share of a GPU it asked Ray for."""
    study = sweeps._study(folder, sweeps.read_spec(folder))
    attrs = study.get_trials(deepcopy=False)[number].user_attrs
    return {k: attrs[k] for k in ("gpu", "predicted_gib", "beside", "gpu_share") if k in attrs}


def peak(rows: list[dict]) -> float | None:
    """The largest peak reserved memory the trial's worker reported in any step (`rows`: its metrics)."""
    peaks = [row["perf/max_memory_reserved_gb"] for row in rows if "perf/max_memory_reserved_gb" in row]
    return round(max(peaks), 2) if peaks else None


def start_up(rows: list[dict], created: float | None) -> dict:
    """Where a trial's time before training went (`rows`: its metrics): launch to the first step's start (the
    process, Ray, the workers, loading), the first step, and torch.compile's share of the trial (perf/compile_s
    summed), the floor no pruner saves."""
    if not rows or not created:
        return {}
    first = rows[0]
    return {"startup_s": round(first["time"] - first["timing_s/step"] - created, 1),
            "first_step_s": round(first["timing_s/step"], 1),
            "compile_s": round(sum(r.get("perf/compile_s", 0.0) for r in rows), 1)}


def progress(sweep: dict) -> str:
    counts: dict[str, int] = {}
    for t in sweep["trials"]:
        counts[t.state] = counts.get(t.state, 0) + 1
    return f"[{time.strftime('%H:%M:%S')}] " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def report(paths: list[str], by: str) -> dict:
    results: dict[str, list[dict]] = {}
    interrupted = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        results.setdefault(result["mode"], []).append(result)
        if result["state"] == "interrupted":
            interrupted.append(path)
    packed = combined(results["packed"])
    out: dict = {"packed_parts": len(results["packed"]), "packed_wall_s": packed["sweep_wall_s"],
                 "packed_busy_s": packed["busy_s"],
                 "packed_trial_s": packed["trial_s_total"], "packed_best": packed["best"],
                 "oom_trials": [t["number"] for t in packed["trials"] if "out of memory" in (t["reason"] or "")],
                 # A cut sweep's times are a lower bound of what it would have taken, and its best may not be.
                 "interrupted": interrupted}
    if "alone" in results:
        alone = combined(results["alone"])
        cost: dict[str, list[float]] = {}
        for t in alone["trials"]:
            cost.setdefault(str(t["values"][by]), []).append(t["run_s"])
        predicted = sum(statistics.mean(cost[str(t["values"][by])]) for t in packed["trials"])
        out.update(alone_run_s=cost, sequential_predicted_s=round(predicted, 1),
                   alone_sweep_wall_s=alone["sweep_wall_s"],
                   throughput_ratio=round(predicted / packed["sweep_wall_s"], 2))
    if "halving" in results:
        # A halving sweep cannot be cut into parts (its pruner compares the whole grid): each file is one call of
        # the same sweep, each compared with the full grid, then the shares as the median over the calls.
        calls = [against_full(halving, packed) for halving in results["halving"]]
        out.update(halving=calls, same_best=all(c["same_best"] for c in calls),
                   **{f"halving_{share}": spread([c[share] for c in calls if c[share] is not None])
                      for share in SHARES})
    return out


SHARES = ("wall_share", "busy_share", "trial_s_share")


def against_full(halving: dict, packed: dict) -> dict:
    """One halving sweep's times as shares of the full grid's, what it stopped, and whether it found the full
    grid's best setting."""
    one = combined([halving])
    return {"wall_s": one["sweep_wall_s"], "busy_s": one["busy_s"], "trial_s": one["trial_s_total"],
            "best": one["best"],
            "pruned": {t["number"]: t["step"] for t in one["trials"] if t["state"] == "pruned"},
            "wall_share": round(one["sweep_wall_s"] / packed["sweep_wall_s"], 3),
            "busy_share": round(one["busy_s"] / packed["busy_s"], 3) if one["busy_s"] and packed["busy_s"] else None,
            "trial_s_share": round(one["trial_s_total"] / packed["trial_s_total"], 3),
            "same_best": (one["best"] or {}).get("values") == (packed["best"] or {}).get("values")}


def spread(values: list[float]) -> dict | None:
    """The median of the calls' values and their range."""
    return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values),
            "calls": len(values)} if values else None


def combined(parts: list[dict]) -> dict:
    """Parts of one grid run one after another, as one sweep: walls, busy spans (the first trial's launch to the
    last one's end, without the sweep's own start such as converting the model) and trial times add up, the best is
    the best trial of any part (ties go to the first part's)."""
    trials = [t for part in parts for t in part["trials"]]
    done = [t for t in trials if t["state"] == "complete" and t["value"] is not None]
    best = max(done, key=lambda t: t["value"]) if done else None
    spans = [p.get("first_launch_to_last_end_s") for p in parts]
    return {"sweep_wall_s": round(sum(p["sweep_wall_s"] for p in parts), 1),
            "busy_s": round(sum(spans), 1) if None not in spans else None,
            "trial_s_total": round(sum(p["trial_s_total"] for p in parts), 1), "trials": trials,
            "best": {"values": best["values"], "value": best["value"]} if best else None}


def table(result: dict) -> str:
    keys = sorted({k for t in result["trials"] for k in t["values"]})
    head = ["#", *(k.rsplit(".", 1)[-1] for k in keys), "state", "step", result["metric"], "run s", "start-up s",
            "first step s", "compile s", "gpu", "predicted GiB", "peak GiB"]
    rows = [[t["number"], *(t["values"].get(k) for k in keys), t["state"], t["step"],
             None if t["value"] is None else round(t["value"], 3), t["run_s"], t.get("startup_s"),
             t.get("first_step_s"), t.get("compile_s"), t.get("gpu"), t.get("predicted_gib"),
             t["gpu_peak_reserved_gib"]] for t in result["trials"]]
    lines = [" | ".join(map(str, head))] + [" | ".join("-" if v is None else str(v) for v in r) for r in rows]
    return "\n".join(lines) + f"\nsweep {result['state']} in {result['sweep_wall_s']} s; trials' run time summed " \
                              f"{result['trial_s_total']} s; best {result['best']}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["packed", "alone", "halving", "report"])
    p.add_argument("rest", nargs="*", help="config overrides (report: the JSON files)")
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=RECIPE)
    p.add_argument("--grid", nargs="+", default=GRID)
    p.add_argument("--only", help="only the grid points where KEY=VALUE")
    p.add_argument("--parallel", type=int, default=0, help="packed, halving: trials at once (0: as many as fit)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--metric", default="val/accuracy")
    p.add_argument("--min-steps", type=int, default=10, help="halving: the first rung's step")
    p.add_argument("--by", default="actor_rollout_ref.rollout.n", help="report: the key an alone trial's cost follows")
    p.add_argument("--runs-root", default="/tmp/sweep-runs")
    args = p.parse_intermixed_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.mode == "report":
        result = report(args.rest, args.by)
        print(json.dumps(result, indent=1))
    else:
        args.overrides = args.rest
        result = run(args.mode, args)
        print(table(result))
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
