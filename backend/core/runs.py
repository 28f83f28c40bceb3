"""The run directory: the one contract between the engine and anything that watches it.

    runs/<run_id>/config.yaml                   the fully resolved config
    runs/<run_id>/status.json                   state, pid, step, heartbeat, error (replaced atomically)
    runs/<run_id>/metrics.jsonl                 one JSON object per step, flushed per line
    runs/<run_id>/rollouts/step_NNNNNN.parquet  the sampled responses of a step
    runs/<run_id>/logs/                         stdout and stderr of the run
    runs/<run_id>/checkpoints/step_N/           everything needed to resume
    runs/<run_id>/export/                       a plain Hugging Face model folder
    runs/<run_id>/dumps/step_N/                 a step's update inputs, for replay (backend.engine.replay)
    runs/<run_id>/diagnosis/                    every process's Python stacks when a call to the workers stalled

Writers replace files atomically (write a temporary file, then rename), so a reader, or a run killed
mid-write, never sees half a file where a whole one was.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

STATES = ("queued", "running", "succeeded", "failed", "stopped")
# Set by whoever starts a trainer in the background (the workbench's launcher): the nice value the run
# takes once its workers are up, so it yields the CPU to interactive work.
NICE_ENV = "GRPO_WB_RUN_NICE"
# A file anyone may create in a run directory: the trainer saves its next step's update for replay
# (backend.engine.replay) and removes the file.
DUMP_REQUEST = "dump_next"
_CKPT = re.compile(r"^step_(\d+)$")
# A checkpoint's folder that holds its model config and tokenizer as Hugging Face writes them, beside the shards.
HF = "huggingface"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def new_run_dir(runs_root: str | Path, name: str = "") -> Path:
    """A fresh, uniquely named run directory under runs_root (not created yet)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-{name}" if name else stamp
    root = Path(runs_root)
    candidate, k = root / base, 1
    while candidate.exists():
        k += 1
        candidate = root / f"{base}-{k}"
    return candidate


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _finite(value: Any) -> Any:
    """JSON has no NaN or inf; write them as null so every reader can parse every line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunDir:
    """Paths of one run directory, and the writers the trainer uses."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.config = self.root / "config.yaml"
        self.status = self.root / "status.json"
        self.metrics = self.root / "metrics.jsonl"
        self.rollouts = self.root / "rollouts"
        self.logs = self.root / "logs"
        self.checkpoints = self.root / "checkpoints"
        self.export = self.root / "export"
        self.dump_request = self.root / DUMP_REQUEST
        self.diagnosis = self.root / "diagnosis"

    def create(self) -> RunDir:
        for d in (self.root, self.rollouts, self.logs, self.checkpoints):
            d.mkdir(parents=True, exist_ok=True)
        return self

    # ---- status ----

    def write_status(self, state: str, **fields: Any) -> dict:
        """Merge `fields` into status.json and stamp the heartbeat."""
        assert state in STATES, state
        status = read_status(self.root) or {}
        status.update(fields)
        status.update(state=state, heartbeat=time.time(), pid=status.get("pid", os.getpid()),
                      host=socket.gethostname())
        atomic_write_text(self.status, json.dumps(status, indent=1))
        return status

    # ---- metrics ----

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        line = json.dumps({k: _finite(v) for k, v in metrics.items()})
        with open(self.metrics, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def truncate_metrics(self, after_step: int) -> None:
        """Drop lines past a resumed checkpoint's step, so the file reads as one uninterrupted run."""
        kept = [m for m in read_metrics(self.root) if m.get("step", 0) <= after_step]
        atomic_write_text(self.metrics, "".join(json.dumps(m) + "\n" for m in kept))

    # ---- rollouts ----

    def write_rollouts(self, step: int, rows: dict[str, list]) -> Path:
        return _write_table(self.rollouts / f"step_{step:06d}.parquet", rows)

    def write_token_log(self, step: int, rows: dict[str, list]) -> Path:
        """rollouts/tokens_step_N.parquet: per-token quantities of a few responses of the step."""
        return _write_table(self.rollouts / f"tokens_step_{step:06d}.parquet", rows)

    # ---- checkpoints ----

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    def begin_checkpoint(self, step: int) -> Path:
        """A temporary folder to write step `step`'s checkpoint into; `commit_checkpoint` publishes it."""
        tmp = self.checkpoints / f".tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit_checkpoint(self, tmp: Path, step: int, keep: int) -> Path:
        """Rename the finished folder into place, then drop the oldest beyond `keep` (0 keeps all).
        The previous checkpoint stays until the new one is whole, so a kill mid-write loses nothing."""
        final = self.checkpoint_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep:
            for old in list_checkpoints(self.root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        return final


def _write_table(path: Path, rows: dict[str, list]) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.table(rows), tmp)
    os.replace(tmp, path)
    return path


def read_status(run_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every whole line of metrics.jsonl; a torn last line (a run killed mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Whole checkpoints, oldest first (temporary folders of an interrupted write are not listed)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CKPT.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def list_dumps(run_dir: str | Path) -> list[Path]:
    """A run's whole step dumps (dumps/step_N, for replay), by step; one being written is not listed."""
    folder = Path(run_dir) / "dumps"
    found = [p for p in folder.glob("step_*") if (p / "logged.json").is_file()] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


# ---- where a model folder came from ----

def run_dir_of(model_dir: str | Path) -> Path | None:
    """The run directory a checkpoint (`<run>/checkpoints/step_N`) or export (`<run>/export`) belongs to,
    recognised by the run's config.yaml; None for a folder that is not part of a run."""
    path = Path(model_dir).expanduser().resolve()
    candidates = []
    if path.parent.name == "checkpoints":
        candidates.append(path.parent.parent)
    if path.name == "export":
        candidates.append(path.parent)
    return next((c for c in candidates if (c / "config.yaml").is_file()), None)


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's resolved config.yaml as a dict ({} when missing or unreadable)."""
    try:
        raw = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}


def config_get(cfg: dict, dotted: str, default: Any = None) -> Any:
    """A dotted key of a config dict (`data.train_files`), or `default` when any part is missing."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_source(model: str | Path) -> str:
    """Where the tokenizer of `model` loads from: the folder itself when it holds one; for a run's
    checkpoint, the run config's `actor_rollout_ref.model.tokenizer_path` or else its model path; for an
    export of an older version, the base model its grpo_workbench.json names. Anything else (a shipped
    name, a Hub id) is its own source."""
    path = Path(str(model)).expanduser()
    if not path.is_dir() or has_tokenizer(path):
        return str(model)
    if has_tokenizer(path / HF):
        return str(path / HF)
    run_dir = run_dir_of(path)
    if run_dir is not None:
        cfg = read_run_config(run_dir)
        source = (config_get(cfg, "actor_rollout_ref.model.tokenizer_path")
                  or config_get(cfg, "actor_rollout_ref.model.path"))
        if source:
            return str(source)
    try:
        base = json.loads((path / "grpo_workbench.json").read_text()).get("base_model")
    except (OSError, json.JSONDecodeError, AttributeError):
        base = None
    return str(base) if base else str(model)


def checkpoint_step(model_dir: str | Path) -> int | None:
    """The training step a folder holds: trainer_state.json's step, else the step of the run's final
    status (for export/), else the N of a step_N folder name."""
    path = Path(model_dir)
    try:
        return int(json.loads((path / "trainer_state.json").read_text())["step"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        pass
    run_dir = run_dir_of(path)
    if path.name == "export" and run_dir is not None:
        try:
            return int(json.loads((run_dir / "status.json").read_text())["step"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
    if path.name.startswith("step_") and path.name[5:].isdigit():
        return int(path.name[5:])
    return None

