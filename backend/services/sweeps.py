"""Sweeps: runs of one config that differ in a few keys, chosen and stopped early by Optuna.

A sweep lives in `<runs_root>/sweeps/<name>/`:

    sweep.yaml     what was asked: the keys varied and how, the metric and its direction, the budget
    base.yaml      the config every trial starts from
    study.journal  Optuna's journal: each trial's settings, state, the metric at each step, its run
    state.json     the sweep process's own status (state, pid, heartbeat) and how many trials run at once

Each trial is an ordinary run in `<runs_root>` (named `<sweep>-<trial number>`, its status.json says which
sweep and trial), so the run pages, resume and compare work on it. Optuna chooses the settings (the grid in
the order written, or its random sampler over ranges), and its median pruner decides which trial to stop from
the metric each run logs; successive halving, which must rank the trials at a rung together, is `halving`'s.
This module starts, watches and stops runs, and keeps everything on disk, so a sweep continues after the
workbench or the machine restarts (`run_sweep` again).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from backend.core.config import (
    Config,
    ConfigError,
    config_from_yaml_text,
    field_specs,
    get_value,
    parse_override,
    to_yaml,
)
from backend.core.runs import atomic_write_text, latest_checkpoint, read_metrics
from backend.core.workspace import PathError, check_name
from backend.services import halving, launcher

EARLY_STOPPING = ("off", "median", "halving")
DIRECTIONS = {"max": "maximize", "min": "minimize"}
SWEEPS_DIR = "sweeps"
FINISHED = {TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL}

optuna.logging.set_verbosity(optuna.logging.WARNING)


class SweepError(ValueError):
    """A sweep that cannot be made or read: the message names the key, value or file."""


@dataclass
class SweepParam:
    """One key a sweep varies: a list of `values` (a grid axis), or a range `low`..`high` sampled at random
    (on a log scale with `log`; whole numbers when the key is an int)."""

    key: str
    values: list | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False


@dataclass
class SweepSpec:
    """What a sweep runs: every key in `params` varied over the base config, `steps` training steps a trial,
    at most `parallel` trials at once (0: as many as the machine holds), ranked by the last value of `metric`
    a trial logs (`direction` max or min). A grid runs every combination once; ranges run `trials` draws."""

    params: list[SweepParam]
    metric: str = launcher.SCORE_KEY
    direction: str = "max"
    trials: int | None = None
    steps: int | None = None
    parallel: int = 1
    early_stopping: str = "off"
    # The median pruner compares a trial with trials that finished: it waits for this many, and for this many
    # steps of the trial itself, before it stops one. Successive halving's first rung is at `min_steps`.
    startup_trials: int = 2
    min_steps: int = 1
    seed: int = 0

    @property
    def is_grid(self) -> bool:
        return all(p.values is not None for p in self.params)

    def grid(self) -> list[dict[str, Any]]:
        """Every combination of the grid's values, the first key varying slowest (as written)."""
        keys = [p.key for p in self.params]
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(p.values for p in self.params))]

    def total_trials(self) -> int:
        return len(self.grid()) if self.is_grid else int(self.trials or 0)


# ---- reading what the user asked ----

def parse_grid(items: list[str]) -> list[SweepParam]:
    """`key=v1,v2,...` items (the CLI's --grid) -> grid axes."""
    params = []
    for item in items:
        key, raw = _split(item, "key=v1,v2,...")
        values = [parse_override(f"{key}={v.strip()}")[1] for v in raw.split(",") if v.strip()]
        if not values:
            raise SweepError(f"--grid {item}: give at least one value after '=' (key=v1,v2,...)")
        params.append(SweepParam(key, values=values))
    return params


def parse_ranges(items: list[str]) -> list[SweepParam]:
    """`key=low:high` or `key=low:high:log` items (the CLI's --range) -> ranges sampled at random."""
    params = []
    for item in items:
        key, raw = _split(item, "key=low:high[:log]")
        parts = raw.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "log"):
            raise SweepError(f"--range {item}: expected key=low:high or key=low:high:log")
        try:
            low, high = float(parts[0]), float(parts[1])
        except ValueError:
            raise SweepError(f"--range {item}: low and high must be numbers, got '{parts[0]}' and '{parts[1]}'") \
                from None
        params.append(SweepParam(key, low=low, high=high, log=len(parts) == 3))
    return params


def _split(item: str, form: str) -> tuple[str, str]:
    if "=" not in item:
        raise SweepError(f"'{item}' must look like {form}")
    key, raw = item.split("=", 1)
    return key.strip(), raw


def spec_from_dict(raw: dict, source: str = "sweep") -> SweepSpec:
    """A sweep YAML's contents -> SweepSpec: `grid: {key: [values]}` and/or `ranges: {key: {low, high, log}}`,
    and the other fields of SweepSpec by name."""
    if not isinstance(raw, dict):
        raise SweepError(f"{source}: expected a mapping with grid: or ranges:, got {type(raw).__name__}")
    raw = dict(raw)
    grid = raw.pop("grid", None) or {}
    params = [SweepParam(k, values=list(v) if isinstance(v, list) else [v]) for k, v in grid.items()]
    for key, r in (raw.pop("ranges", None) or {}).items():
        if not isinstance(r, dict) or not {"low", "high"} <= r.keys():
            raise SweepError(f"{source}: ranges.{key} needs low: and high: (and log: true for a log scale)")
        params.append(SweepParam(key, low=float(r["low"]), high=float(r["high"]), log=bool(r.get("log", False))))
    known = {f for f in SweepSpec.__dataclass_fields__ if f != "params"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SweepError(f"{source}: unknown field(s) {', '.join(unknown)}; allowed: grid, ranges, "
                         f"{', '.join(sorted(known))}")
    return SweepSpec(params=params, **raw)


def check_spec(spec: SweepSpec, base_text: str, base_overrides: list[str] | None = None) -> None:
    """Raise SweepError naming every problem: unknown keys, values the config refuses, a range that is empty
    or not positive on a log scale, a grid and ranges mixed, a trial count missing, a bad direction."""
    problems: list[str] = []
    specs = field_specs()
    if not spec.params:
        problems.append("a sweep varies at least one key: give --grid key=v1,v2 or --range key=low:high")
    if spec.direction not in DIRECTIONS:
        problems.append(f"direction '{spec.direction}': use max or min")
    if spec.early_stopping not in EARLY_STOPPING:
        problems.append(f"early_stopping '{spec.early_stopping}': use one of {', '.join(EARLY_STOPPING)}")
    if spec.parallel < 0:
        problems.append(f"parallel {spec.parallel}: use 1 or more trials at once, or 0 for as many as fit")
    if spec.steps is not None and spec.steps < 1:
        problems.append(f"steps {spec.steps}: a trial trains at least 1 step")
    if not spec.metric:
        problems.append("metric: name the logged metric to rank trials by, e.g. critic/score/mean")
    grid = [p for p in spec.params if p.values is not None]
    ranges = [p for p in spec.params if p.values is None]
    if grid and ranges:
        problems.append("a sweep is a grid or random ranges, not both: give --grid or --range")
    if ranges and not spec.trials:
        problems.append("random ranges need a number of trials (--trials N)")
    seen = set()
    for p in spec.params:
        if p.key in seen:
            problems.append(f"{p.key} is varied twice")
        seen.add(p.key)
        if p.key not in specs:
            close = [k for k in specs if k.rsplit(".", 1)[-1] == p.key.rsplit(".", 1)[-1]]
            problems.append(f"{p.key} is not a config key" + (f"; did you mean {close[0]}?" if close else ""))
            continue
        if p.values is None:
            if not (p.low is not None and p.high is not None and p.low < p.high):
                problems.append(f"{p.key}: the range {p.low}:{p.high} is empty; low must be below high")
            elif p.log and p.low <= 0:
                problems.append(f"{p.key}: a log scale needs a positive low, got {p.low}")
            if get_value_type(p.key) not in (int, float):
                problems.append(f"{p.key} is not a number: vary it with --grid values instead of a range")
    if problems:
        raise SweepError("; ".join(problems))
    for point in _corners(spec):
        try:
            trial_config(base_text, base_overrides or [], point, spec.steps)
        except ConfigError as e:
            values = ", ".join(f"{k}={v}" for k, v in point.items())
            raise SweepError(f"the trial {values} is not a valid config: {'; '.join(e.problems)}") from None


def get_value_type(key: str) -> Any:
    return field_specs()[key][0]


def _corners(spec: SweepSpec) -> list[dict[str, Any]]:
    """The settings to check before anything starts: every grid point, or each range's two ends."""
    if spec.is_grid:
        return spec.grid()
    return [{p.key: _typed(p.key, p.low) for p in spec.params}, {p.key: _typed(p.key, p.high) for p in spec.params}]


def _as_field_type(key: str, value: Any) -> Any:
    """A grid value as the key's type, so that trials show 1e-06, not the text '1e-6' YAML left it as."""
    tp = get_value_type(key)
    if tp in (int, float) and isinstance(value, str | int) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            return tp(value)
    return value


def _typed(key: str, value: float) -> int | float:
    return round(value) if get_value_type(key) is int else value


def trial_config(base_text: str, base_overrides: list[str], values: dict[str, Any], steps: int | None) -> Config:
    """The base config with a trial's values (and the sweep's steps) set: what the trial's run trains."""
    overrides = [*base_overrides, *(f"{k}={_yaml_value(v)}" for k, v in values.items())]
    if steps is not None:
        overrides.append(f"trainer.total_training_steps={steps}")
    cfg, problems = config_from_yaml_text(base_text, overrides, "the sweep's base config")
    if problems:
        raise ConfigError(problems)
    return cfg


def _yaml_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, list | dict | str) else str(value)


# ---- making a sweep ----

def default_name() -> str:
    """A sweep's name when none is given: the time it was made."""
    return time.strftime("sweep-%Y%m%d-%H%M%S")


def create_sweep(base: Config, spec: SweepSpec, *, name: str, runs_root: str | Path | None = None) -> Path:
    """Check `spec` against `base` and write the sweep's folder; nothing runs until `run_sweep`."""
    try:
        check_name(name, "sweep name")
    except PathError as e:
        raise SweepError(str(e)) from None
    base_text = to_yaml(base)
    check_spec(spec, base_text)
    for p in spec.params:
        if p.values is not None:
            p.values = [_as_field_type(p.key, v) for v in p.values]
    folder = Path(os.path.abspath(Path(runs_root if runs_root is not None else base.trainer.runs_root)
                                  / SWEEPS_DIR / name))
    taken = SweepError(f"a sweep named {name} already exists in {folder.parent}: choose another name")
    if folder.exists():
        raise taken
    # Written aside and renamed into place: a reader (the Sweeps page, a waiting script) sees the whole sweep, its
    # study included, or none of it.
    tmp = folder.with_name(f".{name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        atomic_write_text(tmp / "base.yaml", base_text)
        atomic_write_text(tmp / "sweep.yaml", yaml.safe_dump(asdict(spec), sort_keys=False))
        _write_state(tmp, state="created", parallel=spec.parallel)
        study = _study(tmp, spec, create=True, name=name)
        for point in spec.grid() if spec.is_grid else []:
            study.enqueue_trial(point)  # the grid in the order written, not the sampler's
        try:
            os.rename(tmp, folder)
        except OSError:  # made by someone else meanwhile
            raise taken from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def read_spec(folder: str | Path) -> SweepSpec:
    path = Path(folder) / "sweep.yaml"
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"{path}: cannot read the sweep ({e})") from None
    raw["params"] = [SweepParam(**p) for p in raw.get("params") or []]
    return SweepSpec(**raw)


def _study(folder: Path, spec: SweepSpec, *, create: bool = False, name: str = "") -> optuna.Study:
    """The sweep's Optuna study, named as its folder (or `name`, for one being written aside)."""
    storage = JournalStorage(JournalFileBackend(str(folder / "study.journal")))
    if spec.early_stopping == "median":
        pruner: optuna.pruners.BasePruner = optuna.pruners.MedianPruner(
            n_startup_trials=spec.startup_trials, n_warmup_steps=spec.min_steps)
    else:  # successive halving ranks a rung's trials together (`_halve`), which no Optuna pruner does
        pruner = optuna.pruners.NopPruner()
    sampler = optuna.samplers.RandomSampler(seed=spec.seed)
    kwargs = dict(study_name=name or folder.name, storage=storage, sampler=sampler, pruner=pruner)
    if create:
        return optuna.create_study(direction=DIRECTIONS[spec.direction], **kwargs)
    return optuna.load_study(**kwargs)


# ---- the sweep's own status ----

def _write_state(folder: Path, **fields: Any) -> None:
    state = {**read_state(folder), **fields, "heartbeat": time.time()}
    atomic_write_text(folder / "state.json", json.dumps(state, indent=1))


def read_state(folder: str | Path) -> dict:
    try:
        return json.loads((Path(folder) / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def set_parallel(folder: str | Path, parallel: int) -> None:
    """How many trials run at once from now on (0: as many as fit); a running sweep reads it each poll and
    starts more, or lets running trials finish until fewer run."""
    if parallel < 0:
        raise SweepError(f"parallel {parallel}: use 1 or more, or 0 for as many as fit")
    _write_state(Path(folder), parallel=parallel)


def request_stop(folder: str | Path) -> None:
    """Ask the sweep to stop: it stops its running trials and starts no more."""
    _write_state(Path(folder), stop_requested=time.time())


# ---- running ----

# Sweep processes this process started: a finished child stays a zombie, which os.kill(pid, 0) calls alive,
# until it is polled.
_processes: dict[int, subprocess.Popen] = {}


def _base_trainer(folder: Path) -> dict[str, Any]:
    """The trainer section of the sweep's base config, as written (its defaults left out)."""
    return (yaml.safe_load((folder / "base.yaml").read_text()) or {}).get("trainer") or {}


def start_sweep(folder: str | Path) -> None:
    """Run the sweep in a background process of its own session (`python -m backend sweep --resume`), as the
    launcher runs a trainer: closing the browser or restarting the workbench leaves it going; with
    `trainer.ray_address` in the base config, as a Ray job of that cluster (and its trials as jobs too). Its
    output goes to `<folder>/sweep.log`."""
    folder = Path(folder)
    cmd = [sys.executable, "-m", "backend", "sweep", "--resume", str(folder), "--quiet"]
    address = _base_trainer(folder).get("ray_address")
    if address:
        job = launcher.submit_job(address, cmd, folder / "sweep.log", folder / "sweep.log", {},
                                  on_error=lambda e: _write_state(folder, state="failed", error=str(e)))
        # No pid or host until the job's process writes its own: until then the sweep reads as starting.
        _write_state(folder, state="starting", pid=None, host=None, ray_job=job)
        return
    with open(folder / "sweep.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                cwd=os.getcwd(), start_new_session=True, close_fds=True)
    _processes[proc.pid] = proc
    _write_state(folder, state="starting", pid=proc.pid, host=socket.gethostname())


def run_sweep(folder: str | Path, *, poll_s: float = 1.0, on_change: Callable[[dict], None] | None = None) -> str:
    """Run the sweep in `folder` to its end in this process: start trials while fewer than `parallel` run, the
    budget allows and (on GPUs) the planner's predicted memory fits, report each running trial's metric to
    Optuna as its run logs it, stop the trials the pruner gives up on, and record each trial's end. A failed
    trial never stops the sweep; one that ran out of memory beside others runs again alone. Returns the sweep's
    final state (finished or stopped). Run again after a restart, it picks up where it was: runs still going
    are watched, runs killed with the machine are resumed from their last checkpoint."""
    folder = Path(folder)
    spec = read_spec(folder)
    study = _study(folder, spec)
    base_text = (folder / "base.yaml").read_text()
    trainer = _base_trainer(folder)
    on_gpus = trainer.get("device", "auto") != "cpu"
    gpus = (_cluster_gpus(trainer["ray_address"]) if trainer.get("ray_address") else _visible_gpus()) if on_gpus else []
    pending: list[optuna.Trial] = []  # asked for, waiting for room to start
    _write_state(folder, state="running", pid=os.getpid(), host=socket.gethostname(), started=time.time(),
                 stop_requested=None, gpus=[round(g, 2) for g in gpus])
    while True:
        state = read_state(folder)
        waiting = {t.number for t in pending}
        running = [t for t in study.get_trials(deepcopy=False)
                   if t.state == TrialState.RUNNING and t.number not in waiting]
        if state.get("stop_requested"):
            for t in running:
                _end_trial(study, t, "stopped", "the sweep was stopped")
            for t in pending:
                study.tell(t, state=TrialState.FAIL)
            _write_state(folder, state="stopped", finished=time.time())
            return "stopped"
        for t in running:
            if "run" not in t.user_attrs:
                # Asked for, but the sweep's process ended before it launched the run: the settings go back
                # in the queue (a grid point must still run) and this trial is closed and no longer shown.
                placeholder = optuna.trial.Trial(study, t._trial_id)
                placeholder.set_user_attr("requeued", True)
                placeholder.set_user_attr("hidden", True)
                _end_trial(study, t, "failed", "the sweep's process ended before this trial's run started")
                study.enqueue_trial(dict(t.params))
                continue
            try:
                _watch(study, spec, t)
            except (OSError, ValueError) as e:  # its run folder deleted or unreadable: that trial ends, not the sweep
                _end_trial(study, t, "failed", f"its run could not be read: {e}")
        if spec.early_stopping == "halving":
            _halve(study, spec)
        trials = study.get_trials(deepcopy=False)
        running = [t for t in trials if t.state == TrialState.RUNNING and t.number not in waiting]
        started = sum(t.state != TrialState.WAITING and not t.user_attrs.get("requeued")
                      and "clone_of" not in t.user_attrs for t in trials)
        limit = _at_once(state.get("parallel", spec.parallel), bool(gpus))
        while started < spec.total_trials() and len(running) + len(pending) < limit:
            trial = study.ask()
            for p in spec.params:
                _suggest(trial, p)
            pending.append(trial)
            started += 1
        while pending:
            outcome = _start_trial(study, pending[0], folder, base_text, spec.steps, running, gpus)
            if outcome is None:
                break  # no room yet: it waits for a running trial to end
            pending.pop(0)
            if outcome.state == TrialState.RUNNING:
                running.append(outcome)
        _write_state(folder, state="running")
        if on_change is not None:
            on_change(read_sweep(folder))
        if started >= spec.total_trials() and not running and not pending:
            _write_state(folder, state="finished", finished=time.time())
            return "finished"
        time.sleep(poll_s)


def _at_once(parallel: int, on_gpus: bool) -> int:
    """Trials at once: the number asked; for 0 ("as many as fit"), on GPUs as many as the planner's predicted
    memory allows (the placement decides), on a CPU one per two cores (a run's trainer and worker each keep
    a core busy)."""
    if parallel > 0:
        return parallel
    return 1 << 30 if on_gpus else max(1, (os.cpu_count() or 2) // 2)


# The share of each GPU's memory kept free beyond the planner's predictions, which came within 20% of the
# measured peaks (docs/performance.md).
PACKING_MARGIN = 0.15


def place(need_gib: float, used_gib: list[float], capacity_gib: list[float],
          margin: float = PACKING_MARGIN) -> int | None:
    """The GPU for a trial that needs `need_gib` (the planner's peak), given what the trials already on each
    GPU are predicted to hold: the one with the most room left among those where it fits within
    `1 - margin` of the memory, None when none has room. A trial larger than that goes alone on an empty GPU."""
    fits = [i for i, (used, cap) in enumerate(zip(used_gib, capacity_gib, strict=True))
            if used + need_gib <= cap * (1 - margin) or (used == 0 and need_gib > cap * (1 - margin))]
    return max(fits, key=lambda i: capacity_gib[i] * (1 - margin) - used_gib[i]) if fits else None


def gpu_share(need_gib: float, capacity_gib: float, margin: float = PACKING_MARGIN) -> float:
    """The share of a GPU of `capacity_gib` that a trial predicted to need `need_gib` asks a Ray cluster for: its
    need over what the margin leaves of the memory, rounded up to Ray's granularity (1/10000); a whole GPU where
    that is more, or where the memory is unknown (0). Shares of one GPU add up to at most 1, so Ray keeps the
    margin as `place` does."""
    room = capacity_gib * (1 - margin)
    return 1.0 if need_gib >= room else math.ceil(need_gib / room * 10_000) / 10_000


def _visible_gpus() -> list[float]:
    """Total memory (GiB) of each GPU this process sees; empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(torch.cuda.device_count())]


# How long the cluster's nodes have to answer what their GPUs hold before their GPUs count as whole ones.
CLUSTER_PROBE_S = 120.0


def _cluster_gpus(address: str) -> list[float]:
    """Total memory (GiB) of each GPU of the Ray cluster at `address`, from this process (which has no Ray of its
    own): a task holding 1/100 of a GPU reads it on each node that has GPUs, taking a node's GPUs to be alike.
    A node that cannot say (no CUDA there, or busy past CLUSTER_PROBE_S) gives 0 for each of its GPUs, so a
    trial takes a whole one there. Empty when the cluster has no GPUs."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def total_gib() -> float:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0.0

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) >= 1]
        probe = ray.remote(total_gib)
        refs = [probe.options(num_gpus=0.01, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"],
                                                                                               soft=False)).remote()
                for n in nodes]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=CLUSTER_PROBE_S)
        gpus = []
        for node, ref in zip(nodes, refs, strict=True):
            try:
                gib = ray.get(ref) if ref in ready else 0.0
            except ray.exceptions.RayError:  # the task failed there (torch missing, a broken driver)
                gib = 0.0
            gpus += [gib] * int(node["Resources"]["GPU"])
        return gpus
    finally:
        ray.shutdown()


def _place_trial(cfg: Config, need: float, running: list[optuna.trial.FrozenTrial],
                 gpus: list[float]) -> dict[str, Any] | None:
    """Where a trial of one GPU predicted to need `need` GiB goes, as the user attributes that record it (None while
    no GPU has room): the GPU's index and the prediction, and on a Ray cluster the share of a GPU its worker asks
    Ray for. On one machine the run is pinned to that GPU; on a cluster Ray picks the GPU and holds each GPU's
    shares to 1, so there the shares are what is counted."""
    on = [[t for t in running if t.user_attrs.get("gpu") == i] for i in range(len(gpus))]
    if cfg.trainer.ray_address:
        share = gpu_share(need, min(gpus))
        gpu = place(share, [sum(t.user_attrs.get("gpu_share", 1.0) for t in ts) for ts in on], [1.0] * len(gpus),
                    margin=0.0)
        where: dict[str, Any] = {"gpu_share": share}
    else:
        gpu = place(need, [sum(t.user_attrs.get("predicted_gib", 0.0) for t in ts) for ts in on], gpus)
        where = {}
    if gpu is None:
        return None
    return {"gpu": gpu, "predicted_gib": round(need, 2), **where}


def _pin(cfg: Config, where: dict[str, Any]) -> str | None:
    """The CUDA_VISIBLE_DEVICES of a trial placed at `where` on this machine; on a cluster (nothing to pin: Ray
    picks the GPU) its config asks for its share instead."""
    if cfg.trainer.ray_address:
        cfg.trainer.gpu_share = where["gpu_share"]
        return None
    return str(where["gpu"])


def _start_trial(study: optuna.Study, trial: optuna.Trial, folder: Path, base_text: str, steps: int | None,
                 running: list[optuna.trial.FrozenTrial], gpus: list[float]) -> optuna.trial.FrozenTrial | None:
    """Launch a trial's run if there is room (None when it must wait): a trial of several GPUs, or one retried
    after running out of memory, runs alone; on GPUs, one of one GPU goes where `place` puts the planner's
    prediction. A trial whose config cannot start is recorded as failed."""
    try:
        cfg = trial_config(base_text, [], dict(trial.params), steps)
    except ConfigError as e:
        trial.set_user_attr("reason", f"could not start: {'; '.join(e.problems)}")
        study.tell(trial, state=TrialState.FAIL)
        return study.get_trials(deepcopy=False)[trial.number]
    workers = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    alone = trial.user_attrs.get("alone") or workers > 1
    if running and (alone or any(t.user_attrs.get("alone") for t in running)):
        return None
    devices = None
    if gpus and cfg.trainer.device != "cpu" and workers == 1:
        where = _place_trial(cfg, _predicted_gib(cfg, gpus[0]), running, gpus)
        if where is None:
            return None
        devices = _pin(cfg, where)
        for k, v in where.items():
            trial.set_user_attr(k, v)
        trial.set_user_attr("beside", [t.number for t in running if t.user_attrs.get("gpu") == where["gpu"]])
    try:
        run = launcher.launch(cfg, name=f"{folder.name}-{trial.number:03d}", runs_root=folder.parent.parent,
                              sweep={"name": folder.name, "trial": trial.number}, devices=devices)
    except (ConfigError, OSError) as e:
        trial.set_user_attr("reason", f"could not start: {e}")
        study.tell(trial, state=TrialState.FAIL)
    else:
        trial.set_user_attr("run", str(run))
    return study.get_trials(deepcopy=False)[trial.number]


def _predicted_gib(cfg: Config, capacity_gib: float) -> float:
    """The planner's peak reserved memory for the trial's worker; a whole GPU when it cannot say."""
    from backend.services import planner

    try:
        return planner.plan(cfg).need_gib
    except ValueError:  # a ConfigError or ModelError: nothing to predict from
        return capacity_gib


def _suggest(trial: optuna.Trial, p: SweepParam) -> Any:
    if p.values is not None:
        return trial.suggest_categorical(p.key, p.values)
    if get_value_type(p.key) is int:
        return trial.suggest_int(p.key, round(p.low), round(p.high), log=p.log)
    return trial.suggest_float(p.key, p.low, p.high, log=p.log)


def _metric_steps(run: Path, metric: str) -> list[tuple[int, float]]:
    """(step, value) of every logged step that has the metric, in order."""
    try:
        rows = read_metrics(run)
    except OSError:
        return []
    out = []
    for row in rows:
        value = row.get(metric)
        if isinstance(value, int | float) and math.isfinite(value) and "step" in row:
            out.append((int(row["step"]), float(value)))
    return out


def _watch(study: optuna.Study, spec: SweepSpec, frozen: optuna.trial.FrozenTrial) -> None:
    """Report a running trial's new metric values; stop it if the pruner says so; record its end."""
    run = Path(frozen.user_attrs["run"])
    trial = optuna.trial.Trial(study, frozen._trial_id)
    info = launcher.read_run(run)
    status = info["status"]
    for step, value in _metric_steps(run, spec.metric):
        if step in frozen.intermediate_values:
            continue
        trial.report(value, step)
        if spec.early_stopping == "median" and status.get("state") in launcher.ACTIVE and trial.should_prune():
            launcher.stop(run)
            trial.set_user_attr("reason", _pruned_reason(spec, step, value))
            study.tell(trial, state=TrialState.PRUNED)
            return
    state = status.get("state")
    if state == "succeeded":
        values = _metric_steps(run, spec.metric)
        if values:
            study.tell(trial, values[-1][1])
        else:
            trial.set_user_attr("reason", f"the run logged no {spec.metric}")
            study.tell(trial, state=TrialState.FAIL)
    elif state == "failed" and status.get("error") == launcher.GONE_ERROR and not frozen.user_attrs.get("resumed"):
        # Killed with the machine or by hand: it continues from its last checkpoint, once.
        try:
            launcher.resume(run)
            trial.set_user_attr("resumed", True)
        except ConfigError as e:
            _end_trial(study, frozen, "failed", f"could not resume: {e}")
    elif state == "failed" and OUT_OF_MEMORY.search(status.get("error") or "") and not frozen.user_attrs.get("alone"):
        _retry_alone(study, frozen, status["error"])
    elif state == "failed":
        _end_trial(study, frozen, "failed", status.get("error") or "the run failed")
    elif state == "stopped":  # by hand, or by `_halve` before the sweep's process could record it
        _end_trial(study, frozen, "stopped", frozen.user_attrs.get("reason") or "stopped by hand")


# How a worker's CUDA out-of-memory error reads in a run's status (torch.OutOfMemoryError's message).
OUT_OF_MEMORY = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)


def _retry_alone(study: optuna.Study, frozen: optuna.trial.FrozenTrial, error: str) -> None:
    """A trial that ran out of memory: record the planner's miss and queue its settings to run again with
    no other trial beside it (once; a retry that runs out again fails)."""
    trial = optuna.trial.Trial(study, frozen._trial_id)
    trial.set_user_attr("requeued", True)
    beside = frozen.user_attrs.get("beside") or []
    predicted = frozen.user_attrs.get("predicted_gib")
    miss = (f"the planner predicted {predicted:.1f} GiB for it" if predicted is not None
            else "the planner was not asked (not one GPU)")
    others = f" beside trial(s) {', '.join(f'#{n}' for n in beside)}" if beside else ""
    _end_trial(study, frozen, "failed", f"out of memory{others} ({miss}); retried alone. {launcher.one_line(error)}")
    study.enqueue_trial(dict(frozen.params), user_attrs={"alone": True, "retry_of": frozen.number})


def _pruned_reason(spec: SweepSpec, step: int, value: float) -> str:
    return (f"stopped early at step {step}: {spec.metric} {value:.4g} is worse than the median of the finished "
            "trials at that step")


def _halve(study: optuna.Study, spec: SweepSpec) -> None:
    """Judge the rungs every running trial has reached (`halving.judge`; clones add to the sweep's trials):
    record each verdict's value on the trial, and stop the trials outside their rung's quota, all at once."""
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("hidden")]
    rung_trials = [halving.RungTrial(
        number=t.number, curve=dict(t.intermediate_values), judged=list(t.user_attrs.get("rungs", [])),
        running=t.state == TrialState.RUNNING and "run" in t.user_attrs,
        counts=t.state != TrialState.FAIL and not t.user_attrs.get("halved")) for t in trials]
    total = spec.total_trials() + sum("clone_of" in t.user_attrs for t in trials)
    verdicts = halving.judge(rung_trials, max(1, spec.min_steps), spec.direction == "max", total)
    by_number = {t.number: t for t in trials}
    judged = {t.number: list(t.judged) for t in rung_trials}
    stopping = []
    for v in verdicts:
        frozen = by_number[v.number]
        trial = optuna.trial.Trial(study, frozen._trial_id)
        judged[v.number].append(v.value)
        trial.set_user_attr("rungs", judged[v.number])
        if not v.goes_on:
            step = max(frozen.intermediate_values)
            trial.set_user_attr("halved", True)
            trial.set_user_attr("reason", (
                f"stopped early at step {step}: {spec.metric} {v.value:.4g} at step {v.rung_step} is not among the "
                f"best {v.kept} of the {v.of} values logged there (successive halving keeps {v.kept} of the "
                f"{total} trials at that step)"))
            stopping.append(frozen)
    if not stopping:
        return
    # Stopped one by one, each would wait for the one before to let go of its GPU memory and processes.
    with ThreadPoolExecutor(max_workers=len(stopping)) as pool:
        list(pool.map(_stop_quietly, [t.user_attrs["run"] for t in stopping]))
    for frozen in stopping:
        study.tell(optuna.trial.Trial(study, frozen._trial_id), state=TrialState.PRUNED)


def _stop_quietly(run: str) -> None:
    with contextlib.suppress(ValueError, OSError):  # on another host, or its folder gone: it is pruned anyway
        launcher.stop(run)


def _end_trial(study: optuna.Study, frozen: optuna.trial.FrozenTrial, how: str, reason: str) -> None:
    """Stop the trial's run if it still runs and record why it ended; a trial that logged the metric counts
    as pruned (its values stay comparable), one that did not as failed."""
    run = frozen.user_attrs.get("run")
    if run and how == "stopped":
        _stop_quietly(run)
    trial = optuna.trial.Trial(study, frozen._trial_id)
    trial.set_user_attr("reason", reason)
    study.tell(trial, state=TrialState.PRUNED if how == "stopped" and frozen.intermediate_values
               else TrialState.FAIL)


def clone_trial(folder: str | Path, number: int, cfg: Config) -> int:
    """Fork trial `number`'s run from its latest checkpoint with the edited `cfg` (its run's config, changed)
    into the running sweep as a new trial, which the sweep watches, ranks and may stop like any other; returns
    the new trial's number. Its settings are the parent's, with the varied keys the edit changed. Raises
    SweepError when the sweep is not running or the trial has no checkpoint, ConfigError when `cfg` cannot
    start."""
    folder = Path(folder)
    sweep = read_sweep(folder)
    if sweep["state"].get("state") not in ("starting", "running"):
        raise SweepError(f"sweep {folder.name} is not running: a clone joins a running sweep, resume it first")
    parent = next((t for t in sweep["trials"] if t.number == number and t.run), None)
    if parent is None:
        raise SweepError(f"sweep {folder.name} has no trial #{number} with a run")
    spec = sweep["spec"]
    edits = {p.key: get_value(cfg, p.key) for p in spec.params if get_value(cfg, p.key) != parent.values.get(p.key)}
    study = _study(folder, spec)
    trials = study.get_trials(deepcopy=False)
    attrs: dict[str, Any] = {"clone_of": number, "edits": edits}
    devices = None
    # The GPUs the sweep's process found (the cluster's, on a cluster), not this process's.
    gpus = sweep["state"].get("gpus") or []
    if gpus and cfg.trainer.device != "cpu":
        need = _predicted_gib(cfg, gpus[0])
        where = _place_trial(cfg, need, [t for t in trials if t.state == TrialState.RUNNING], gpus)
        if where is None:
            raise SweepError(f"no GPU has room for the clone now (the planner predicts {need:.1f} GiB): stop a "
                             "trial first")
        devices = _pin(cfg, where)
        attrs.update(where)
    checkpoint = _copy_latest_checkpoint(number, Path(parent.run), folder / "clones")
    run = launcher.fork(parent.run, checkpoint, cfg, launcher.fork_name(parent.run, checkpoint),
                        sweep={"name": folder.name, "clone_of": number}, devices=devices)
    # Added whole, run included: a running trial without one would look, to the sweep, like one its process
    # asked for and never launched. The parent's settings keep the study's distributions; the edits are shown.
    parent_trial = trials[number]
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.RUNNING, params=dict(parent_trial.params), distributions=dict(parent_trial.distributions),
        user_attrs={"run": str(run), **attrs}))
    return study.get_trials(deepcopy=False)[-1].number


def _copy_latest_checkpoint(number: int, run: Path, clones: Path, attempts: int = 3) -> Path:
    """A copy of the run's newest checkpoint under `clones`: the parent goes on training and deletes older
    checkpoints as it saves newer ones (trainer.max_checkpoints_to_keep), which a clone still loading from
    the original lost. One deleted while it is copied is given up for the newer one."""
    for _ in range(attempts):
        checkpoint = latest_checkpoint(run)
        if checkpoint is None:
            raise SweepError(f"trial #{number} has no checkpoint yet to clone from: its run saves one every "
                             f"trainer.save_freq steps")
        copy = clones / f"{run.name}-{checkpoint.name}" / checkpoint.name
        if copy.is_dir():
            return copy
        try:
            shutil.copytree(checkpoint, copy.with_name(copy.name + ".partial"))
        except (FileNotFoundError, shutil.Error):
            shutil.rmtree(copy.with_name(copy.name + ".partial"), ignore_errors=True)
            continue
        copy.with_name(copy.name + ".partial").rename(copy)
        return copy
    raise SweepError(f"trial #{number}'s checkpoints were replaced faster than they could be copied: "
                     "try again, or raise its trainer.save_freq")


# ---- reading a sweep back ----

@dataclass
class TrialRow:
    number: int
    values: dict[str, Any]
    state: str
    run: str | None
    step: int | None
    value: float | None
    reason: str | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)
    clone_of: int | None = None


def read_sweep(folder: str | Path) -> dict:
    """Everything a sweep's page shows: {"name", "path", "spec", "state" (the sweep process's status, failed
    if its process is gone), "trials" (TrialRow, in order), "best" (the best finished trial's row or None)}."""
    folder = Path(folder)
    spec = read_spec(folder)
    study = _study(folder, spec)
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("hidden"):
            continue
        run = t.user_attrs.get("run")
        curve = sorted(t.intermediate_values.items())
        # A queued grid point has no params yet: Optuna keeps the values it will take as "fixed_params".
        values = {**(dict(t.params) or dict(t.system_attrs.get("fixed_params") or {})), **t.user_attrs.get("edits", {})}
        rows.append(TrialRow(number=t.number, values=values, state=t.state.name.lower(), run=run,
                             step=curve[-1][0] if curve else None,
                             value=t.value if t.state == TrialState.COMPLETE else (curve[-1][1] if curve else None),
                             reason=t.user_attrs.get("reason"), curve=curve, clone_of=t.user_attrs.get("clone_of")))
    done = [r for r in rows if r.state == "complete" and r.value is not None]
    pick = max if spec.direction == "max" else min
    best = pick(done, key=lambda r: r.value) if done else None
    state = read_state(folder)
    here = state.get("host") == socket.gethostname()
    if state.get("state") in ("starting", "running") and here and not _alive(state.get("pid")):
        state = {**state, "state": "interrupted"}
    return {"name": folder.name, "path": folder, "spec": spec, "state": state, "trials": rows, "best": best}


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    if pid in _processes:
        return _processes[pid].poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_sweep(folder: str | Path, *, with_runs: bool = False) -> None:
    """Remove a sweep's folder, and with `with_runs` its trials' run directories too (a trial still running is
    stopped first); without it the trials stay as ordinary runs. Refuses a sweep whose process is running:
    stop it first, or its next poll would write the folder again."""
    folder = Path(folder)
    sweep = read_sweep(folder)
    if sweep["state"].get("state") in ("starting", "running"):
        raise SweepError(f"sweep {folder.name} is running: stop it before deleting it")
    if with_runs:
        for t in sweep["trials"]:
            if t.run:
                launcher.delete(t.run, folder.parent.parent)
    shutil.rmtree(folder)


def list_sweeps(runs_root: str | Path) -> list[Path]:
    """The sweep folders under `runs_root`, newest first."""
    root = Path(runs_root) / SWEEPS_DIR
    try:
        found = [p for p in root.iterdir() if (p / "sweep.yaml").is_file() and not p.name.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def best_config(folder: str | Path) -> Config | None:
    """The base config with the best finished trial's values: what "promote" puts on the Config page."""
    sweep = read_sweep(folder)
    best = sweep["best"]
    if best is None:
        return None
    return trial_config((Path(folder) / "base.yaml").read_text(), [], best.values, sweep["spec"].steps)

