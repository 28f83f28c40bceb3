"""trainer.rollout_mode=async on CPU ranks: the rollout engine on a worker of its own, the weights broadcast to it
over gloo after each update. At max_staleness=0 it trains exactly as the colocated run; at max_staleness=1 each
batch is one update old, the staleness and the importance weights are logged, a killed rollout worker or a
broadcast that left a tensor behind fails the run by name, and a resumed run draws the batch that was in flight
again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from backend.core.config import ConfigError, load_config
from backend.core.runs import list_checkpoints, read_metrics, read_status
from backend.engine.rollout_worker import checksums
from backend.engine.trainer import Trainer
from backend.services.launcher import launch

from .conftest import REPO, patching_sitecustomize, tiny_overrides, wait_for

# Two optimizer steps a step (so the old log-probs pass runs), three steps, a checkpoint after each.
SHAPE = {"data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
         "data.val_files": "[]", "trainer.total_training_steps": 3, "trainer.save_freq": 1,
         "trainer.max_checkpoints_to_keep": 0, "trainer.export_at_end": "false",
         "custom_reward_function.path": str(REPO / "tests" / "signal_reward.py")}


def train(run_dir: Path, sample_sets, **extra) -> list[dict]:
    with Trainer(load_config(None, tiny_overrides(sample_sets, **{**SHAPE, **extra})), run_dir,
                 show_progress=False) as t:
        t.train()
    return read_metrics(run_dir)


def prompts(run_dir: Path, step: int) -> list[str]:
    return pq.read_table(run_dir / f"rollouts/step_{step:06d}.parquet").column("prompt").to_pylist()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, sample_sets) -> Path:
    run_dir = tmp_path_factory.mktemp("async") / "colocated"
    train(run_dir, sample_sets)
    return run_dir


@pytest.fixture(scope="module")
def one_step_off(tmp_path_factory, sample_sets) -> Path:
    run_dir = tmp_path_factory.mktemp("async") / "one-step-off"
    train(run_dir, sample_sets, **{"trainer.rollout_mode": "async", "trainer.max_staleness": 1})
    return run_dir


@pytest.mark.slow  # starts Ray and trains
def test_async_at_staleness_0_trains_exactly_as_colocated(tmp_path, sample_sets, colocated):
    split = train(tmp_path / "split", sample_sets, **{"trainer.rollout_mode": "async", "trainer.max_staleness": 0})
    together = read_metrics(colocated)
    assert [m["step"] for m in split] == [1, 2, 3]
    for ours, theirs in zip(split, together, strict=True):
        # The rollout worker's copy gets the actor's weights bit for bit and samples the same rows with the same
        # seeds; its log-probs of them equal the actor's, so every importance weight is 1.
        assert ours["rollout/staleness"] == 0 and ours["rollout/weights_version"] == ours["step"] - 1
        assert ours["rollout/log_prob_diff_mean"] == 0.0 and ours["rollout/is_weight_max"] == 1.0
        compared = [k for k in theirs if not k.startswith(("timing_s/", "perf/", "time"))]
        assert {k: ours[k] for k in compared} == {k: theirs[k] for k in compared}
        assert prompts(tmp_path / "split", ours["step"]) == prompts(colocated, ours["step"])


@pytest.mark.slow  # starts Ray and trains
def test_one_step_off_trains_on_batches_one_update_old_and_corrects_for_them(one_step_off, colocated):
    metrics = read_metrics(one_step_off)
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 1]
    assert [m["rollout/weights_version"] for m in metrics] == [0, 0, 1]
    # Step 1 samples from the weights it trains; step 3's batch came from the weights before step 2's update,
    # so the actor's log-probs of it moved away from the rollout's, and the importance weights show it.
    assert metrics[0]["rollout/log_prob_diff_mean"] == 0.0
    assert metrics[2]["rollout/log_prob_diff_mean"] > 0.0 and metrics[2]["rollout/is_weight_max"] != 1.0
    # The same prompts in the same order as the colocated run: drawing one step ahead skips nothing.
    for step in (1, 2, 3):
        assert prompts(one_step_off, step) == prompts(colocated, step)
    assert all(m["timing_s/weight_push"] > 0 for m in metrics[:2])


@pytest.mark.slow  # starts Ray and trains
def test_a_killed_rollout_worker_fails_the_run_naming_it_and_the_run_resumes_from_its_last_checkpoint(
        tmp_path, sample_sets):
    run_dir = tmp_path / "killed"
    args = tiny_overrides(sample_sets, **{**SHAPE, "trainer.rollout_mode": "async",
                                          "trainer.total_training_steps": 200})
    command = [sys.executable, "-m", "backend", "train", "defaults", *args, "--run-dir", str(run_dir)]
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: len(read_metrics(run_dir)) >= 2)
            victim = read_status(run_dir)["rollout_workers"][0]["pid"]
            os.kill(victim, signal.SIGKILL)
            proc.wait(timeout=120)  # the actor's ranks and the controller do not wait on the dead worker
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    status = read_status(run_dir)
    assert status["state"] == "failed"
    assert f"rollout rank 0 (pid {victim}" in status["error"] and "died" in status["error"]
    last = int(list_checkpoints(run_dir)[-1].name.split("_")[1])
    more = tiny_overrides(sample_sets, **{**SHAPE, "trainer.rollout_mode": "async", "trainer.resume_mode": "auto",
                                          "trainer.total_training_steps": last + 1})
    with Trainer(load_config(None, more), run_dir, show_progress=False) as t:
        t.train()
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, last + 2))
    assert read_status(run_dir)["state"] == "succeeded"


@pytest.mark.slow  # starts Ray and trains
def test_a_resumed_one_step_off_run_generates_the_batch_that_was_in_flight_again(tmp_path, sample_sets,
                                                                                   one_step_off):
    # The checkpoint of step 1 was saved while step 2's batch was being generated; resumed from it, the run
    # draws step 2's prompts again and samples them from the checkpoint's weights (nothing stale to correct).
    resumed = train(tmp_path / "resumed", sample_sets, **{
        "trainer.rollout_mode": "async", "trainer.max_staleness": 1, "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": str(one_step_off / "checkpoints/step_1")})
    assert [m["step"] for m in resumed] == [2, 3]
    assert [m["rollout/staleness"] for m in resumed] == [0, 1]
    assert prompts(tmp_path / "resumed", 2) == prompts(one_step_off, 2)
    assert prompts(tmp_path / "resumed", 3) == prompts(one_step_off, 3)


# Loaded by every Python process started with this folder on PYTHONPATH (Ray's workers get the run's): in the
# rollout worker, the weight broadcast leaves the second tensor as the first broadcast left it, as a broadcast that
# skipped it would.
SKIP_ONE_TENSOR = patching_sitecustomize("backend.engine.rollout_worker", """
def patch(module):
    import types

    real, first = module.distributed, {}

    def broadcast_tensors(group, tensors):
        real.broadcast_tensors(group, tensors)
        tensors[1].data.copy_(first.setdefault("kept", tensors[1].detach().clone()))

    module.distributed = types.SimpleNamespace(param_dtype=real.param_dtype, transfer_group=real.transfer_group,
                                               broadcast_tensors=broadcast_tensors)
""")


@pytest.mark.slow  # launches a run
def test_a_broadcast_that_left_a_tensor_behind_fails_the_run_naming_the_rollout_worker_and_the_tensor(
        tmp_path, sample_sets, monkeypatch):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SKIP_ONE_TENSOR)
    monkeypatch.setenv("PYTHONPATH", str(hook))
    cfg = load_config(None, tiny_overrides(sample_sets, **{**SHAPE, "trainer.rollout_mode": "async",
                                                            "trainer.max_staleness": 0}))
    run_dir = launch(cfg, name="stale", runs_root=tmp_path / "runs")
    wait_for(lambda: (read_status(run_dir) or {}).get("state") in ("failed", "succeeded"))
    status = read_status(run_dir)
    # Step 1 sampled from the first broadcast, which was whole; step 2's kept one tensor of step 0 and failed before
    # anything sampled from it.
    assert status["state"] == "failed" and status["step"] == 2, status
    assert [m["step"] for m in read_metrics(run_dir)] == [1]
    assert status["error"].startswith("WorkerStaleWeights: rollout rank 0 (pid ")
    assert ("failed during weight broadcast: StaleWeightsError: after the weight sync the rollout worker's copy of "
            "1 of the actor's tensors differs from the actor's: model.layers.0.self_attn.q_proj.weight"
            ) in status["error"]
    d = status["diagnosis"]
    assert (d["kind"], d["engine"], d["count"], d["tensors"]) == (
        "stale weights", "the rollout worker", 1, ["model.layers.0.self_attn.q_proj.weight"])


def test_what_async_does_not_run_with_is_refused_before_anything_starts(sample_sets):
    with pytest.raises(ConfigError) as e:
        load_config(None, tiny_overrides(sample_sets, **{
            "trainer.rollout_mode": "async", "trainer.max_staleness": 2, "actor_rollout_ref.model.lora_rank": 4,
            "actor_rollout_ref.rollout.multi_turn.enable": "true"}))
    text = str(e.value)
    assert "trainer.max_staleness=2 is not allowed: 0 (synchronous) or 1" in text
    assert "trainer.rollout_mode=async does not run with actor_rollout_ref.model.lora_rank > 0" in text
    assert "trainer.rollout_mode=async does not run with actor_rollout_ref.rollout.multi_turn.enable" in text


def test_a_tensor_the_broadcast_left_behind_changes_its_checksum():
    weights = [("a", torch.randn(64, 64)), ("b", torch.randn(1000))]
    sent = checksums(weights)
    assert checksums([(n, t.clone()) for n, t in weights]) == sent
    stale = [("a", weights[0][1].clone()), ("b", weights[1][1].clone())]
    stale[1][1][::7] += 1e-3  # a few of the sampled values off by a rounding's worth
    got = checksums(stale)
    assert got["a"] == sent["a"] and got["b"] != sent["b"]
