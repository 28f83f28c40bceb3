"""Models to pick from in the workbench: the shipped ones, every run's export and checkpoints, and the
folders under the workspace's exports/."""

from __future__ import annotations

from pathlib import Path

from backend.core.models import SHIPPED
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
