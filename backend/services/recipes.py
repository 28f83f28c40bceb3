"""Recipes: a named config, the data it needs, and a report of held-out accuracy before and after.

`python -m backend recipe arithmetic` trains like `python -m backend train configs/recipes/arithmetic.yaml`
and then reads the run directory back: validation accuracy at step 0 (the base model, greedy) and at the
last step, the curve between them, and the time spent training. The report goes to <run>/recipe.json and
the curve to <run>/plots/val_accuracy.png, so docs can quote and embed exactly what a run produced.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backend.core import data
from backend.core.config import load_config
from backend.core.runs import atomic_write_text, new_run_dir, read_metrics, read_status
from backend.engine import inference
from backend.engine.sft import train_sft
from backend.services import plotting
from backend.services.presets import CONFIGS_DIR

ACCURACY = "val/accuracy"
GSM8K_HELD_OUT = 256


class RecipeError(ValueError):
    """A recipe that cannot start (unknown name, missing data); the message says what to give."""


# What a recipe's preparation gives: overrides for its run (data it made, a warm-started model) and facts for
# its report (a baseline measured on the way).
Prepared = tuple[list[str], dict[str, Any]]


@dataclass(frozen=True)
class Recipe:
    name: str
    config: Path
    about: str
    # Makes what the config needs from the user's inputs (data_dir, overrides, ...); None: it ships with the project.
    prepare: Callable[[dict[str, Any]], Prepared] | None = None


def _gsm8k_data(inputs: dict[str, Any]) -> Prepared:
    """Split GSM8K's train.jsonl into data/gsm8k_recipe_{train,val}.parquet: GSM8K_HELD_OUT questions,
    drawn with a fixed seed, are held out for validation and never trained on."""
    source = inputs.get("gsm8k_jsonl")
    if not source:
        raise RecipeError("the gsm8k recipe needs GSM8K's train.jsonl: give --gsm8k-jsonl PATH "
                          "(train.jsonl of github.com/openai/grade-school-math)")
    if not Path(source).is_file():
        raise RecipeError(f"--gsm8k-jsonl {source}: no such file")
    rows = data.gsm8k_rows_from_jsonl(source, split="train")
    if len(rows) <= 2 * GSM8K_HELD_OUT:
        raise RecipeError(f"{source} has {len(rows)} questions; the recipe holds out {GSM8K_HELD_OUT} and needs "
                          f"more than {2 * GSM8K_HELD_OUT}")
    order = np.random.default_rng(0).permutation(len(rows))
    held = set(order[:GSM8K_HELD_OUT].tolist())
    val = [rows[i] for i in sorted(held)]
    for row in val:
        row["extra_info"]["split"] = "held_out"
    train = [r for i, r in enumerate(rows) if i not in held]
    out = Path(inputs["data_dir"])
    paths = out / "gsm8k_recipe_train.parquet", out / "gsm8k_recipe_val.parquet"
    data.write_rows(train, paths[0])
    data.write_rows(val, paths[1])
    return [f"data.train_files=[{paths[0]}]", f"data.val_files=[{paths[1]}]"], {}


def _calculator(inputs: dict[str, Any]) -> Prepared:
    """The calculator task's data, the base model's held-out accuracy without the tool (greedy, single turn),
    and a supervised warm-start on demonstrations of the call (a 135M model writes none on its own): its
    export is where the RL run starts."""
    paths = data.write_calculator_sets(inputs["data_dir"])
    made = [f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]",
            f"sft.train_files=[{paths['demos']}]"]
    cfg = load_config(RECIPES["calculator"].config, [*inputs.get("overrides", []), *made])
    base = cfg.actor_rollout_ref.model.path
    show = inputs.get("show_progress", True)
    if show:
        print(f"calculator: {base} greedy on the held-out problems without the tool")
    baseline = inference.evaluate(base, paths["val"], limit=cfg.data.val_max_samples,
                                  max_new_tokens=cfg.data.max_response_length, device=cfg.trainer.device).metrics
    warm_dir = new_run_dir(cfg.trainer.runs_root, "calculator-sft")
    if show:
        print(f"calculator: warm-start on {paths['demos']} in {warm_dir}")
    export = train_sft(cfg, warm_dir, show_progress=show)
    notes = {"no_tool_accuracy": baseline.get(ACCURACY), "base_model": base, "warm_start_run": str(warm_dir),
             "warm_start_steps": cfg.sft.steps,
             "warm_start_s": round(sum(m.get("timing_s/step", 0.0) for m in read_metrics(warm_dir)), 1)}
    return [*made, f"actor_rollout_ref.model.path={export}"], notes


_DIR = CONFIGS_DIR / "recipes"
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("arithmetic", _DIR / "arithmetic.yaml",
               "SmolLM2-135M-Instruct, GRPO on the arithmetic sample; one GPU, about 10 minutes"),
        Recipe("arithmetic-cpu", _DIR / "arithmetic-cpu.yaml",
               "the same, shrunk for a 2-core CPU: about 15 minutes"),
        Recipe("gsm8k", _DIR / "gsm8k.yaml",
               f"SmolLM2-135M-Instruct, GRPO on GSM8K's train split ({GSM8K_HELD_OUT} questions held out); one GPU",
               prepare=_gsm8k_data),
        Recipe("calculator", _DIR / "calculator.yaml",
               "SmolLM2-135M-Instruct learns multi-digit arithmetic with a calculator tool (warm-start, then "
               "multi-turn GRPO); one GPU", prepare=_calculator),
    )
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise RecipeError(f"no recipe named {name!r}; recipes: {', '.join(RECIPES)}")
    return RECIPES[name]


def prepare(recipe: Recipe, inputs: dict[str, Any]) -> Prepared:
    """What the recipe makes before its run (data, a warm-start), as overrides that point its config there
    and facts for its report."""
    return recipe.prepare(inputs) if recipe.prepare else ([], {})


def report(run_dir: str | Path) -> dict[str, Any]:
    """Held-out accuracy before (step 0) and after (the last validated step) from a run's metrics.

    Returns {before, after, best, best_step, curve: [[step, accuracy], ...], steps, train_s, wall_s,
    reward_curve: [[step, mean score], ...]}; before/after are None when the run has no such validation."""
    metrics = read_metrics(run_dir)
    curve: dict[int, float] = {}
    reward: dict[int, float] = {}
    step_s: dict[int, float] = {}
    tool_calls: dict[int, float] = {}  # multi-turn recipes: validation episodes with a call that answered
    for line in metrics:
        step = int(line["step"])
        if ACCURACY in line:
            curve[step] = float(line[ACCURACY])
        if "critic/score/mean" in line:
            reward[step] = float(line["critic/score/mean"])
        if "timing_s/step" in line:
            step_s[step] = float(line["timing_s/step"])
        if "val/tool_call_rate" in line:
            tool_calls[step] = float(line["val/tool_call_rate"])
    points = sorted(curve.items())
    status = read_status(run_dir) or {}
    started, finished = status.get("started"), status.get("finished")
    best_step, best = max(points, key=lambda p: (p[1], -p[0])) if points else (None, None)
    return {
        "before": curve.get(0),
        "after": points[-1][1] if points and points[-1][0] > 0 else None,
        "best": best,
        "best_step": best_step,
        "curve": [[s, a] for s, a in points],
        "reward_curve": [[s, r] for s, r in sorted(reward.items())],
        **({"tool_call_rate_curve": [[s, r] for s, r in sorted(tool_calls.items())]} if tool_calls else {}),
        "steps": max(step_s, default=0),
        # Step time counts rollout, scoring, update and checkpoints; not start-up or validation.
        "train_s": round(sum(step_s.values()), 1),
        "wall_s": round(finished - started, 1) if started and finished else None,
    }


def environment() -> dict[str, Any]:
    """Versions and hardware a result depends on, recorded beside it."""
    import torch
    import transformers

    from backend import __version__

    env = {"grpo_workbench": __version__, "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "machine": platform.machine(), "cpus": _cpus()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def write_report(run_dir: str | Path, recipe: Recipe, command: str, notes: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """recipe.json (with the preparation's `notes`) and plots/val_accuracy.png in the run directory; returns
    the report."""
    run_dir = Path(run_dir)
    result = {"recipe": recipe.name, "command": command, **(notes or {}), **report(run_dir),
              "environment": environment()}
    atomic_write_text(run_dir / "recipe.json", json.dumps(result, indent=2) + "\n")
    if result["curve"]:
        plotting.plot_metric([run_dir], ACCURACY, run_dir / "plots" / "val_accuracy.png", labels=[recipe.name],
                             title=f"{recipe.name}: held-out accuracy (greedy)")
    return result


def summary(result: dict[str, Any]) -> str:
    """The report as a few lines for the console."""
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    lines = [f"recipe {result['recipe']}: held-out accuracy {pct(result['before'])} before, "
             f"{pct(result['after'])} after {result['steps']} steps "
             f"(best {pct(result['best'])} at step {result['best_step']})",
             f"training time {result['train_s'] / 60:.1f} min"
             + (f", wall {result['wall_s'] / 60:.1f} min" if result["wall_s"] else "")]
    if "no_tool_accuracy" in result:
        lines.insert(0, f"{result['base_model']} without the tool: {pct(result['no_tool_accuracy'])}; after "
                        f"{result['warm_start_steps']} warm-start steps ({result['warm_start_s']:.0f} s), with it:")
    lines += [f"  step {s:>4}  {pct(a)}" for s, a in result["curve"]]
    return "\n".join(lines)
