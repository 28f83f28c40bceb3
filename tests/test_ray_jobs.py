"""Runs and sweeps on a Ray cluster are Ray jobs of that cluster (a `ray start --head` node on this machine):
they run inside it, not as children of the workbench, and their status, logs and stop work as a local run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from backend.core.config import ConfigError, load_config
from backend.services import launcher, sweeps

from .browser import free_port
from .conftest import REPO, tiny_overrides, wait_for

pytestmark = pytest.mark.slow

ENDED = (JobStatus.SUCCEEDED, JobStatus.STOPPED, JobStatus.FAILED)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node cluster with the dashboard, which takes jobs; its address as a run's trainer.ray_address. It
    counts two GPUs, which this machine does not have: the runs here train on the CPU."""
    logs = tmp_path_factory.mktemp("head")
    port = free_port()
    ray_cli = Path(sys.executable).parent / "ray"
    # Ports of its own for the dashboard and the job agent: the agent's default (52365) may be held by the
    # private Ray of a run another test left behind, and then the head takes no jobs.
    head = subprocess.Popen([str(ray_cli), "start", "--head", f"--port={port}", f"--dashboard-port={free_port()}",
                             f"--dashboard-agent-listen-port={free_port()}", "--include-dashboard=true",
                             "--num-cpus=4", "--num-gpus=2", "--block", "--disable-usage-stats"],
                            stdout=open(logs / "head.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True,
                            # Without token authentication: Ray reads RAY_AUTH_MODE once, when this test process
                            # imported it (test_distributed covers joining a cluster that uses tokens).
                            env={**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
                                 "RAY_AUTH_MODE": "disabled"})
    try:
        wait_for(lambda: "Ray runtime started" in (logs / "head.log").read_text(), timeout=120)
        Head.logs = Path(os.path.realpath("/tmp/ray/session_latest")) / "logs"  # this head's, as it just started
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)


class Head:
    logs: Path | None = None


def job_status(job: dict) -> JobStatus:
    return JobSubmissionClient(job["address"]).get_job_status(job["id"])


def wait_for_job(predicate, job: dict, timeout: float) -> None:
    """wait_for, and when it times out, what the cluster says of the job and what its agents logged."""
    try:
        wait_for(predicate, timeout=timeout)
    except AssertionError:
        info = JobSubmissionClient(job["address"]).get_job_info(job["id"])
        tails = [f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-8:])
                 for pattern in ("runtime_env_agent.log", "job-driver-*.log", "raylet.err", "gcs_server.err")
                 for f in sorted((Head.logs or Path("/nonexistent")).glob(pattern))]
        raise AssertionError(f"timed out after {timeout:.0f} s; job {info.status}: {info.message}\n"
                             + "\n".join(tails)) from None


def test_a_run_on_a_cluster_is_its_ray_job_with_status_and_logs_in_the_run_directory(cluster, sample_sets,
                                                                                       tmp_path, monkeypatch):
    # What Ray leaves in a process that once started a Ray of its own (a test's run, here): the job must still
    # run under the cluster's authentication, not the workbench's.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    # A variable the job carries and the trainer passes to its workers again, as a GPU host's NCCL settings are.
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    cfg = load_config(None, tiny_overrides(sample_sets, **{"trainer.ray_address": cluster,
                                                           "trainer.total_training_steps": 4}))
    run = launcher.launch(cfg, name="job", runs_root=tmp_path)
    job = launcher.read_run(run)["status"]["ray_job"]
    assert job["address"] == cluster
    wait_for_job(lambda: launcher.read_run(run)["status"].get("pid"), job, timeout=120)
    trainer = psutil.Process(launcher.read_run(run)["status"]["pid"])
    # The cluster runs it: the trainer's parent is Ray's job supervisor, not this process (the launcher).
    assert "JobSupervisor" in " ".join(trainer.parent().cmdline())
    assert job_status(job) in (JobStatus.RUNNING, JobStatus.SUCCEEDED)  # the cluster knows it as its job
    wait_for_job(lambda: job_status(job) in ENDED, job, timeout=300)
    assert job_status(job) == JobStatus.SUCCEEDED
    info = launcher.read_run(run)
    assert info["status"]["state"] == "succeeded" and info["status"]["step"] == 4
    assert "Connecting to existing Ray cluster at address" in (run / "logs" / "stderr.log").read_text()
    assert launcher.list_runs(tmp_path)[0].state == "succeeded"


def test_a_ray_job_run_stopped_before_its_process_started_ends_stopped_and_so_does_its_job(cluster, sample_sets,
                                                                                             tmp_path):
    cfg = load_config(None, tiny_overrides(sample_sets, **{"trainer.ray_address": cluster,
                                                           "trainer.total_training_steps": 50}))
    run = launcher.launch(cfg, name="stopped-job", runs_root=tmp_path)
    job = launcher.read_run(run)["status"]["ray_job"]
    # No pid yet: the cluster stops the job (on a busy machine the trainer may have started, and stops itself).
    assert launcher.stop(run) == "stopped"
    wait_for_job(lambda: job_status(job) in ENDED, job, timeout=120)
    time.sleep(2)  # a trainer that started after all would write over the stop
    assert launcher.read_run(run)["status"]["state"] == "stopped"


def test_a_sweep_on_a_cluster_is_a_ray_job_whose_trials_are_jobs_too(cluster, sample_sets, tmp_path):
    base = load_config(None, tiny_overrides(sample_sets, **{"trainer.ray_address": cluster, "data.val_files": "[]"}))
    spec = sweeps.SweepSpec(params=[sweeps.SweepParam("actor_rollout_ref.actor.optim.lr", values=[1e-3])],
                            metric="actor/lr", steps=1)
    folder = sweeps.create_sweep(base, spec, name="on-cluster", runs_root=tmp_path)
    sweeps.start_sweep(folder)
    job = sweeps.read_state(folder)["ray_job"]
    assert sweeps.read_sweep(folder)["state"]["state"] in ("starting", "running")
    wait_for_job(lambda: sweeps.read_sweep(folder)["state"]["state"] == "finished", job, timeout=480)
    (trial,) = sweeps.read_sweep(folder)["trials"]
    assert trial.state == "complete" and trial.value == pytest.approx(1e-3)
    for each in (launcher.read_run(trial.run)["status"]["ray_job"], job):  # the trial's job, the sweep's
        wait_for(lambda j=each: job_status(j) in ENDED, timeout=120)
        assert job_status(each) == JobStatus.SUCCEEDED


def test_a_cluster_that_takes_no_jobs_is_named_and_the_run_recorded_failed(sample_sets, tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    cfg = load_config(None, tiny_overrides(sample_sets, **{"trainer.ray_address": address}))
    with pytest.raises(ConfigError, match=f"trainer.ray_address={address}: could not submit a Ray job there"):
        launcher.launch(cfg, name="nowhere", runs_root=tmp_path)
    (summary,) = launcher.list_runs(tmp_path)
    assert summary.state == "failed" and summary.error.startswith("could not submit the run: ")


def test_a_sweep_reads_the_clusters_gpus_and_counts_one_whose_memory_no_node_can_say_as_whole(cluster):
    """A sweep on a cluster packs by the memory of the cluster's GPUs, which its process reads with a task on each
    node; the head's two GPUs here are only Ray's count (no CUDA), so each reads as unknown (0 GiB): a trial takes
    a whole one (test_sweeps shows the shares where the memory is known)."""
    probe = subprocess.run([sys.executable, "-c", f"from backend.services import sweeps; "
                            f"print(sweeps._cluster_gpus({cluster!r}))"],
                           capture_output=True, text=True, timeout=300, cwd=REPO,
                           env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.splitlines()[-1] == "[0.0, 0.0]"
