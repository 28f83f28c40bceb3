"""Where a launched run's time before its training steps goes, with one run alone and with several started at
once (as a sweep starts its trials): each stage the run's status line shows (starting Ray, the workers and
models, the first step's phases) and torch.compile's seconds in each step. A sweep's stopped trial pays this
start-up whatever the pruner decides, so it is the floor of early stopping's saving (docs/sweeps.md).

    python bench/trial_startup.py --at-once 1 4 --steps 3 --out OUT/startup.json [config overrides]

Stages are read by polling each run's status.json (every 0.1 s), so a stage shorter than that may be missed;
a stage's name is its status line with numbers as N ("generating token 12/256 ..." is "generating token N/N ...").
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.core.config import load_config  # noqa: E402
from backend.core.runs import read_metrics, read_status  # noqa: E402
from backend.services import launcher  # noqa: E402

RECIPE = "configs/recipes/arithmetic.yaml"


def steps_only(steps: int, overrides: list[str]) -> list[str]:
    """Config overrides for a run of `steps` training steps and nothing else (no validation, checkpoint or export),
    then the user's."""
    return [f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=0",
            "trainer.export_at_end=false", "trainer.save_freq=0", *overrides]


def watch(runs: list[Path], poll_s: float = 0.1) -> list[list[tuple[str, float]]]:
    """Each run's stages in order, with the time each was first seen, until every run has ended."""
    seen: list[list[tuple[str, float]]] = [[] for _ in runs]
    while True:
        active = False
        for run, stages in zip(runs, seen, strict=True):
            status = read_status(run) or {}
            name = re.sub(r"\d+", "N", status.get("stage") or "")
            if name and (not stages or stages[-1][0] != name):
                stages.append((name, status.get("stage_started") or time.time()))
            active |= status.get("state") in launcher.ACTIVE
        if not active:
            return seen
        time.sleep(poll_s)


def measure(cfg_path: str, overrides: list[str], at_once: int, runs_root: Path) -> dict:
    cfg = load_config(cfg_path, overrides)
    runs = [launcher.launch(cfg, name=f"startup-{at_once}-{i}", runs_root=runs_root) for i in range(at_once)]
    stages = watch(runs)
    out = []
    for run, seen in zip(runs, stages, strict=True):
        status = read_status(run) or {}
        created, finished = status["created"], status.get("finished") or time.time()
        rows = read_metrics(run)
        first_step_start = rows[0]["time"] - rows[0]["timing_s/step"] if rows else finished
        spans: dict[str, float] = {}
        for (name, t), (_, t_next) in zip(seen, [*seen[1:], ("end", finished)], strict=True):
            if t < first_step_start:
                spans[name] = round(spans.get(name, 0.0) + t_next - t, 2)
        out.append({"run": run.name, "state": status.get("state"), "error": status.get("error"),
                    "launch_to_first_step_s": round(first_step_start - created, 2), "stages_s": spans,
                    "steps": [{k: round(v, 2) for k, v in r.items()
                               if k in ("step", "perf/compile_s", "perf/compiled_graphs") or k.startswith("timing_s/")}
                              for r in rows],
                    "first_step_timeline": [(n, round(t - first_step_start, 2)) for n, t in seen
                                            if first_step_start <= t and rows and t < rows[0]["time"]]})
    return {"at_once": at_once, "runs": out}


def table(result: dict) -> str:
    lines = [f"{result['at_once']} at once"]
    for r in result["runs"]:
        steps = r["steps"]
        first = steps[0] if steps else {}
        later = [s["timing_s/step"] for s in steps[1:]]
        lines.append(f"  {r['run']}: {r['state']}, launch to first step {r['launch_to_first_step_s']} s, "
                     f"first step {first.get('timing_s/step')} s (compile {first.get('perf/compile_s')} s), "
                     f"later steps {statistics.median(later) if later else '-'} s median")
        lines += [f"    {name}: {s} s" for name, s in r["stages_s"].items()]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--config", default=RECIPE)
    p.add_argument("--at-once", type=int, nargs="+", default=[1, 4], help="runs started together, per round")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--runs-root", default="/tmp/startup-runs")
    p.add_argument("--out", required=True)
    args = p.parse_intermixed_args()
    overrides = steps_only(args.steps, args.overrides)
    results = []
    for n in args.at_once:
        results.append(measure(args.config, overrides, n, Path(args.runs_root)))
        print(table(results[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args.config, "overrides": overrides, "rounds": results}, indent=1))


if __name__ == "__main__":
    main()
