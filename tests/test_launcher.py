"""The launcher, with real background processes: launch, watch, stop, kill, resume, fork, delete; and the
dashboard's arithmetic (smoothing, config diffs, stage line) with hand-worked numbers."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from backend.core.config import Config, ConfigError, load_config
from backend.core.runs import read_metrics, read_status
from backend.services.launcher import (
    ACTIVE,
    GONE_ERROR,
    RUN_NICE,
    RunSummary,
    delete,
    fork,
    fork_name,
    launch,
    list_runs,
    log_tail,
    read_run,
    resume,
    resume_steps,
    stage_info,
    stop,
    stop_loss,
)
from backend.services.run_views import config_diff, smooth

from .conftest import tiny_overrides

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow

LONG = 200  # steps: a run that is still going when the test acts on it


def tiny_config(sample_sets, **extra) -> Config:
    return load_config(None, tiny_overrides(sample_sets, **extra))


def summary_of(run_dir: Path, **kwargs) -> RunSummary | None:
    return next((s for s in list_runs(run_dir.parent, **kwargs) if s.path == run_dir), None)


def wait_for(check, what: str, run_dir: Path | None = None, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.2)
    logs = log_tail(run_dir, 40) if run_dir else ""
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{logs}")


def wait_until_finished(run_dir: Path) -> RunSummary:
    def finished():
        s = summary_of(run_dir)
        return s if s and s.state not in ACTIVE else None
    return wait_for(finished, f"{run_dir.name} to finish", run_dir)


def wait_until_stepping(run_dir: Path) -> dict:
    """The run is running and has finished a step (status "step" is the step in progress)."""
    def stepping():
        status = read_status(run_dir) or {}
        return status if status.get("state") == "running" and read_metrics(run_dir) else None
    return wait_for(stepping, f"{run_dir.name} to finish a step", run_dir)


def process_gone(pid: int) -> bool:
    """Gone, or a zombie waiting for a parent outside this test (PID 1 here may never reap orphans)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(stat.parent.name)
    return not members


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("runs")
    yield root
    # a failed test must not leave a 200-step run training in the background
    for run in list_runs(root):
        if run.state in ACTIVE:
            stop(run.path, grace_s=5)


@pytest.fixture(scope="module")
def finished_run(runs_root, sample_sets) -> SimpleNamespace:
    t0 = time.monotonic()
    run_dir = launch(tiny_config(sample_sets), name="tiny", runs_root=runs_root)
    launch_s = time.monotonic() - t0
    status_at_launch = read_status(run_dir)
    summary = wait_until_finished(run_dir)
    return SimpleNamespace(path=run_dir, launch_s=launch_s, status_at_launch=status_at_launch, summary=summary)


# ---- launch ----

def test_launch_returns_at_once_with_a_queued_run_whose_pid_and_group_are_recorded(finished_run):
    status = finished_run.status_at_launch
    assert finished_run.launch_s < 10
    assert status["state"] in ("queued", "running")
    assert isinstance(status["pid"], int) and status["pid"] != os.getpid()
    assert status["pgid"] == status["pid"]  # its own session, so its own group


def test_a_launched_tiny_run_succeeds_and_fills_its_run_directory(finished_run):
    run_dir, s = finished_run.path, finished_run.summary
    assert s.state == "succeeded", log_tail(run_dir)
    assert (s.name, s.step, s.total_steps, s.checkpoints) == (run_dir.name, 2, 2, ["step_2"])
    assert run_dir.name.endswith("-tiny")
    assert s.score is not None and math.isfinite(s.score)
    assert s.duration_s is not None and s.duration_s > 0
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
    assert "step 2/2 | score" in (run_dir / "logs/train.log").read_text()
    assert (run_dir / "logs/stdout.log").exists() and (run_dir / "logs/stderr.log").exists()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["total_training_steps"] == 2
    status = read_status(run_dir)
    assert status["pgid"] == finished_run.status_at_launch["pgid"], "the trainer's own writes dropped pgid"
    # "succeeded" is written just before the process exits
    wait_for(lambda: process_gone(status["pid"]), "the finished run's process to exit", timeout_s=30)


def test_read_run_and_log_tail_give_the_page_what_it_shows(finished_run):
    run = read_run(finished_run.path)
    assert run["status"]["state"] == "succeeded"
    assert run["config"]["actor_rollout_ref"]["model"]["path"] == "tiny-qwen3"
    assert [m["step"] for m in run["metrics"]] == [1, 2]
    assert run["checkpoints"] == ["step_2"]
    tail = log_tail(finished_run.path, lines=2).splitlines()
    assert len(tail) == 2 and tail[-1].startswith("done: ")


def test_log_tail_falls_back_to_stdout_and_stderr_when_the_run_never_opened_its_log(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs/stdout.log").write_text("hello\n")
    (tmp_path / "logs/stderr.log").write_text("".join(f"line {i}\n" for i in range(500)) + "error: boom\n")
    assert log_tail(tmp_path, lines=3).splitlines() == ["line 498", "line 499", "error: boom"]
    assert "hello" in log_tail(tmp_path, lines=1000)
    assert log_tail(tmp_path / "missing") == ""


def test_a_config_that_fails_validation_or_preflight_launches_nothing(tmp_path, sample_sets):
    root = tmp_path / "runs"
    not_divisible = tiny_config(sample_sets)
    not_divisible.data.train_batch_size = 3
    missing_data = tiny_config(sample_sets)
    missing_data.data.train_files = [str(tmp_path / "missing.parquet")]
    for cfg in (not_divisible, missing_data):
        with pytest.raises(ConfigError):
            launch(cfg, runs_root=root)
    assert not root.exists()


@pytest.mark.parametrize("name", ["a;rm -rf x", "../x", "$(touch pwned)", "a b", "x/../../y"])
def test_run_names_with_shell_metacharacters_or_path_steps_are_refused(tmp_path, sample_sets, name):
    root = tmp_path / "runs"
    with pytest.raises(ConfigError, match="run name"):
        launch(tiny_config(sample_sets), name=name, runs_root=root)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---- stop, kill, delete ----

SPAWNING_REWARD = '''
import subprocess
import threading
from pathlib import Path

_helper = None
_lock = threading.Lock()  # rows are scored on several threads


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Scores 0, and on first use starts a long-lived helper process, as some real scorers do."""
    global _helper
    with _lock:
        if _helper is None:
            _helper = subprocess.Popen(["sleep", "300"])
            Path(__file__).with_suffix(".pid").write_text(str(_helper.pid))
    return 0.0
'''


def test_stop_ends_the_whole_process_group_and_leaves_state_stopped(tmp_path, runs_root, sample_sets):
    reward = tmp_path / "spawning_reward.py"
    reward.write_text(SPAWNING_REWARD)
    cfg = tiny_config(sample_sets, **{"trainer.total_training_steps": LONG,
                                      "custom_reward_function.path": str(reward),
                                      "custom_reward_function.name": "compute_score"})
    run_dir = launch(cfg, name="to-stop", runs_root=runs_root)
    status = wait_until_stepping(run_dir)
    helper = int(reward.with_suffix(".pid").read_text())
    assert not process_gone(helper)
    with pytest.raises(ConfigError, match="still running"):
        resume(run_dir)

    assert stop(run_dir, grace_s=30) == "stopped"
    assert process_gone(status["pid"]) and process_gone(helper)
    assert group_gone(status["pgid"])
    assert read_status(run_dir)["state"] == "stopped"
    assert summary_of(run_dir).state == "stopped"
    assert stop(run_dir) == "stopped"  # stopping a finished run changes nothing


def test_a_trainer_that_ignores_the_stop_signal_is_killed_after_the_grace_and_recorded_stopped(tmp_path):
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, start_new_session=True)
    assert stubborn.stdout.readline() == b"ready\n"
    run_dir = tmp_path / "stubborn"
    run_dir.mkdir()
    (run_dir / "status.json").write_text(json.dumps({"state": "running", "pid": stubborn.pid, "pgid": stubborn.pid,
                                                     "host": socket.gethostname(), "heartbeat": time.time()}))
    asked = time.monotonic()
    assert stop(run_dir, grace_s=1.0) == "stopped"
    assert time.monotonic() - asked < 3.0
    assert stubborn.wait(timeout=5) == -signal.SIGKILL
    status = read_status(run_dir)
    assert status["note"] == "stopped: did not stop within 1 s of SIGTERM and was killed" and not status.get("error")


def test_a_run_whose_process_ends_after_a_stop_request_reads_as_stopped_not_failed(tmp_path):
    ended = subprocess.Popen(["true"])
    ended.wait()
    root = tmp_path / "runs"
    for name, asked_of in (("asked", ended.pid), ("asked-before-a-resume", ended.pid + 1)):
        (root / name).mkdir(parents=True)
        (root / name / "status.json").write_text(json.dumps({
            "state": "running", "pid": ended.pid, "host": socket.gethostname(), "heartbeat": time.time(),
            "stop_requested": {"pid": asked_of, "at": time.time()}}))
    states = {r.name: (r.state, r.error) for r in list_runs(root)}
    assert states == {"asked": ("stopped", None), "asked-before-a-resume": ("failed", GONE_ERROR)}
    assert read_status(root / "asked")["state"] == "stopped"  # recorded, as a failure would be


def test_a_launched_run_and_its_session_yield_the_cpu_to_the_workbench(runs_root, sample_sets):
    """Once stepping, a launched run's processes (trainer, Ray, workers) and its session's scheduling group
    run at RUN_NICE, so the UI stays responsive while runs train; the workbench itself is not niced."""
    run_dir = launch(tiny_config(sample_sets, **{"trainer.total_training_steps": LONG}), name="nice",
                              runs_root=runs_root)
    status = wait_until_stepping(run_dir)
    try:
        group = [int(p) for p in subprocess.run(["pgrep", "-g", str(status["pgid"])], capture_output=True,
                                                text=True).stdout.split()]
        assert status["pid"] in group and len(group) > 2  # the trainer, its Ray and its worker
        niceness = {}
        for pid in group:
            with contextlib.suppress(ProcessLookupError):
                niceness[pid] = os.getpriority(os.PRIO_PROCESS, pid)
        assert set(niceness.values()) == {RUN_NICE}, niceness
        autogroup = Path(f"/proc/{status['pid']}/autogroup")
        if autogroup.exists():  # Linux with autogroup scheduling
            assert autogroup.read_text().split()[-1] == str(RUN_NICE)
        assert os.getpriority(os.PRIO_PROCESS, 0) < RUN_NICE
    finally:
        stop(run_dir, grace_s=30)


def test_a_run_killed_with_sigkill_is_listed_as_failed_and_its_status_file_says_so(runs_root, sample_sets):
    run_dir = launch(tiny_config(sample_sets, **{"trainer.total_training_steps": LONG}),
                              name="to-kill", runs_root=runs_root)
    status = wait_until_stepping(run_dir)
    os.killpg(status["pgid"], signal.SIGKILL)
    time.sleep(0.2)  # the run may have finished another step after it was seen stepping: what it left is the record
    status = json.loads((run_dir / "status.json").read_text())

    def listed_failed():
        s = summary_of(run_dir)
        return s if s.state == "failed" else None
    s = wait_for(listed_failed, "the killed run to be listed as failed", timeout_s=10)
    assert s.error == GONE_ERROR and s.stage == "failed"
    # the dashboard noticed the dead pid and recorded it: status.json itself now says failed
    on_disk = json.loads((run_dir / "status.json").read_text())
    assert on_disk["state"] == "failed" and on_disk["error"] == GONE_ERROR
    assert on_disk["pid"] == status["pid"] and on_disk["step"] == status["step"]
    assert read_run(run_dir)["status"]["state"] == "failed"


def test_a_run_of_another_host_is_failed_only_once_its_heartbeat_is_older_than_the_threshold(tmp_path):
    run_dir = tmp_path / "runs" / "remote"
    run_dir.mkdir(parents=True)
    beat = time.time()
    (run_dir / "status.json").write_text(json.dumps({"state": "running", "pid": 1, "host": "another-host",
                                                     "heartbeat": beat, "started": beat - 100, "step": 7}))
    assert summary_of(run_dir, now=beat + 30).state == "running"
    assert summary_of(run_dir, now=beat + 30, stale_after_s=20).state == "failed"
    late = summary_of(run_dir, now=beat + 61)
    assert (late.state, late.error, late.step) == ("failed", GONE_ERROR, 7)


def test_delete_stops_a_running_run_and_removes_its_folder(runs_root, sample_sets):
    run_dir = launch(tiny_config(sample_sets, **{"trainer.total_training_steps": LONG}),
                              name="to-delete", runs_root=runs_root)
    pid = read_status(run_dir)["pid"]
    delete(run_dir, runs_root)
    assert not run_dir.exists()
    assert process_gone(pid)
    assert run_dir.name not in [s.name for s in list_runs(runs_root)]
    delete(run_dir, runs_root)  # already gone: nothing to do


def test_delete_refuses_folders_outside_the_runs_root(tmp_path):
    root = tmp_path / "runs"
    (root / "inside").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    for target in (outside, root / ".." / "outside", root / "link", root, tmp_path):
        with pytest.raises(ValueError, match="not inside"):
            delete(target, root)
    assert outside.exists() and root.exists()
    delete(root / "inside", root)
    assert not (root / "inside").exists()


# ---- fork and resume ----

def test_fork_starts_a_new_run_from_the_chosen_checkpoint(finished_run, sample_sets):
    parent = finished_run.path
    cfg = tiny_config(sample_sets, **{"trainer.total_training_steps": 3})
    child = fork(parent, "step_2", cfg, name="forked")
    assert cfg.trainer.resume_mode == "disable", "fork must not edit the caller's config"
    assert child != parent and child.parent == parent.parent
    s = wait_until_finished(child)
    assert s.state == "succeeded", log_tail(child)
    assert [m["step"] for m in read_metrics(child)] == [3]
    status = read_status(child)
    assert status["forked_from"] == {"run": parent.name, "checkpoint": str(parent / "checkpoints" / "step_2")}
    config = yaml.safe_load((child / "config.yaml").read_text())["trainer"]
    assert (config["resume_mode"], config["resume_from_path"]) == ("resume_path", str(parent / "checkpoints/step_2"))
    assert read_status(parent)["state"] == "succeeded"


def test_a_fork_is_named_after_its_parent_and_step_and_never_takes_a_taken_name(tmp_path):
    parent = tmp_path / "20260101-120000-gsm8k"
    (parent / "checkpoints" / "step_20").mkdir(parents=True)
    assert fork_name(parent, "step_20") == "20260101-120000-gsm8k-fork-20"
    (tmp_path / "20260101-120000-gsm8k-fork-20" / "checkpoints" / "step_30").mkdir(parents=True)
    assert fork_name(parent, "step_20") == "20260101-120000-gsm8k-fork-20-2"
    # a fork of a fork is named after the first parent, not a chain of them
    assert fork_name(tmp_path / "20260101-120000-gsm8k-fork-20", "step_30") == "20260101-120000-gsm8k-fork-30"


def test_resume_or_fork_to_a_step_already_reached_is_refused_and_starts_nothing(finished_run, sample_sets):
    run_dir = finished_run.path  # trained to step 2 of 2, one checkpoint at the end (save_freq 0)
    status, config = read_status(run_dir), (run_dir / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"trained to step 2 .*would train nothing.*total_training_steps=4"):
        resume(run_dir)
    with pytest.raises(ConfigError, match=r"step_2 is at step 2: a fork of it .*would train nothing"):
        fork(run_dir, "step_2", tiny_config(sample_sets))
    assert (read_status(run_dir), (run_dir / "config.yaml").read_text()) == (status, config)
    assert not (run_dir.parent / f"{run_dir.name}-fork-2").exists()


def test_resume_continues_a_finished_run_in_its_own_folder_to_more_steps(finished_run):
    run_dir = finished_run.path
    assert resume(run_dir, overrides=["trainer.total_training_steps=3"]) == run_dir
    s = wait_until_finished(run_dir)
    assert (s.state, s.step, s.total_steps) == ("succeeded", 3, 3), log_tail(run_dir)
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    trainer = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]
    assert (trainer["resume_mode"], trainer["total_training_steps"]) == ("auto", 3)


# ---- listing what is half there ----

def test_list_runs_survives_torn_metrics_a_missing_status_and_stray_folders(tmp_path):
    root = tmp_path / "runs"
    torn = root / "20240101-000000-torn"
    torn.mkdir(parents=True)
    (torn / "status.json").write_text(json.dumps({"state": "stopped", "step": 2, "started": 100.0,
                                                  "finished": 130.0, "heartbeat": 130.0}))
    (torn / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.25}\n'
                                        '{"step": 2, "critic/score/mean": 0.5}\n{"step": 3, "critic/sc')
    no_status = root / "20240102-000000-nostatus"
    no_status.mkdir()
    (no_status / "config.yaml").write_text("trainer: {total_training_steps: 5}\n")
    (root / "notes").mkdir()
    (root / ".hidden").mkdir()
    (root / "file.txt").write_text("x")
    runs = list_runs(root)
    assert [r.name for r in runs] == [no_status.name, torn.name]
    assert (runs[1].state, runs[1].step, runs[1].score, runs[1].duration_s) == ("stopped", 2, 0.5, 30.0)
    assert (runs[0].state, runs[0].step, runs[0].score, runs[0].checkpoints) == ("unknown", 0, None, [])
    assert [m["step"] for m in read_run(torn)["metrics"]] == [1, 2]
    assert list_runs(tmp_path / "no-such-root") == []
    gone = read_run(root / "deleted")
    assert (gone["status"], gone["config"], gone["metrics"], gone["checkpoints"]) == ({}, None, [], [])


def test_list_runs_survives_run_folders_deleted_while_it_lists(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    done = threading.Event()

    def churn():
        i = 0
        while not done.is_set():
            run = root / f"run-{i % 5}"
            (run / "checkpoints" / "step_1").mkdir(parents=True, exist_ok=True)
            (run / "status.json").write_text(json.dumps({"state": "succeeded", "started": 1.0}))
            (run / "metrics.jsonl").write_text('{"step": 1}\n')
            shutil.rmtree(run, ignore_errors=True)
            i += 1

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for s in list_runs(root):
                assert s.state in ("succeeded", "unknown")
    finally:
        done.set()
        worker.join()


# ---- the dashboard's arithmetic ----

def test_smooth_is_tensorboards_debiased_moving_average_and_skips_gaps():
    # weight 0.5: v=1 -> last 0.5, debias 1-0.5 -> 1.0; None passes; v=3 -> last 0.25+1.5=1.75, /(1-0.25) -> 7/3
    assert smooth([1.0, None, 3.0], 0.5) == pytest.approx([1.0, None, 7 / 3])
    # weight 0.9, constant input stays constant thanks to the debiasing
    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert smooth([1.0, 5.0], 0.0) == [1.0, 5.0]
    nan = smooth([1.0, math.nan, 3.0], 0.5)
    assert math.isnan(nan[1]) and nan[2] == pytest.approx(7 / 3)
    with pytest.raises(ValueError):
        smooth([1.0], 1.0)


def test_config_diff_lists_only_the_dotted_keys_whose_values_differ():
    a = {"data": {"train_batch_size": 8, "files": ["x.parquet"]}, "trainer": {"seed": 0}}
    b = {"data": {"train_batch_size": 16, "files": ["x.parquet"]}, "trainer": {"seed": 0, "nnodes": 2}}
    assert config_diff({"a": a, "b": b, "c": None}) == {
        "data.files": {"a": ["x.parquet"], "b": ["x.parquet"], "c": None},
        "data.train_batch_size": {"a": 8, "b": 16, "c": None},
        "trainer.nnodes": {"a": None, "b": 2, "c": None},
        "trainer.seed": {"a": 0, "b": 0, "c": None},
    }
    assert config_diff({"a": a, "b": b})["data.train_batch_size"] == {"a": 8, "b": 16}
    assert "data.files" not in config_diff({"a": a, "b": b})
    assert config_diff({"a": a}) == {}


def test_stage_info_reports_the_stage_its_age_and_a_stall_after_the_threshold():
    status = {"state": "running", "stage": "generating token 3/8 of 8 responses", "stage_started": 1000.0,
              "heartbeat": 1010.0}
    assert stage_info(status, now=1030.0, stall_after_s=60) == (status["stage"], 30.0, False)
    assert stage_info(status, now=1071.0, stall_after_s=60) == (status["stage"], 71.0, True)
    done = {**status, "state": "succeeded", "stage": "done"}
    assert stage_info(done, now=5000.0, stall_after_s=60)[2] is False
    assert stage_info({}, now=1.0, stall_after_s=60) == ("unknown", 0.0, False)


def test_the_stop_button_says_what_a_stop_loses_and_resume_offers_a_step_beyond_the_last():
    info = {"status": {"total_steps": 20}, "config": {"trainer": {"total_training_steps": 20, "save_freq": 5}},
            "metrics": [{"step": s} for s in range(1, 8)], "checkpoints": ["step_5"]}
    # steps 6 and 7 finished after checkpoint step_5, step 8 is in progress; the next save is at step 10
    assert stop_loss(info) == ("Stop keeps checkpoint step_5: the 2 step(s) finished since then and the one in "
                               "progress are lost (a resume trains them again). Checkpoints every 5 steps "
                               "(trainer.save_freq), the next at step 10.")
    assert resume_steps(info) == (5, 20)
    finished = {**info, "metrics": [{"step": s} for s in range(1, 21)], "checkpoints": ["step_15", "step_20"]}
    assert resume_steps(finished) == (20, 25)  # beyond the last step, by one checkpoint interval
    starting = {**info, "metrics": [], "checkpoints": []}
    assert stop_loss(starting).startswith("Stop loses only the step in progress: no step has finished yet")
    no_saves = {**info, "config": {"trainer": {"total_training_steps": 20, "save_freq": 0}}, "checkpoints": []}
    assert stop_loss(no_saves) == ("Stop loses all 7 finished step(s) and the one in progress: there is no "
                                   "checkpoint yet, so a resume starts over. A checkpoint only at the end "
                                   "(trainer.save_freq=0).")
