"""Launching runs in the background and reading them back: everything the workbench's run pages do.

A run is `python -m backend train <run>/config.yaml --run-dir <run> --quiet`, started as a detached
process in its own session (so closing the browser or the UI's terminal changes nothing), with its
stdout and stderr in `<run>/logs/`; a run whose config names `trainer.ray_address` is submitted to that
cluster as a Ray job instead, so it runs inside the cluster and outlives the workbench's machine. The
launcher writes `config.yaml` and a `queued` status.json, then records the child's pid and process group
(or the job); from there on the trainer owns status.json, and everything here reads the run directory
back, so runs started from the CLI show up the same way.

Readers never write: a run whose process died without a final status is *reported* as failed by
`list_runs` / `read_run`, and status.json is left as the process left it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from backend.core.config import Config, ConfigError, load_config, to_yaml, validate_config
from backend.core.runs import (
    NICE_ENV,
    STATES,
    RunDir,
    atomic_write_text,
    checkpoint_step,
    config_get,
    latest_checkpoint,
    list_checkpoints,
    new_run_dir,
    read_metrics,
    read_status,
)
from backend.core.workspace import PathError, check_name
from backend.engine.checks import check_or_raise

ACTIVE = ("queued", "running")
GONE_ERROR = "the training process is gone (killed or crashed) without a final status"
GONE_AFTER_S = 60.0  # without a pid to ask, a heartbeat this old means the run is dead
# A default for stage_info's warning: a working trainer writes status about once a second, but loading
# a large model or saving a checkpoint writes nothing for a while.
DEFAULT_STALL_AFTER_S = 120.0
SCORE_KEY = "critic/score/mean"
# Runs yield the CPU to the workbench: on a 2-core machine eight runs at the UI's priority left it a
# ninth of the CPU, and a page took 13 s to answer. The trainer lowers its own priority once its Ray and
# workers are up (Ray gives a node 30 s to start, which a run niced from its first instant missed under
# load); see trainer.yield_cpu.
RUN_NICE = 10
# How long a stopped trainer gets to end on its own. Once its stop handler is in place it records `stopped`
# within half a second in every phase; before that (Python still starting) SIGTERM ends it at once. One that
# lingers is stuck in a call that does not return to Python (one of Ray's start-up calls, now and then), and
# is killed: every file of the run directory is replaced atomically, so no moment is unsafe for that.
STOP_GRACE_S = 1.5

# Children this process started. A child that exits stays a zombie until its parent waits for it, and
# os.kill(zombie, 0) succeeds, so a killed run would look alive for as long as the UI runs; polling the
# Popen reaps it.
_children: dict[int, subprocess.Popen] = {}


# ---- launching ----

def launch(cfg: Config, *, name: str = "", runs_root: str | Path | None = None,
           sweep: dict[str, Any] | None = None, devices: str | None = None) -> Path:
    """Start a new run of `cfg` in the background and return its run directory.

    Validates first (schema, cross-field rules, files, model); on any problem raises ConfigError and
    creates nothing. `name` (optional) is appended to the timestamped folder name and must be letters,
    digits, '.', '_' and '-'. The run directory goes under `runs_root` (default: cfg.trainer.runs_root).
    `sweep` ({"name", "trial"}) marks a sweep's trial in its status.json. `devices` pins the run to those
    GPUs (CUDA_VISIBLE_DEVICES, e.g. "1"), recorded in status.json so that a resume keeps them.
    """
    extra = {**({"sweep": sweep} if sweep else {}), **({"devices": devices} if devices is not None else {})}
    return _launch(cfg, name=name, runs_root=runs_root, extra_status=extra)


def _launch(cfg: Config, *, name: str, runs_root: str | Path | None, extra_status: dict[str, Any],
            folder: str = "") -> Path:
    """Validate, make the run directory (runs_root/<date>-<name>, or runs_root/<folder> exactly) and start."""
    if folder or name:
        try:
            check_name(folder or name, "run name")
        except PathError as e:
            raise ConfigError([str(e)]) from None
    validate_config(cfg)
    check_or_raise(cfg)
    root = Path(runs_root if runs_root is not None else cfg.trainer.runs_root)
    run = _make_named_run_dir(root, folder) if folder else _make_run_dir(root, name)
    atomic_write_text(run.config, to_yaml(cfg))
    # pid=None: write_status would otherwise record this (the UI's) pid until the child's is known.
    run.write_status("queued", pid=None, pgid=None, created=time.time(), stage="queued",
                     stage_started=time.time(), **extra_status)
    _spawn(run)
    return run.root


def _make_run_dir(root: Path, name: str) -> RunDir:
    # mkdir without exist_ok: two launches in the same second must not share a folder.
    while True:
        path = Path(os.path.abspath(new_run_dir(root, name)))
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return RunDir(path).create()


def _make_named_run_dir(root: Path, folder: str) -> RunDir:
    path = Path(os.path.abspath(root / folder))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
    except FileExistsError:
        raise ConfigError([f"a run named {folder} already exists in {root}: choose another name"]) from None
    return RunDir(path).create()


def _spawn(run: RunDir) -> None:
    """Start the trainer for `run`: submitted as a Ray job when its config names a cluster, else detached here."""
    cmd = [sys.executable, "-m", "backend", "train", str(run.config), "--run-dir", str(run.root), "--quiet"]
    run.logs.mkdir(parents=True, exist_ok=True)
    devices = (read_status(run.root) or {}).get("devices")
    pinned = {"CUDA_VISIBLE_DEVICES": devices} if devices is not None else {}
    address = (_read_yaml(run.config) or {}).get("trainer", {}).get("ray_address")
    if address:
        job = submit_job(address, cmd, run.logs / "stdout.log", run.logs / "stderr.log",
                         {NICE_ENV: str(RUN_NICE), **pinned}, on_error=lambda e: run.write_status(
                             "failed", stage="failed", finished=time.time(), error=f"could not submit the run: {e}"))
        run.write_status((read_status(run.root) or {}).get("state", "queued"), ray_job=job)
        return
    try:
        with open(run.logs / "stdout.log", "ab") as out, open(run.logs / "stderr.log", "ab") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=os.getcwd(),
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", NICE_ENV: str(RUN_NICE), **pinned},
                                    start_new_session=True,
                                    close_fds=True)
    except OSError as e:
        run.write_status("failed", stage="failed", finished=time.time(), error=f"could not start the run: {e}")
        raise
    _children[proc.pid] = proc
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:  # already exited; with start_new_session it led its own group
        pgid = proc.pid
    # Keep whatever state the child may already have written; only add who it is.
    state = (read_status(run.root) or {}).get("state", "queued")
    run.write_status(state if state in STATES else "queued", pid=proc.pid, pgid=pgid)


# How long a submission waits for a head's job agent to come up (seconds after `ray start` on a busy machine).
JOB_AGENT_WAIT_S = 20.0
# What a job's process takes from the workbench's environment, besides what the job sets: where models are
# cached and Hugging Face's home. Not RAY_AUTH_MODE: the job runs inside the cluster, with the cluster's own
# authentication; the workbench's (which Ray sets to token in any process that started a Ray of its own)
# would make the job's processes speak a mode the cluster does not, and the job never start.
JOB_ENV = ("GRPO_WB_CACHE", "GRPO_WB_HOME", "HF_HOME", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
           "NVSHMEM_DISABLE_NVLS")


def submit_job(address: str, cmd: list[str], stdout: Path, stderr: Path, env: dict[str, str],
               on_error: Callable[[Exception], Any]) -> dict[str, str]:
    """Submit `cmd` to the Ray cluster at `address` as a job (Ray's job submission API) and return
    {"address", "id"}. The job's process runs on the cluster's head node with this interpreter, in this
    working folder and with its output appended to `stdout` / `stderr`, so the head must see the same paths
    (the workbench on the head node, or the project and the runs on storage the head shares). On failure,
    `on_error(e)` records it and ConfigError says what to do."""
    from ray.job_submission import JobSubmissionClient

    quoted = " ".join(map(shlex.quote, cmd))
    entrypoint = (f"cd {shlex.quote(os.getcwd())} && exec {quoted} >> {shlex.quote(str(stdout))} "
                  f"2>> {shlex.quote(str(stderr))}")
    # The trainer inside joins the cluster with a runtime env of its own that names some of these variables again
    # (NCCL's, HF_HOME): Ray refuses such a driver unless told to combine the two.
    env = {"PYTHONUNBUFFERED": "1", "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1",
           **{k: os.environ[k] for k in JOB_ENV if k in os.environ}, **env}
    try:
        if plain := re.fullmatch(r"([\w.-]+):(\d+)", address):
            # Ray retries an unreachable head for about 40 s; a closed port says so at once.
            socket.create_connection((plain[1], int(plain[2])), timeout=5).close()
        client = JobSubmissionClient(address)
        deadline = time.monotonic() + JOB_AGENT_WAIT_S
        while True:
            try:
                job = client.submit_job(entrypoint=entrypoint, runtime_env={"env_vars": env})
                break
            except RuntimeError as e:
                # A head that has just started answers before its job agent does ("No available agent to
                # submit job, please try again later").
                if "try again later" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
    except Exception as e:  # Ray raises ConnectionError, RuntimeError or its own errors for an unreachable head
        on_error(e)
        raise ConfigError([f"trainer.ray_address={address}: could not submit a Ray job there ({one_line(str(e))}). "
                           "The head must run Ray's dashboard (ray start --head with ray[default] installed); "
                           "with token authentication, export RAY_AUTH_MODE=token here with the head's token in "
                           "~/.ray/auth_token"]) from None
    return {"address": address, "id": job}


def stop_job(job: dict[str, str]) -> None:
    """Ask the cluster to stop a job: Ray sends SIGTERM to its processes, then kills what is left."""
    from ray.job_submission import JobSubmissionClient

    JobSubmissionClient(job["address"]).stop_job(job["id"])


def request_dump(run_dir: str | Path) -> None:
    """Ask a running run to save its next step's update for `python -m backend replay` (it takes the request
    as that step starts and writes dumps/step_N when the step ends)."""
    RunDir(Path(run_dir)).dump_request.touch()


def one_line(text: str, n: int = 300) -> str:
    """`text` on one line, cut to `n` characters: an error inside a message or a table cell."""
    flat = " ".join(text.split())
    return flat if len(flat) <= n else flat[: n - 1] + "…"


def resume(run_dir: str | Path, *, overrides: Sequence[str] = ()) -> Path:
    """Continue a run in its own directory from its last checkpoint (trainer.resume_mode=auto).

    `overrides` are extra key.path=value settings, e.g. a higher trainer.total_training_steps to train
    a finished run further. config.yaml is rewritten with them, since it is the config the run uses.
    Raises ConfigError if the run is still queued or running, or the config no longer validates.
    """
    run = RunDir(Path(os.path.abspath(run_dir)))
    status = read_status(run.root) or {}
    state, _, _ = _effective_state(status, time.time(), GONE_AFTER_S)
    if state in ACTIVE:
        raise ConfigError([f"run {run.root.name} is still {state} (pid {status.get('pid')}): stop it before "
                           "resuming it"])
    cfg = load_config(run.config, ["trainer.resume_mode=auto", *overrides])
    last = latest_checkpoint(run.root)
    reached = (checkpoint_step(last) or 0) if last is not None else 0
    target = cfg.trainer.total_training_steps
    if target and reached >= target:
        more = _train_to(reached, target, cfg.trainer.save_freq)
        raise ConfigError([f"run {run.root.name} has trained to step {reached} (its last checkpoint): resuming it to "
                           f"trainer.total_training_steps={target} would train nothing. Ask for a step beyond "
                           f"{reached}, e.g. trainer.total_training_steps={more}"])
    check_or_raise(cfg)
    atomic_write_text(run.config, to_yaml(cfg))
    if last is None:
        # Nothing to continue from: the run starts over, so the old attempt's lines would repeat steps.
        run.truncate_metrics(-1)
    run.write_status("queued", pid=None, pgid=None, stage="queued", stage_started=time.time(), error=None,
                     traceback=None, finished=None, note=None, stop_requested=None)
    _spawn(run)
    return run.root


def fork(run_dir: str | Path, checkpoint: str | Path, cfg: Config, name: str = "", *,
         runs_root: str | Path | None = None, sweep: dict[str, Any] | None = None,
         devices: str | None = None) -> Path:
    """Start a NEW run from a checkpoint of another run, with a (possibly edited) config.

    `checkpoint` is a checkpoint folder, or a name such as "step_20" inside run_dir/checkpoints.
    The new run goes next to its parent (or under `runs_root`), in a folder named `name`, by default
    `fork_name`'s; its status.json records "forked_from": {"run": parent's folder name, "checkpoint":
    checkpoint path}, and `sweep` and `devices` as `launch` does. `cfg` is not modified.
    """
    run_dir = Path(run_dir)
    ckpt = _checkpoint_path(run_dir, checkpoint)
    root = Path(runs_root if runs_root is not None else run_dir.parent)
    step, target = checkpoint_step(ckpt) or 0, cfg.trainer.total_training_steps
    if target and step >= target:
        raise ConfigError([f"{ckpt.name} is at step {step}: a fork of it to trainer.total_training_steps={target} "
                           f"would train nothing. Ask for a step beyond {step}, e.g. trainer.total_training_steps="
                           f"{_train_to(step, target, cfg.trainer.save_freq)}"])
    cfg = copy.deepcopy(cfg)
    cfg.trainer.resume_mode = "resume_path"
    cfg.trainer.resume_from_path = str(ckpt)
    return _launch(cfg, name="", folder=name or fork_name(run_dir, ckpt, root), runs_root=root,
                   extra_status={"forked_from": {"run": run_dir.name, "checkpoint": str(ckpt)},
                                 **({"sweep": sweep} if sweep else {}),
                                 **({"devices": devices} if devices is not None else {})})


def fork_config_text(run_dir: str | Path, checkpoint: str | Path) -> str:
    """The config a fork of `checkpoint` starts from (the run's config.yaml as YAML), trained to a step
    beyond the checkpoint's: the run's total when it lies beyond, else as `resume_steps` offers."""
    run_dir = Path(run_dir)
    try:
        cfg = load_config(run_dir / "config.yaml", validate=False)
    except ConfigError:  # the user fixes it in the fork's editor, which says what is wrong
        return (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").is_file() else ""
    step = checkpoint_step(_checkpoint_path(run_dir, checkpoint)) or 0
    target = cfg.trainer.total_training_steps
    if target and step >= target:
        cfg.trainer.total_training_steps = _train_to(step, target, cfg.trainer.save_freq)
    return to_yaml(cfg)


def fork_name(run_dir: str | Path, checkpoint: str | Path, runs_root: str | Path | None = None) -> str:
    """A fork's default folder name: `<parent>-fork-<step>`, with "-2", "-3"... when that is taken in
    `runs_root` (default: next to the parent). A fork of a fork takes its parent's base name, so names stay
    short enough for tables and pickers to show whole; status.json's forked_from keeps the lineage."""
    run_dir = Path(run_dir)
    ckpt = _checkpoint_path(run_dir, checkpoint)
    root = Path(runs_root if runs_root is not None else run_dir.parent)
    step = checkpoint_step(ckpt)
    suffix = f"-fork-{step if step is not None else ckpt.name}"
    base = re.sub(r"-fork-\d+(-\d+)?$", "", run_dir.name)[:_NAME_MAX - len(suffix) - 3] + suffix
    name, k = base, 1
    while (root / name).exists():
        k += 1
        name = f"{base}-{k}"
    return name


_NAME_MAX = 64  # check_name's limit


def _checkpoint_path(run_dir: Path, checkpoint: str | Path) -> Path:
    ckpt = Path(checkpoint)
    if len(ckpt.parts) == 1 and (run_dir / "checkpoints" / ckpt).is_dir():
        ckpt = run_dir / "checkpoints" / ckpt
    return ckpt


# ---- stopping and deleting ----

def stop(run_dir: str | Path, grace_s: float = STOP_GRACE_S, *, wait: bool = True) -> str:
    """Stop a run; it ends as `stopped`, never `failed`.

    SIGTERM goes to the trainer alone, which records `stopped`, kills its Ray and workers and exits. Once
    it is gone, or `grace_s` after the signal if it lingers, whatever is left of the run's process group
    is killed, and `stopped` is recorded here if the trainer could not record it. status.json keeps the
    request ("stop_requested"), so readers show the run as stopping, and as stopped should its process end
    without a word. Returns the final state; with wait=False, "stopping" at once, and a thread of this
    process finishes the stop (a page must not wait for it). A run that already ended is left alone and its
    state returned.
    """
    run = RunDir(run_dir)
    status = read_status(run.root) or {}
    state = status.get("state", "unknown")
    if state not in ACTIVE:
        return state
    host = status.get("host")
    job = status.get("ray_job")
    if job and (not status.get("pid") or host != socket.gethostname()):  # not started yet, or on another node
        return _stop_job(run, job, grace_s + JOB_STOP_S, wait)
    if host and host != socket.gethostname():
        raise ValueError(f"run {run.root.name} runs on host {host}, not here: stop it there")
    pid, pgid = status.get("pid"), status.get("pgid")
    if not _stop_requested(status):
        run.write_status(state, stop_requested={"pid": pid, "at": time.time()})
    # The trainer only: it ends its own Ray. Signalled too, Ray's processes went down at the same moment
    # in their own ways, and the trainer's calls into them failed before it had recorded the stop.
    _signal(pid, None, signal.SIGTERM)
    if wait:
        return _finish_stop(run, pid, pgid, grace_s)
    threading.Thread(target=_finish_stop, args=(run, pid, pgid, grace_s), name=f"stop {run.root.name}",
                     daemon=True).start()
    return "stopping"


# Ray gives a stopped job's processes 3 s after SIGTERM before it kills them (RAY_JOB_STOP_WAIT_TIME_S).
JOB_STOP_S = 10.0


def _stop_job(run: RunDir, job: dict[str, str], timeout_s: float, wait: bool) -> str:
    """Stop a run that is a Ray job on another node (or not started yet) through the cluster, and wait for the
    trainer's final status; `stopped` is recorded here if it ends without one."""
    status = read_status(run.root) or {}
    if not _stop_requested(status):
        run.write_status(status.get("state", "queued"), stop_requested={"pid": status.get("pid"), "at": time.time()})
    stop_job(job)
    if not wait:
        return "stopping"
    deadline = time.monotonic() + timeout_s
    while (read_status(run.root) or {}).get("state") in ACTIVE and time.monotonic() < deadline:
        time.sleep(0.1)
    status = read_status(run.root) or {}
    if status.get("state") in ACTIVE:
        status = run.write_status("stopped", stage="stopped", finished=time.time(), error=None,
                                  note="stopped: its Ray job was stopped before the trainer wrote its final status")
    return status["state"]


def _finish_stop(run: RunDir, pid: int | None, pgid: int | None, grace_s: float) -> str:
    """Wait for a signalled trainer to end, kill what is left of its process group, record `stopped`."""
    ended = _wait_gone(pid, None, grace_s)
    if pgid and _group_alive(pgid):
        _signal(None, pgid, signal.SIGKILL)
    elif not ended:
        _signal(pid, None, signal.SIGKILL)
    _wait_gone(pid, pgid, 10.0)
    status = read_status(run.root) or {}
    # A dashboard read between the process's end and this line may have recorded it as gone; it was stopped.
    if status.get("state", "queued") in ACTIVE or status.get("error") == GONE_ERROR:
        note = (f"did not stop within {grace_s:g} s of SIGTERM and was killed" if not ended
                else "the process ended without writing its final status")
        status = run.write_status("stopped", stage="stopped", finished=time.time(), note=f"stopped: {note}",
                                  error=None)
    return status["state"]


def _stop_requested(status: dict) -> bool:
    """Whether a stop was asked of the process status.json names (a resumed run is another process)."""
    request = status.get("stop_requested")
    return isinstance(request, dict) and request.get("pid") == status.get("pid")


def _signal(pid: int | None, pgid: int | None, sig: int) -> None:
    try:
        # Only a group the launcher created is signalled as a group: a CLI run shares its terminal's
        # group, and killing that would take the user's shell with it.
        if pgid:
            os.killpg(pgid, sig)
        elif pid:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int | None, pgid: int | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if not (_group_alive(pgid) if pgid else _alive(pid)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def delete(run_dir: str | Path, runs_root: str | Path) -> None:
    """Stop the run if it is running, then remove its folder. Refuses (ValueError) a folder that is not
    inside `runs_root`; a folder already gone is not an error."""
    root = Path(runs_root).resolve()
    target = Path(run_dir).resolve()
    if root not in target.parents:
        raise ValueError(f"{run_dir} is not inside the runs folder {root}: refusing to delete it")
    if not target.exists():
        return
    status = read_status(target) or {}
    if _effective_state(status, time.time(), GONE_AFTER_S)[0] in ACTIVE:
        stop(target)
    shutil.rmtree(target)


# ---- reading runs back ----

@dataclass
class RunSummary:
    """One row of the runs table. `state` is one of runs.STATES, or "unknown" without a status.json."""

    name: str
    path: Path
    state: str
    step: int
    total_steps: int | None
    score: float | None           # the last critic/score/mean
    started: float | None         # epoch seconds
    duration_s: float | None
    error: str | None
    stage: str
    checkpoints: list[str] = field(default_factory=list)  # folder names, oldest first: "step_2", ...


def list_runs(runs_root: str | Path, *, now: float | None = None,
              stale_after_s: float = GONE_AFTER_S) -> list[RunSummary]:
    """Every run directory under `runs_root`, newest first. Tolerates runs deleted or half-written
    while listing. A queued/running run whose process is gone is reported "failed" (see
    `effective_state`); nothing is written."""
    root = Path(runs_root)
    now = time.time() if now is None else now
    try:
        folders = [p for p in root.iterdir() if not p.name.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        return []
    _reap()
    found: list[tuple[float, RunSummary]] = []
    for folder in folders:
        try:
            summary, order = _summarize(folder, now, stale_after_s)
        except OSError:  # deleted underneath us
            continue
        if summary is not None:
            found.append((order, summary))
    return [s for _, s in sorted(found, key=lambda x: x[0], reverse=True)]


def _summarize(folder: Path, now: float, stale_after_s: float) -> tuple[RunSummary | None, float]:
    if not folder.is_dir() or not ((folder / "status.json").exists() or (folder / "config.yaml").exists()):
        return None, 0.0
    status = read_status(folder) or {}
    state, error, gone = _effective_state(status, now, stale_after_s)
    if gone:
        _record_gone(folder, status)
    started = status.get("started") or status.get("created")
    end = status.get("finished") if state not in ACTIVE else now
    if gone or end is None:
        end = status.get("heartbeat")
    last = _last_metrics(folder)
    step = status.get("step")
    summary = RunSummary(
        name=folder.name, path=folder, state=state,
        step=int(step if step is not None else last.get("step", 0)),
        total_steps=status.get("total_steps"),
        score=last.get(SCORE_KEY),
        started=started,
        duration_s=max(0.0, end - started) if started and end else None,
        error=error,
        stage=state if gone or not status.get("stage") else stage_info(status, now, math.inf)[0],
        checkpoints=[p.name for p in list_checkpoints(folder)],
    )
    return summary, float(started or folder.stat().st_mtime)


def _last_metrics(folder: Path, chunk: int = 1 << 16) -> dict:
    """The last metrics line that has a score (else the last whole line), read from the file's end so
    listing many long runs stays cheap."""
    path = folder / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - chunk))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return {}
    if size > chunk:
        lines = lines[1:]  # the first line of a chunk is probably cut
    last: dict = {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line of a run killed mid-write
        if not isinstance(row, dict):
            continue
        last = last or row
        if row.get(SCORE_KEY) is not None:
            return {**row, "step": last.get("step", row.get("step"))}
    return last


def effective_state(status: dict | None, now: float | None = None,
                    stale_after_s: float = GONE_AFTER_S) -> tuple[str, str | None]:
    """(state, error) as the run really is. status.json says queued/running until the trainer writes a
    final state; a process killed hard never does. Such a run is "failed" with GONE_ERROR when its pid
    is no longer alive on this host, or, with no pid to ask (another host, or not yet recorded), when
    its heartbeat is older than `stale_after_s`."""
    state, error, _ = _effective_state(status or {}, time.time() if now is None else now, stale_after_s)
    return state, error


def _record_gone(folder: Path, status: dict) -> None:
    """A run whose process died on this machine without a final state gets one on disk (`failed`, with
    GONE_ERROR; `stopped` when a stop was asked of it), so status.json tells every later reader and tool
    what the dashboard shows. Only for a pid checked dead here: a silent run of another host may be alive
    behind a slow shared disk."""
    if status.get("host") != socket.gethostname():
        return
    current = read_status(folder) or {}
    if current.get("pid") != status.get("pid") or current.get("state") not in ACTIVE:
        return  # resumed or finished meanwhile
    with contextlib.suppress(OSError):  # a read-only or full disk: readers still derive it from the dead pid
        if _stop_requested(current):
            RunDir(folder).write_status("stopped", stage="stopped", finished=time.time(),
                                        note="stopped: the process ended without writing its final status")
        else:
            RunDir(folder).write_status("failed", error=GONE_ERROR, stage="failed", finished=time.time())


def _effective_state(status: dict, now: float, stale_after_s: float) -> tuple[str, str | None, bool]:
    state = status.get("state") or "unknown"
    if state not in ACTIVE:
        return state, status.get("error"), False
    pid = status.get("pid")
    if pid and status.get("host") == socket.gethostname():
        gone = not _alive(pid)
    else:
        gone = now - float(status.get("heartbeat") or 0.0) > stale_after_s
    if not gone:
        return state, status.get("error"), False
    return ("stopped", None, True) if _stop_requested(status) else ("failed", GONE_ERROR, True)


def read_run(run_dir: str | Path, *, now: float | None = None, stale_after_s: float = GONE_AFTER_S) -> dict:
    """Everything the run page shows: {"name", "path", "status" (status.json, with the state and error
    as `effective_state` sees them), "config" (config.yaml as a dict, or None), "metrics" (list of
    dicts), "checkpoints" (folder names, oldest first)}. Missing files read as empty."""
    root = Path(run_dir)
    status = read_status(root) or {}
    state, error, gone = _effective_state(status, time.time() if now is None else now, stale_after_s)
    if gone:
        _record_gone(root, status)
        status = {**status, "state": state, "error": error, "stage": state}
    try:
        metrics = read_metrics(root)
    except OSError:
        metrics = []
    return {"name": root.name, "path": root, "status": status, "config": _read_yaml(root / "config.yaml"),
            "metrics": metrics, "checkpoints": [p.name for p in list_checkpoints(root)]}


def _read_yaml(path: Path) -> dict | None:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return raw if isinstance(raw, dict) else None


def log_tail(run_dir: str | Path, lines: int = 200) -> str:
    """The last `lines` lines of what the run printed: logs/train.log, then what reached stdout.log or
    stderr.log after that log closed (the final "done:" line, the traceback of a crash). Without
    train.log (the run failed before opening it): the tails of stdout.log and stderr.log."""
    logs = Path(run_dir) / "logs"
    train = _tail_lines(logs / "train.log", lines)
    stdout, stderr = _tail_lines(logs / "stdout.log", lines), _tail_lines(logs / "stderr.log", lines)
    if train:
        seen = set(_tail_lines(logs / "train.log", 4 * lines))
        return "\n".join([*train, *_after(stdout, seen), *_after(stderr, seen)][-lines:])
    parts = []
    if stdout:
        parts += ["---- stdout.log ----", *stdout]
    if stderr:
        parts += ["---- stderr.log ----", *stderr]
    return "\n".join(parts[-lines:]) if lines > 0 else ""


def _after(lines: list[str], seen: set[str]) -> list[str]:
    """The non-empty lines after the last one that also went to train.log."""
    i = len(lines)
    while i > 0 and lines[i - 1] not in seen:
        i -= 1
    return [line for line in lines[i:] if line.strip()]


def _tail_lines(path: Path, n: int, block: int = 1 << 14) -> list[str]:
    """The last n lines of a text file, reading backwards in blocks (logs can grow large)."""
    if n <= 0:
        return []
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            data, pos = b"", end
            while pos > 0 and data.count(b"\n") <= n:
                step = min(block, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-n:]


# ---- what the dashboard computes ----

def stage_info(status: dict, now: float, stall_after_s: float) -> tuple[str, float, bool]:
    """(what the run is doing, seconds since that stage began, stalled). Stalled means the run says it
    is running but has not written status.json (its heartbeat) for more than `stall_after_s` seconds:
    alive but stuck, or gone on a host this machine cannot ask."""
    state = status.get("state") or "unknown"
    stage = status.get("stage") or state
    began = status.get("stage_started") or status.get("started") or status.get("created") \
        or status.get("heartbeat") or now
    if state in ACTIVE and _stop_requested(status):
        stage, began = "stopping", status["stop_requested"].get("at") or began
    heartbeat = status.get("heartbeat")
    stalled = state == "running" and heartbeat is not None and now - heartbeat > stall_after_s
    return stage, max(0.0, now - began), stalled


# ---- what the run page says about stopping and resuming ----

def resume_steps(info: dict) -> tuple[int, int]:
    """(the step a resume continues from: the last checkpoint's, 0 without one; the "train to step" to
    offer: the planned total while the run has not reached it, else that step plus trainer.save_freq, so
    the resumed part ends on a checkpoint). `info` is `read_run`'s."""
    reached = _step_of(info["checkpoints"][-1]) if info["checkpoints"] else 0
    planned = config_get(info.get("config") or {}, "trainer.total_training_steps") \
        or info["status"].get("total_steps") or 0
    return reached, _train_to(reached, planned, config_get(info.get("config") or {}, "trainer.save_freq") or 0)


def _train_to(reached: int, planned: int, save_freq: int) -> int:
    """The step to train a run to from step `reached`: `planned` while beyond it, else `reached` plus the
    checkpoint interval (so the new part ends on a checkpoint), or plus `planned` without one."""
    return planned if planned > reached else reached + (save_freq or planned or 1)


def stop_loss(info: dict) -> str:
    """What stopping the run now loses, in words for beside the Stop button. Stop writes no checkpoint: it
    must end the run within seconds whatever it is doing, and a step cut short has no consistent state to
    save, so a resume continues from the last checkpoint. `info` is `read_run`'s."""
    done = max((int(m.get("step") or 0) for m in info["metrics"]), default=0)
    reached, _ = resume_steps(info)
    save_freq = config_get(info.get("config") or {}, "trainer.save_freq") or 0
    every = (f"Checkpoints every {save_freq} steps (trainer.save_freq), the next at step "
             f"{(done // save_freq + 1) * save_freq}." if save_freq
             else "A checkpoint only at the end (trainer.save_freq=0).")
    if done <= reached:
        kept = f"checkpoint step_{reached} holds every step before it" if reached else "no step has finished yet"
        return f"Stop loses only the step in progress: {kept}. {every}"
    if not reached:
        return (f"Stop loses all {done} finished step(s) and the one in progress: there is no checkpoint yet, so "
                f"a resume starts over. {every}")
    return (f"Stop keeps checkpoint step_{reached}: the {done - reached} step(s) finished since then and the one "
            f"in progress are lost (a resume trains them again). {every}")


def _step_of(checkpoint_name: str) -> int:
    return int(checkpoint_name.rsplit("_", 1)[1])


# ---- processes ----

def _reap() -> None:
    for pid, proc in list(_children.items()):
        if proc.poll() is not None:
            _children.pop(pid, None)


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    proc = _children.get(pid)
    if proc is not None and proc.poll() is not None:
        _children.pop(pid, None)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return not _is_zombie(pid)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Killed members that are zombies do not count: Ray's
    workers are the trainer's grandchildren, and once it is gone whoever adopts them reaps them when it
    gets to it (seconds here), long after SIGKILL has ended them."""
    _reap()
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member owned by someone else still counts
        return True
    if not Path("/proc/self/stat").exists():  # not Linux: every member counts
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[-1].split()
        except OSError:  # ended while we looked
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _is_zombie(pid: int) -> bool:
    """A dead process its parent has not waited for yet (Linux; elsewhere assume not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]
