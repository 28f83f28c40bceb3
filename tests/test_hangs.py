"""A run whose rank stops answering is diagnosed, not left hanging: every process's Python stacks are written to
the run directory with what each rank is doing, and past trainer.hang_timeout_s the run fails with that
diagnosis."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from backend.core.runs import RunDir, read_metrics, read_status
from backend.engine.trainer import _record_stall
from backend.engine.worker_group import Stall

from .conftest import REPO, tiny_overrides, wait_for


def _hang_report(run_dir, since: float) -> dict | None:
    """A diagnosis written after `since` with a rank that did not answer: a start-up slower than the stall warning
    leaves one of its own, ranks still importing torch not answering either."""
    diagnosis = (read_status(run_dir) or {}).get("diagnosis") or {}
    fresh = diagnosis.get("at", 0) > since
    return diagnosis if fresh and any("no answer" in line for line in diagnosis.get("ranks", [])) else None


@pytest.mark.slow
def test_a_rank_stuck_in_a_collective_is_diagnosed_with_every_process_stacks_then_fails_the_run(sample_sets,
                                                                                                tmp_path):
    run_dir = tmp_path / "hung"
    # The hang timeout covers start-up too, which on two busy cores has taken over 20 s for the tiny model.
    overrides = tiny_overrides(sample_sets, **{
        "trainer.n_gpus_per_node": 2, "trainer.total_training_steps": 50, "data.val_files": "[]",
        "trainer.stall_warning_s": 4, "trainer.hang_timeout_s": 60, "trainer.export_at_end": False})
    proc = subprocess.Popen([sys.executable, "-m", "backend", "train", "defaults", *overrides, "--run-dir",
                             str(run_dir)], cwd=REPO, stdout=open(tmp_path / "hung.log", "w"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True)
    rank1 = None
    try:
        # Step 1 done: every call has run on both ranks.
        wait_for(lambda: read_metrics(run_dir) or (read_status(run_dir) or {}).get("state") == "failed", timeout=300)
        status = read_status(run_dir)
        assert read_metrics(run_dir), status.get("error")
        rank1 = next(w["pid"] for w in status["workers"] if w["rank"] == 1)
        # The trainer paused while the ranks finish what they were given, then rank 1 stopped: the trainer's
        # next call finds rank 0 waiting for rank 1 in its first collective, as a rank stuck anywhere leaves it.
        stopped = time.time()
        os.kill(status["pid"], signal.SIGSTOP)
        time.sleep(3)
        os.kill(rank1, signal.SIGSTOP)
        os.kill(status["pid"], signal.SIGCONT)

        wait_for(lambda: _hang_report(run_dir, stopped), timeout=60)
        report = _hang_report(run_dir, stopped)
        assert report["kind"] == "hang" and not report["final"]
        rank0 = next(line for line in report["ranks"] if line.startswith("rank 0"))
        assert "inside torch.distributed's" in rank0, report["ranks"]
        stacks = (run_dir / report["file"]).read_text()
        assert "=== controller" in stacks and "=== rank 0" in stacks and "worker_group.py" in stacks
        assert "torch/distributed" in stacks.split("=== rank 0")[1]

        assert proc.wait(timeout=120) != 0
        status = read_status(run_dir)
        assert status["state"] == "failed"
        assert "hung: still running after trainer.hang_timeout_s=60 s" in status["error"]
        assert "rank 1" in status["error"] and "no answer" in status["error"]
        assert status["diagnosis"]["final"]
    finally:
        if rank1 is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank1, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_stall_is_written_with_its_stacks_and_marked_done_when_the_call_returns(tmp_path):
    run = RunDir(tmp_path / "run").create()
    run.write_status("running", step=7)
    stall = Stall("the actor update", 61.2, ["rank 0 (pid 3 on vm): at workers.py:300 in update_actor"],
                  "=== controller (pid 2 on vm)\n")
    _record_stall(run, stall)
    diagnosis = read_status(run.root)["diagnosis"]
    assert diagnosis["call"] == "the actor update" and diagnosis["step"] == 7 and diagnosis["seconds"] == 61
    assert (run.root / diagnosis["file"]).read_text().startswith("the actor update has run 61 s: rank 0 (pid 3")
    assert "done_after_s" not in diagnosis
    _record_stall(run, Stall("the actor update", 75.4, [], "", done=True))
    assert read_status(run.root)["diagnosis"] == {**diagnosis, "done_after_s": 75}
