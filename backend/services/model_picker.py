"""Models to pick from in the workbench: the shipped ones, every run's export and checkpoints, and the
folders under the workspace's exports/."""

from __future__ import annotations

from pathlib import Path

from backend.core.models import SHIPPED
from backend.core.runs import config_get, read_run_config
from backend.core.workspace import workspace_root
from backend.services.launcher import list_runs


def exports_dir() -> Path:
    """Where the workbench writes exports: `exports/` in the workspace."""
    return workspace_root() / "exports"


def model_choices(runs_root: str | Path, exports_dir: str | Path | None = None) -> list[tuple[str, str]]:
    """(label, model) pairs for a model picker: the shipped models, then per run (newest first) its
    export/ and its checkpoints ("run <id> · step_4"), then the folders under `exports_dir`."""
    choices = [(f"{name} (shipped)", name) for name in SHIPPED]
    for run in list_runs(runs_root):
        if (run.path / "export" / "config.json").is_file():
            choices.append((f"run {run.name} · export", str(run.path / "export")))
        for ckpt in reversed(run.checkpoints):
            choices.append((f"run {run.name} · {ckpt}", str(run.path / "checkpoints" / ckpt)))
    if exports_dir is not None and Path(exports_dir).is_dir():
        for folder in sorted(Path(exports_dir).iterdir()):
            if folder.is_dir() and not folder.name.startswith(".") and (folder / "config.json").is_file():
                choices.append((f"export {folder.name}", str(folder)))
    return choices


def compare_defaults(choices: list[tuple[str, str]], runs_root: str | Path, opened_run: str | None,
                     fallback_model: str) -> tuple[str, str]:
    """The labels, among `choices` (model_choices' pairs), that A and B of a comparison start at: the base model of
    the run the user opened last (`opened_run`) and that run's export, else its latest checkpoint. Without that
    run, or when it is gone: `fallback_model` and the newest run's export or checkpoint. Not simply the newest
    export: that may be a fork of another run than the one the user is looking at."""
    labels = {model: label for label, model in reversed(choices)}  # a model listed twice: its first label
    runs = list_runs(runs_root)
    run = next((r for r in runs if r.name == opened_run), None)
    base = config_get(read_run_config(run.path), "actor_rollout_ref.model.path") if run else None
    base_label = labels.get(str(base)) or labels.get(fallback_model) or choices[0][0]
    trained = [label for label, _ in choices if label.startswith("run ")]
    if run is not None:
        trained = [label for label in trained if label.startswith(f"run {run.name} · ")] or trained
    return base_label, trained[0] if trained else base_label
