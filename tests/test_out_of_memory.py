"""A rank that runs out of memory names its phase and what it held, the run's failure says so, and the planner
adds its prediction for that phase and what would fit."""

from __future__ import annotations

import pickle

import pytest
import torch

from backend.cli import advise_after_out_of_memory
from backend.core.config import load_config, to_dict
from backend.core.runs import RunDir, read_status
from backend.engine.distributed import local_meeting_point
from backend.engine.worker_group import WorkerOutOfMemory
from backend.engine.workers import ActorRolloutRefWorker
from backend.services import planner

from .conftest import REPO, tiny_overrides
from .test_workers import padded_batch

# A rank of a large config on an H100, as rank.held_at_failure records it when its update runs out of memory.
LARGE = ("data.train_batch_size=256", "actor_rollout_ref.rollout.n=8", "data.max_prompt_length=1024",
         "data.max_response_length=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=256",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=256",
         "actor_rollout_ref.model.enable_gradient_checkpointing=false")
ON_H100 = {"phase": "update_actor", "device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "peak_reserved_gib": 78.6,
           "peak_allocated_gib": 70.0, "device_gib": 79.1, "free_gib": 0.4}
MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB"


def test_an_allocation_failure_in_a_workers_phase_leaves_with_the_phase_and_the_run_error_names_rank_and_call(
        sample_sets, tiny_tokenizer, monkeypatch):
    cfg = load_config(None, tiny_overrides(sample_sets, **{"actor_rollout_ref.rollout.n": 2}))
    worker = ActorRolloutRefWorker(to_dict(cfg), 0, 1, *local_meeting_point(), "cpu", total_steps=1)
    _, batch = padded_batch(tiny_tokenizer)
    batch["ref_log_probs"] = worker.compute_ref_log_prob(batch)
    batch["advantages"] = torch.ones_like(batch["ref_log_probs"])
    # A real failure of the CPU allocator, asked for 10 TB where the update's forward would allocate.
    monkeypatch.setattr(worker.actor, "forward", lambda *a, **k: torch.empty(10**13, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="can't allocate memory") as failure:
        worker.update_actor(batch, mini_rows=2)
    worker.shutdown()
    cause = pickle.loads(pickle.dumps(failure.value))  # as Ray hands it to the controller
    assert cause.memory == {"phase": "update_actor", "device": "cpu"}
    error = WorkerOutOfMemory("worker rank 1 (pid 7 on node-a)", "the actor update", cause)
    assert str(error).startswith("worker rank 1 (pid 7 on node-a) ran out of memory during the actor update "
                                 "(phase update_actor): RuntimeError: ")
    on_gpu = WorkerOutOfMemory("worker rank 0 (pid 8 on node-a)", "the actor update",
                               _with_memory(torch.OutOfMemoryError(MESSAGE), ON_H100))
    assert ("(phase update_actor, 78.60 GiB reserved at the phase's peak (70.00 allocated) of the 79.10 GiB of its "
            "NVIDIA H100 80GB HBM3): OutOfMemoryError: CUDA out of memory") in str(on_gpu)


def _with_memory(e: BaseException, memory: dict) -> BaseException:
    e.memory = memory
    return e


def test_the_planner_compares_its_prediction_for_the_phase_and_suggests_changes_that_fit_less_its_miss():
    cfg = load_config(REPO / "configs/default.yaml", ["actor_rollout_ref.model.path=tiny-qwen3", *LARGE])
    predicted = planner.plan(cfg, gpu="h100").phase("update").reserved_gib
    advice = planner.after_out_of_memory(cfg, ON_H100, MESSAGE)
    assert advice["phase"] == "update" and advice["predicted_gib"] == pytest.approx(predicted, rel=0.02)
    assert advice["needed_gib"] == pytest.approx(80.6)
    miss = 80.6 - advice["predicted_gib"]
    assert f"the planner's miss of {miss:.2f} GiB" in advice["note"]
    assert 1 <= len(advice["suggestions"]) <= 3
    override = advice["suggestions"][0].split(":")[0]
    smaller = planner.GPU("h100 less the miss", 79.1 - miss, None, None)
    changed = load_config(REPO / "configs/default.yaml", ["actor_rollout_ref.model.path=tiny-qwen3", *LARGE, override])
    replanned = planner._plan(changed, planner.model_dims("tiny-qwen3"), "cuda", smaller, dict(planner.CALIBRATION))
    assert replanned.need_gib < predicted and "fits" in advice["suggestions"][0]


def test_the_failed_runs_diagnosis_gets_the_planners_view(tmp_path, capsys):
    cfg = load_config(REPO / "configs/default.yaml", ["actor_rollout_ref.model.path=tiny-qwen3", *LARGE])
    run = RunDir(tmp_path / "run").create()
    error = WorkerOutOfMemory("worker rank 0 (pid 8 on node-a)", "the actor update",
                              _with_memory(torch.OutOfMemoryError(MESSAGE), ON_H100))
    # what the trainer records as the run fails
    run.write_status("failed", error=f"WorkerOutOfMemory: {error}", diagnosis={
        "kind": "out of memory", "call": error.what, "rank": error.who, **error.memory})
    advise_after_out_of_memory(run, cfg, error)
    diagnosis = read_status(run.root)["diagnosis"]
    assert diagnosis["rank"] == "worker rank 0 (pid 8 on node-a)" and diagnosis["phase"] == "update"
    assert diagnosis["peak_reserved_gib"] == 78.6 and diagnosis["suggestions"]
    assert "would fit: actor_rollout_ref." in capsys.readouterr().err
