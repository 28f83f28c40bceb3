"""Whether a run repeats exactly with the same seed, with trainer.deterministic off and on, and what it costs.

A sweep that compares close settings needs each setting's result to be the setting's, not the run's luck: on a
GPU two runs of one config with one seed can differ (atomic adds in attention's backward, timing-based kernel
choices), and the difference grows step by step once one sampled token differs. This launches `--repeats` runs
of one config in each mode, all at once (the same contention for both modes), and reports for each mode whether
its runs logged the same values step for step, the first step where they parted, the largest gap in the
compared metrics, and the median step time.

    python bench/repeatability.py --steps 20 --out OUT/repeat.json [config overrides]

On a CPU the runs repeat in both modes; the GPU is where the modes differ (docs/sweeps.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.core.config import load_config  # noqa: E402
from backend.core.runs import read_metrics, read_status  # noqa: E402
from backend.services import launcher  # noqa: E402
from bench.trial_startup import RECIPE, steps_only, watch  # noqa: E402

COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean")


def run_all(cfg_path: str, overrides: list[str], repeats: int, runs_root: Path) -> tuple[dict[str, list[Path]], bool]:
    """The runs of each mode, and whether SIGINT cut them short (they are stopped, and compared over the steps
    they logged: a GPU call's time limit must not leave them training into the next command)."""
    runs: dict[str, list[Path]] = {}
    for mode in ("off", "on"):
        cfg = load_config(cfg_path, [*overrides, f"trainer.deterministic={str(mode == 'on').lower()}"])
        runs[mode] = [launcher.launch(cfg, name=f"repeat-{mode}-{i}", runs_root=runs_root) for i in range(repeats)]
    every = [run for mode_runs in runs.values() for run in mode_runs]
    try:
        watch(every)  # until every run has ended
    except KeyboardInterrupt:
        for run in every:
            launcher.stop(run)
        return runs, True
    return runs, False


def compare(runs: list[Path]) -> dict:
    """How the runs of one mode agree: the first step whose compared metrics differ between any two, and the
    largest difference of each metric over all steps."""
    logs = [read_metrics(run) for run in runs]
    states = [(read_status(run) or {}).get("state") for run in runs]
    steps = min(len(log) for log in logs)
    first_diff, gaps = None, dict.fromkeys(COMPARED, 0.0)
    for i in range(steps):
        rows = [log[i] for log in logs]
        for key in COMPARED:
            values = [row[key] for row in rows if key in row]
            if len(values) < len(rows):
                continue
            gap = max(values) - min(values)
            gaps[key] = max(gaps[key], gap)
            if gap and first_diff is None:
                first_diff = rows[0]["step"]
    later = [row["timing_s/step"] for log in logs for row in log[1:]]
    return {"runs": [run.name for run in runs], "states": states, "steps": steps,
            "identical": steps > 0 and first_diff is None and "failed" not in states,
            "first_differing_step": first_diff, "largest_gap": gaps,
            "median_step_s": round(statistics.median(later), 3) if later else None,
            "final_score": [log[-1].get("critic/score/mean") if log else None for log in logs]}


def table(result: dict) -> str:
    lines = [f"{'deterministic':<14}{'runs':>5}{'identical':>11}{'first differing step':>22}"
             f"{'largest score gap':>19}{'median step s':>15}"]
    for mode, r in result.items():
        lines.append(f"{mode:<14}{len(r['runs']):>5}{str(r['identical']):>11}{str(r['first_differing_step']):>22}"
                     f"{r['largest_gap']['critic/score/mean']:>19.4g}{str(r['median_step_s']):>15}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--config", default=RECIPE)
    p.add_argument("--repeats", type=int, default=2, help="runs of the config in each mode")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--runs-root", default="/tmp/repeat-runs")
    p.add_argument("--out", required=True)
    args = p.parse_intermixed_args()
    overrides = steps_only(args.steps, args.overrides)
    runs, interrupted = run_all(args.config, overrides, args.repeats, Path(args.runs_root))
    result = {mode: compare(mode_runs) for mode, mode_runs in runs.items()}
    print(table(result), flush=True)
    if interrupted:
        print("interrupted: the runs were stopped and are compared over the steps they logged", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args.config, "overrides": overrides, "modes": result,
                               "state": "interrupted" if interrupted else "finished"}, indent=1))


if __name__ == "__main__":
    main()
