"""Experiment trackers: where each step's metrics go besides the run directory (verl's `trainer.logger`).

    trainer.logger: [console, jsonl, tensorboard, wandb, mlflow]

metrics.jsonl is always written (the run directory contract) and console is the per-step summary line;
the others are optional libraries (`pip install 'grpo-workbench[trackers]'`):

    tensorboard  event files in runs/<run_id>/tensorboard/
    wandb        offline by default (runs/<run_id>/wandb/); set WANDB_MODE=online to upload
    mlflow       MLFLOW_TRACKING_URI, else a local SQLite store in runs/<run_id>/mlruns/mlflow.db

A tracker that fails while logging warns once and is switched off: it never ends a run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import numbers
import os
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

INSTALL_ALL = "pip install 'grpo-workbench[trackers]'"


@dataclasses.dataclass(frozen=True)
class TrackerSpec:
    library: str = ""  # the import that must work; "" = built in
    package: str = ""  # what pip installs
    open: Callable[[Path, Any], Any] | None = None  # (run_dir, cfg) -> object with log(metrics, step), close()


TRACKERS: dict[str, TrackerSpec] = {}


def register_tracker(name: str, library: str = "", package: str = ""):
    def deco(fn):
        TRACKERS[name] = TrackerSpec(library, package or library, fn)
        return fn
    return deco


TRACKERS["console"] = TrackerSpec()  # the trainer's per-step summary line
TRACKERS["jsonl"] = TrackerSpec()  # metrics.jsonl, written whatever the list says


def check_trackers(names: list[str]) -> list[str]:
    """Problems with trainer.logger: unknown names and trackers whose library is not installed."""
    problems = []
    for name in names:
        spec = TRACKERS.get(name)
        if spec is None:
            problems.append(f"trainer.logger has '{name}'; choose from: {', '.join(TRACKERS)}")
        elif spec.library and importlib.util.find_spec(spec.library) is None:
            problems.append(f"trainer.logger has '{name}' but {spec.package} is not installed: "
                            f"{INSTALL_ALL} (or pip install {spec.package})")
    return problems


def numeric_items(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics dict (strings, None, NaN and inf are left out)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


class Tracking:
    """The trackers of one run; `log` feeds all of them, `close` ends them."""

    def __init__(self, trackers: dict[str, Any]):
        self.trackers = trackers

    def log(self, metrics: dict, step: int) -> None:
        values = numeric_items(metrics)
        values.pop("step", None)
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(values, step)
            except Exception as e:  # a tracker must never end a run
                warnings.warn(f"tracker {name} failed ({type(e).__name__}: {e}); it is switched off for this run",
                              stacklevel=2)
                self.trackers.pop(name)
                self._close_one(name, tracker)

    def close(self) -> None:
        for name, tracker in list(self.trackers.items()):
            self._close_one(name, tracker)
        self.trackers.clear()

    @staticmethod
    def _close_one(name: str, tracker: Any) -> None:
        try:
            tracker.close()
        except Exception as e:
            warnings.warn(f"tracker {name} failed to close ({type(e).__name__}: {e})", stacklevel=3)


def open_trackers(names: list[str], run_dir: str | Path, cfg) -> Tracking:
    """Start the trackers named in trainer.logger (console and jsonl need nothing started here)."""
    problems = check_trackers(names)
    if problems:
        raise ValueError("; ".join(problems))
    run_dir = Path(run_dir)
    opened: dict[str, Any] = {}
    try:
        for name in dict.fromkeys(names):
            spec = TRACKERS[name]
            if spec.open is not None:
                opened[name] = spec.open(run_dir, cfg)
    except BaseException:
        Tracking(opened).close()
        raise
    return Tracking(opened)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)


# ---- TensorBoard ----

@register_tracker("tensorboard", library="tensorboard")
class TensorBoardTracker:
    def __init__(self, run_dir: Path, cfg):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# ---- Weights & Biases ----

@register_tracker("wandb", library="wandb")
class WandbTracker:
    # Offline unless the user set WANDB_MODE: nothing leaves the machine unless asked for.
    def __init__(self, run_dir: Path, cfg):
        import wandb

        self.run = wandb.init(project=cfg.trainer.project_name, name=run_dir.name, dir=str(run_dir),
                              config=_config_dict(cfg),
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


# ---- MLflow ----

_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")  # MLflow names allow alphanumerics, _ - . space : /
_MLFLOW_PARAM_MAX = 500  # MLflow's oldest stores cap a param value at 500 characters


def local_mlflow_uri(run_dir: str | Path) -> str:
    """The tracking URI of a run's own MLflow store: `mlflow ui --backend-store-uri <this>` shows it."""
    return f"sqlite:///{(Path(run_dir) / 'mlruns' / 'mlflow.db').resolve()}"


def mlflow_name(key: str) -> str:
    return _MLFLOW_BAD.sub("_", key)


@register_tracker("mlflow", library="mlflow")
class MlflowTracker:
    # The client API, not mlflow's fluent one: no process-global active run to leak between runs.
    def __init__(self, run_dir: Path, cfg):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
        if not uri:
            # MLflow 3 refuses a plain folder store (./mlruns) by default; a SQLite file in the run is the local one.
            store = (run_dir / "mlruns").resolve()
            store.mkdir(parents=True, exist_ok=True)
            uri, artifacts = local_mlflow_uri(run_dir), (store / "artifacts").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        project = cfg.trainer.project_name
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = (experiment.experiment_id if experiment
                         else self.client.create_experiment(project, artifact_location=artifacts))
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        params = [Param(mlflow_name(k), str(v)[:_MLFLOW_PARAM_MAX]) for k, v in flatten(_config_dict(cfg)).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_name(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
