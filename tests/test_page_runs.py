"""The Runs page's logic, through Streamlit's AppTest: it reads run directories and never crashes."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.core.config import load_config, to_yaml
from backend.engine.trainer import Trainer

from .conftest import REPO, patching_sitecustomize, tiny_overrides

PAGE = str(REPO / "pages/runs.py")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GRPO_WB_HOME", str(tmp_path))
    return tmp_path


def page(home: Path) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    return at


def test_with_no_runs_the_page_says_so_and_offers_launch(home):
    at = page(home).run()
    assert not at.exception
    assert any("No runs yet" in i.value for i in at.info)
    assert at.button(key="launch_button")


@pytest.mark.slow
def test_a_finished_run_is_listed_and_its_charts_drawn(home, sample_sets):
    cfg = load_config(None, tiny_overrides(sample_sets))
    run_dir = home / "runs" / "20260101-000000-done"
    Trainer(cfg, run_dir, show_progress=False).train()
    (run_dir / "evals").mkdir()
    (run_dir / "evals/step_2__val.json").write_text(
        '{"checkpoint": "step_2", "data_file": "val.parquet", "metrics": {"val/accuracy": 0.25}}')
    at = page(home).run()
    assert not at.exception
    assert at.selectbox(key="runs_selected").value == "20260101-000000-done"
    assert any("succeeded" in m.value for m in at.markdown)
    assert len(at.get("plotly_chart")) >= 8
    assert any(h.value == "Evaluations" for h in at.subheader)


def test_an_invalid_config_in_the_session_cannot_be_launched(home):
    at = page(home)
    at.session_state["config_yaml_text"] = "data:\n  train_batch_size: 0\n"
    at.run()
    assert not at.exception
    assert any("data.train_batch_size=0 must be >= 1" in e.value for e in at.error)
    assert at.button(key="launch_button").disabled


def test_a_failed_run_shows_its_error_and_a_deleted_run_is_reported(home, sample_sets):
    run_dir = home / "runs" / "20260101-000000-broken"
    train_file = home / "train.parquet"
    shutil.copy(sample_sets["train"], train_file)
    cfg = load_config(None, tiny_overrides(sample_sets, **{"data.train_files": f"[{train_file}]"}))
    trainer = Trainer(cfg, run_dir, show_progress=False)
    train_file.unlink()
    with pytest.raises(Exception, match="train.parquet"):
        trainer.train()
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    at = page(home).run()
    assert not at.exception
    assert any("train.parquet" in e.value for e in at.error)
    shutil.rmtree(run_dir)
    at.run()
    assert not at.exception


def test_what_an_action_did_stays_shown_over_the_reruns_that_follow_it(home):
    """A launch, resume or fork changes some run's state within seconds, and every change of state reruns the
    page: the notice must outlive those reruns, above the run it concerns only."""
    other = home / "runs" / "20260101-000000-other"
    other.mkdir(parents=True)
    (other / "status.json").write_text(json.dumps({"state": "succeeded", "step": 1, "total_steps": 1}))
    dump = home / "verl_dump"
    dump.mkdir()
    (dump / "10.jsonl").write_text(json.dumps({"input": "user: 1+1?", "output": "2", "score": 1.0, "step": 10}) + "\n")
    at = page(home).run()
    at.text_input(key="import_folder").input(str(dump))
    at.text_input(key="import_name").input("verl-dump").run()
    at.button(key="import_button").click().run()
    imported = at.selectbox(key="runs_selected").value
    assert imported.endswith("verl-dump")
    at.run()
    assert not at.exception
    assert [s.value for s in at.success] == [f"Imported {imported}"]
    at.selectbox(key="runs_selected").select(other.name).run()
    assert not at.success


def test_a_run_that_reports_nothing_for_too_long_gets_a_stall_warning(home):
    run_dir = home / "runs" / "20260101-000000-stuck"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("trainer:\n  stall_warning_s: 30\n")
    old = time.time() - 600
    # this test process stands in for a live trainer (its pid is alive) that stopped reporting
    (run_dir / "status.json").write_text(json.dumps({
        "state": "running", "pid": os.getpid(), "host": os.uname().nodename, "step": 3, "total_steps": 10,
        "stage": "generating token 5/64 of 16 responses", "stage_started": old, "heartbeat": old}))
    at = page(home).run()
    assert not at.exception
    assert any("No progress reported for more than 30 s" in w.value for w in at.warning)


def test_a_run_waiting_for_a_debugger_says_where_to_attach_and_lists_its_workers(home):
    run_dir = home / "runs" / "20260101-000000-debug"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("trainer:\n  n_gpus_per_node: 2\n")
    workers = [{"rank": r, "pid": 4000 + r, "host": "node-a", "ip": "10.0.0.5", "device": "cuda"} for r in range(2)]
    (run_dir / "status.json").write_text(json.dumps({
        "state": "running", "pid": os.getpid(), "host": os.uname().nodename, "step": 3, "total_steps": 10,
        "stage": "worker rank 1 is waiting for a debugger at 10.0.0.5:5678", "stage_started": time.time(),
        "heartbeat": time.time(), "workers": workers, "debugger": "10.0.0.5:5678"}))
    at = page(home).run()
    assert not at.exception
    assert any("10.0.0.5:5678" in i.value and "Remote Attach" in i.value for i in at.info)
    assert any("rank 1 pid 4001 on node-a (cuda)" in c.value for c in at.caption)


def write_finished_run(home: Path, name: str, lines: list[dict]) -> Path:
    """A succeeded two-step run directory holding these metrics lines."""
    run_dir = home / "runs" / name
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("trainer:\n  total_training_steps: 2\n")
    (run_dir / "status.json").write_text(json.dumps({"state": "succeeded", "step": 2, "total_steps": 2,
                                                     "heartbeat": time.time()}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return run_dir


def test_a_reward_function_that_fails_is_reported_with_its_counts_and_first_error(home):
    lines = [{"step": 1, "critic/score/mean": 0.5, "reward/errors": 0.0, "reward/timeouts": 0.0, "reward/invalid": 0.0},
             {"step": 2, "critic/score/mean": 0.0, "reward/errors": 3.0, "reward/timeouts": 1.0, "reward/invalid": 0.0,
              "reward/first_error": "ZeroDivisionError: division by zero"}]
    write_finished_run(home, "20260101-000000-reward", lines)
    at = page(home).run()
    assert not at.exception
    [warning] = [w.value for w in at.warning if "reward call" in w.value]
    assert warning.startswith("Step 2: 3 reward call(s) raised, 1 timed out") and "ZeroDivisionError" in warning


def test_a_multi_turn_run_charts_its_tool_use_and_reports_failed_calls_with_the_first_message(home):
    clean = {"tool/errors": 0.0, "tool/timeouts": 0.0, "tool/parse_errors": 0.0, "tool/unknown_tool": 0.0,
             "tool/bad_arguments": 0.0, "multi_turn/env_errors": 0.0}
    lines = [{"step": 1, "critic/score/mean": 0.5, "num_turns/mean": 3.0, "tool/calls_per_episode/mean": 1.0,
              "tool/success_rate": 1.0, **clean},
             {"step": 2, "critic/score/mean": 0.6, "num_turns/mean": 2.5, "tool/calls_per_episode/mean": 1.5,
              "tool/success_rate": 0.5, **clean, "tool/parse_errors": 2.0, "tool/timeouts": 1.0,
              "multi_turn/env_errors": 1.0, "tool/first_error": "calculator: Error: calculator: division by zero"}]
    write_finished_run(home, "20260101-000000-tools", lines)
    at = page(home).run()
    assert not at.exception
    titles = [c.proto.spec for c in at.get("plotly_chart")]
    assert any("Turns per episode" in t for t in titles) and any("Failed tool calls" in t for t in titles)
    [info] = [i.value for i in at.info if "tool calls" in i.value]
    assert info.startswith("Step 2: tool calls: 1 timed out, 2 were not valid calls; 1 episode(s) ended by an "
                           "environment error") and "division by zero" in info


def test_an_async_run_charts_its_staleness_and_importance_weights_and_lists_its_rollout_workers(home):
    lines = [{"step": s, "critic/score/mean": 0.5, "rollout/staleness": min(s - 1, 1), "rollout/is_weight_mean": 1.0,
              "rollout/is_weight_max": 1.0 + s / 10, "rollout/is_clipfrac": 0.0, "rollout/log_prob_diff_mean": s / 100}
             for s in (1, 2)]
    run_dir = write_finished_run(home, "20260101-000000-async", lines)
    status = json.loads((run_dir / "status.json").read_text())
    status["rollout_workers"] = [{"rank": 0, "pid": 4100, "host": "node-b", "device": "cuda"}]
    (run_dir / "status.json").write_text(json.dumps(status))
    at = page(home).run()
    assert not at.exception
    titles = [c.proto.spec for c in at.get("plotly_chart")]
    for title in ("Staleness (updates behind the actor)", "Importance weights (trainer over rollout)",
                  "Log-prob gap (trainer minus rollout)"):
        assert any(title in t for t in titles), title
    assert any(c.value == "rollout workers: rank 0 pid 4100 on node-b (cuda)" for c in at.caption)


def test_dump_the_next_step_asks_a_running_run_and_its_dumps_are_listed_with_the_replay_command(home):
    run_dir = home / "runs" / "20260101-000000-live"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "dumps" / "step_2").mkdir(parents=True)
    (run_dir / "dumps" / "step_2" / "logged.json").write_text('{"step": 2}')
    (run_dir / "dumps" / ".tmp_step_3").mkdir()  # being written: not listed
    (run_dir / "config.yaml").write_text("trainer: {}\n")
    (run_dir / "status.json").write_text(json.dumps({
        "state": "running", "pid": os.getpid(), "host": os.uname().nodename, "step": 3, "total_steps": 10,
        "stage": "generating", "stage_started": time.time(), "heartbeat": time.time()}))
    at = page(home).run()
    assert [c.value for c in at.code if "backend replay" in c.value] == [
        f"python -m backend replay {run_dir / 'dumps' / 'step_2'} --pdb"]
    at.button(key="run_dump_next").click().run()
    assert not at.exception
    assert (run_dir / "dump_next").exists()  # what the trainer takes at its next step
    assert at.button(key="run_dump_next").disabled
    assert any("the next step saves its update" in i.value for i in at.info)


def test_a_stalled_call_shows_a_diagnosis_panel_with_each_rank_and_the_stacks(home):
    run_dir = home / "runs" / "20260101-000000-stalled"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "diagnosis").mkdir()
    (run_dir / "diagnosis" / "hang_step_3.txt").write_text("=== controller (pid 1 on vm)\n--- thread MainThread\n")
    (run_dir / "config.yaml").write_text("trainer: {}\n")
    ranks = ["rank 0 (pid 11 on vm): at log_probs.py:276 in response_log_probs, inside torch.distributed's "
             "all_gather_single", "rank 1 (pid 12 on vm): no answer within 10 s"]
    diagnosis = {"kind": "hang", "call": "reference log-probs", "step": 3, "seconds": 312, "ranks": ranks,
                 "final": False, "file": "diagnosis/hang_step_3.txt"}
    status = {"state": "running", "pid": os.getpid(), "host": os.uname().nodename, "step": 3, "total_steps": 10,
              "stage": "computing reference log-probs", "stage_started": time.time(), "heartbeat": time.time(),
              "diagnosis": diagnosis}
    (run_dir / "status.json").write_text(json.dumps(status))
    at = page(home).run()
    assert not at.exception
    assert any("reference log-probs ran 312 s and is still running" in w.value for w in at.warning)
    assert any("inside torch.distributed's all_gather_single" in m.value and "rank 1 (pid 12 on vm): no answer"
               in m.value for m in at.markdown)
    assert any(c.value.startswith("=== controller") for c in at.code)

    (run_dir / "status.json").write_text(json.dumps({**status, "state": "failed", "error": "WorkerError: hung",
                                                     "diagnosis": {**diagnosis, "final": True}}))
    at = page(home).run()
    assert any("the run failed with this diagnosis" in e.value for e in at.error)


def test_a_run_that_ran_out_of_memory_shows_the_rank_phase_what_it_held_and_what_would_fit(home):
    run_dir = home / "runs" / "20260101-000000-oom"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("trainer: {}\n")
    diagnosis = {"kind": "out of memory", "call": "the actor update", "rank": "worker rank 0 (pid 8 on node-a)",
                 "phase": "update", "device": "cuda", "peak_reserved_gib": 78.6, "device_gib": 79.1,
                 "note": "the planner predicted 3.09 GiB reserved for update; the rank held 78.60 GiB",
                 "suggestions": ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64: saves 1.94 GiB (1.15 GiB, "
                                 "fits); more micro-batches, the same update"]}
    (run_dir / "status.json").write_text(json.dumps({
        "state": "failed", "step": 0, "heartbeat": time.time(), "error": "WorkerOutOfMemory: ...",
        "diagnosis": diagnosis}))
    at = page(home).run()
    assert not at.exception
    assert any("worker rank 0 (pid 8 on node-a) ran out of memory during the actor update (phase update): 78.60 GiB"
               in e.value for e in at.error)
    assert any("ppo_micro_batch_size_per_gpu=64: saves 1.94 GiB" in m.value for m in at.markdown)
    assert any(m.value.startswith("The planner predicted 3.09 GiB") for m in at.markdown)


# Loaded by every Python process started with this folder on PYTHONPATH (Ray's workers get the run's): the
# workbench engine's weight sync leaves layer 0 as the first sync left it, as a sync that skipped it would.
SKIP_LAYER_0 = patching_sitecustomize("backend.rollout.static_cache", """
def patch(module):
    import torch

    sync, first = module.StaticCacheEngine.load_weights, {}

    def load_weights(engine, model):
        sync(engine, model)
        for k, v in vars(engine.layers[0]).items():
            if isinstance(v, torch.Tensor):
                v.copy_(first.setdefault(k, v.clone()))

    module.StaticCacheEngine.load_weights = load_weights
""")


@pytest.mark.slow
def test_a_run_whose_engine_kept_stale_weights_fails_and_the_page_names_the_engine_and_the_tensors(
        home, sample_sets, tmp_path, monkeypatch):
    """A launched run (its own process and Ray, whose workers load the hook above): the failure crosses Ray as the
    worker raised it, and the trainer writes it into the run's diagnosis."""
    from backend.core.runs import read_status
    from backend.services.launcher import launch

    from .conftest import wait_for

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SKIP_LAYER_0)
    monkeypatch.setenv("PYTHONPATH", str(hook))
    cfg = load_config(None, tiny_overrides(sample_sets, **{
        "actor_rollout_ref.rollout.name": "workbench", "actor_rollout_ref.actor.optim.lr": 1e-2,
        "trainer.total_training_steps": 3, "data.val_files": "[]"}))
    run_dir = launch(cfg, name="stale", runs_root=home / "runs")
    wait_for(lambda: (read_status(run_dir) or {}).get("state") in ("failed", "succeeded"))
    status = read_status(run_dir)
    assert status["state"] == "failed" and status["step"] == 1, status  # the first sync was whole
    assert status["error"].startswith("WorkerStaleWeights: ") and ("StaleWeightsError: after the weight sync the "
                                                                   "workbench engine's copy of 11 of the actor's "
                                                                   "tensors differs") in status["error"]
    d = status["diagnosis"]
    assert (d["kind"], d["engine"], d["count"]) == ("stale weights", "the workbench engine", 11)
    assert d["tensors"][0] == "model.layers.0.input_layernorm.weight"
    assert all(t.startswith("model.layers.0.") for t in d["tensors"])
    at = page(home).run()
    assert not at.exception
    assert any("the workbench engine's copy of 11 of the actor's tensors differed from the actor's" in e.value
               for e in at.error)
    assert any("`model.layers.0.mlp.down_proj.weight`" in m.value for m in at.markdown)
