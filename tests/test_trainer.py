"""End to end on tiny models: the run directory contract, learning signal plumbing, resume."""

from __future__ import annotations

import gc
import json
import math
import shutil
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from backend.core.config import ConfigError, load_config
from backend.core.runs import RunDir, list_checkpoints, read_metrics, read_status
from backend.engine.trainer import TableWriter, Trainer
from backend.engine.worker_group import WorkerGroup

from .conftest import tiny_overrides

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow

CORE_METRICS = [
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "actor/pg_loss", "actor/kl_loss",
    "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/lr", "response_length/mean",
    "response_length/clip_ratio", "timing_s/gen", "timing_s/update_actor", "timing_s/step", "perf/throughput",
    "perf/compile_s", "perf/compiled_graphs",
]


def train(run_dir: Path, sample_sets, **extra):
    cfg = load_config(None, tiny_overrides(sample_sets, **extra))
    Trainer(cfg, run_dir, show_progress=False).train()
    return cfg


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, sample_sets) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    train(run_dir, sample_sets, **{"trainer.save_freq": 1, "trainer.test_freq": 1})
    return run_dir


def test_a_finished_run_leaves_the_whole_run_directory_contract(finished_run):
    for name in ("config.yaml", "status.json", "metrics.jsonl", "rollouts/step_000001.parquet",
                 "rollouts/step_000002.parquet", "checkpoints/step_2/trainer_state.json", "export/config.json"):
        assert (finished_run / name).exists(), name
    status = read_status(finished_run)
    assert status["state"] == "succeeded" and status["step"] == 2 and status["total_steps"] == 2
    assert [w["deterministic"] for w in status["workers"]] == [False]  # trainer.deterministic is off by default


def test_metrics_are_written_per_step_with_verl_names_and_finite_values(finished_run):
    lines = read_metrics(finished_run)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        for key in CORE_METRICS:
            assert key in m and math.isfinite(m[key]), key
        assert "val/accuracy" in m and "val/arithmetic/accuracy" in m


def test_rollouts_hold_one_row_per_response_with_reward_parts(finished_run):
    table = pq.read_table(finished_run / "rollouts/step_000001.parquet").to_pylist()
    assert len(table) == 2 * 4
    row = table[0]
    for key in ("prompt", "response", "ground_truth", "reward", "advantage", "response_length", "finish_reason",
                "reward_correct", "reward_format", "group", "data_source"):
        assert key in row, key
    groups = {}
    for r in table:
        groups.setdefault(r["group"], []).append(r)
    assert sorted(len(g) for g in groups.values()) == [4, 4]
    for g in groups.values():
        assert len({r["prompt"] for r in g}) == 1
        assert abs(sum(r["advantage"] for r in g)) < 1e-4  # GRPO advantages sum to 0 within a group


def test_training_changes_every_weight_of_the_exported_model(finished_run):
    from backend.core.models import resolve_model

    base = load_file(Path(resolve_model("tiny-qwen3")) / "model.safetensors")
    trained = weights(finished_run / "export")
    assert base.keys() == trained.keys()
    assert [k for k in base if torch.equal(base[k], trained[k])] == []


def test_export_loads_with_plain_transformers(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(finished_run / "export")
    tokenizer = AutoTokenizer.from_pretrained(finished_run / "export")
    ids = tokenizer("1 + 1 =", return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape[1] >= ids.shape[1]


def test_old_checkpoints_beyond_the_keep_limit_are_removed(tmp_path, sample_sets):
    train(tmp_path / "r", sample_sets, **{"trainer.total_training_steps": 3, "trainer.save_freq": 1,
                                          "trainer.max_checkpoints_to_keep": 2})
    assert [p.name for p in list_checkpoints(tmp_path / "r")] == ["step_2", "step_3"]


def test_resumed_run_is_identical_to_an_uninterrupted_one(tmp_path, sample_sets):
    extra = {"trainer.save_freq": 2, "trainer.test_freq": 0, "data.val_files": "[]",
             "actor_rollout_ref.actor.ppo_mini_batch_size": 1}  # two optimizer steps: old log-probs used
    train(tmp_path / "straight", sample_sets, **{**extra, "trainer.total_training_steps": 4})
    train(tmp_path / "resumed", sample_sets, **{**extra, "trainer.total_training_steps": 2})
    train(tmp_path / "resumed", sample_sets, **{**extra, "trainer.total_training_steps": 4,
                                                 "trainer.resume_mode": "auto"})
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed, strict=True):
        for key in a:
            if not key.startswith(("timing_s/", "perf/throughput", "time")):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    wa, wb = weights(tmp_path / "straight/export"), weights(tmp_path / "resumed/export")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_with_trainer_deterministic_every_rank_trains_in_deterministic_mode(tmp_path, sample_sets):
    # PyTorch's deterministic mode raises on an operation without a deterministic form, so the whole step (the
    # engine's generation, the reference pass, the update, the checkpoint) running under it is what is checked.
    train(tmp_path / "r", sample_sets, **{"trainer.deterministic": True, "trainer.n_gpus_per_node": 2,
                                          "data.val_files": "[]"})
    status = read_status(tmp_path / "r")
    assert status["state"] == "succeeded" and status["step"] == 2
    assert [w["deterministic"] for w in status["workers"]] == [True, True]
    assert not torch.are_deterministic_algorithms_enabled()  # the ranks' processes, not this one


def test_llama_architecture_trains_with_rloo_and_kl_in_reward(tmp_path, sample_sets):
    train(tmp_path / "r", sample_sets, model="tiny-llama", **{
        "algorithm.adv_estimator": "rloo", "algorithm.use_kl_in_reward": True,
        "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum",
        "data.val_files": "[]"})
    lines = read_metrics(tmp_path / "r")
    assert len(lines) == 2 and "actor/reward_kl_penalty" in lines[-1] and "actor/kl_loss" not in lines[-1]


def test_a_raising_reward_function_scores_zero_and_the_run_goes_on(tmp_path, sample_sets):
    reward = tmp_path / "my_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if len(solution_str) % 2:\n"
        "        raise RuntimeError('odd length')\n"
        "    return 1.0\n")
    train(tmp_path / "r", sample_sets, **{"custom_reward_function.path": str(reward), "data.val_files": "[]"})
    lines = read_metrics(tmp_path / "r")
    assert read_status(tmp_path / "r")["state"] == "succeeded"
    assert sum(m["reward/errors"] for m in lines) > 0
    assert "odd length" in next(m["reward/first_error"] for m in lines if m["reward/errors"])


def test_responses_are_scored_while_the_reference_log_probs_are_computed(tmp_path, sample_sets, monkeypatch):
    """The reward function scores 1 only once the run's live stage says the reference pass has begun: it
    can see that only if scoring runs alongside the log-prob passes rather than before or after them. Some
    response must see it: on a loaded machine a scorer thread can start after a short reference pass has
    ended and score 0, but scored before or after the passes, every response scores 0."""
    reward = tmp_path / "waiting_reward.py"
    reward.write_text(
        "import json, os, time\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    deadline = time.monotonic() + 20\n"
        "    while time.monotonic() < deadline:\n"
        "        try:\n"
        "            stage = json.loads(open(os.environ['WAITING_REWARD_STATUS']).read()).get('stage', '')\n"
        "        except (OSError, ValueError):\n"
        "            stage = ''\n"
        "        if stage.startswith('computing reference'):\n"
        "            return 1.0\n"
        "        time.sleep(0.02)\n"
        "    return 0.0\n")
    monkeypatch.setenv("WAITING_REWARD_STATUS", str(tmp_path / "r" / "status.json"))
    train(tmp_path / "r", sample_sets, **{"custom_reward_function.path": str(reward), "data.val_files": "[]",
                                          "actor_rollout_ref.actor.use_kl_loss": "true", "reward.timeout_s": 60})
    lines = read_metrics(tmp_path / "r")
    assert max(m["critic/score/mean"] for m in lines) > 0
    assert all(m["timing_s/reward"] > 0 for m in lines)


@pytest.mark.parametrize(("body", "counter"), [("time.sleep(30)\n    return 1.0", "reward/timeouts"),
                                               ("return 'a string'", "reward/invalid"),
                                               ("raise ValueError('every row')", "reward/errors")])
def test_a_reward_that_fails_on_every_response_scores_zero_and_the_run_finishes(tmp_path, sample_sets, body, counter):
    reward = tmp_path / "bad_reward.py"
    reward.write_text(f"import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    {body}\n")
    train(tmp_path / "r", sample_sets, **{"custom_reward_function.path": str(reward), "data.val_files": "[]",
                                          "reward.timeout_s": 0.5})
    lines = read_metrics(tmp_path / "r")
    assert read_status(tmp_path / "r")["state"] == "succeeded" and [m["step"] for m in lines] == [1, 2]
    responses = 2 * 4  # train_batch_size x rollout.n
    assert all(m[counter] == responses and m["critic/score/mean"] == 0.0 for m in lines)
    assert all(m["actor/pg_loss"] == 0.0 for m in lines)  # no signal, so no policy gradient


def test_a_bad_data_file_is_refused_before_the_run_directory_exists(tmp_path, sample_sets):
    bad = tmp_path / "broken.parquet"
    bad.write_text("not parquet")
    cfg = load_config(None, tiny_overrides(sample_sets, **{"data.train_files": f"[{bad}]"}))
    with pytest.raises(ConfigError, match="is not a parquet file"):
        Trainer(cfg, tmp_path / "r", show_progress=False)
    assert not (tmp_path / "r").exists()


def test_a_run_whose_data_vanishes_fails_with_the_error_in_status(tmp_path, sample_sets):
    train_file = tmp_path / "train.parquet"
    shutil.copy(sample_sets["train"], train_file)
    cfg = load_config(None, tiny_overrides(sample_sets, **{"data.train_files": f"[{train_file}]"}))
    trainer = Trainer(cfg, tmp_path / "r", show_progress=False)
    train_file.unlink()
    with pytest.raises(Exception, match="train.parquet"):
        trainer.train()
    status = json.loads((tmp_path / "r/status.json").read_text())
    assert status["state"] == "failed" and "train.parquet" in status["error"] and status["traceback"]


def test_token_log_holds_per_token_quantities_of_the_first_responses(finished_run, tiny_tokenizer):
    tokens = pq.read_table(finished_run / "rollouts/tokens_step_000001.parquet").to_pylist()
    rollouts = pq.read_table(finished_run / "rollouts/step_000001.parquet").to_pylist()
    assert [t["row"] for t in tokens] == list(range(len(tokens))) and 0 < len(tokens) <= 8
    for t in tokens:
        n = rollouts[t["row"]]["response_length"]
        for key in ("token_ids", "tokens", "log_prob", "ref_log_prob", "kl", "entropy", "advantage", "clipped"):
            assert len(t[key]) == n, key
        for lp, ref, kl in zip(t["log_prob"], t["ref_log_prob"], t["kl"], strict=True):
            assert kl == pytest.approx(lp - ref, abs=1e-6)
            # The first step's "before" comes from the update's own forward, when the policy is still the
            # reference: each row's values must be its own.
            assert lp == pytest.approx(ref, abs=1e-4)
        assert all(lp <= 0 for lp in t["log_prob"]) and all(e >= 0 for e in t["entropy"])
        # each token is also decoded alone for display; a multi-byte character split across tokens
        # cannot be, so the check is on the ids
        decoded = tiny_tokenizer.decode(t["token_ids"], skip_special_tokens=True)
        assert decoded == rollouts[t["row"]]["response"]


def test_the_first_step_freezes_the_heap_of_the_controller_and_the_workers_until_the_run_ends(
        tmp_path, sample_sets, monkeypatch):
    """After the first step (what it compiled and cached stays), every process's long-lived objects leave
    the full collections; the controller's are given back to them when the run ends."""
    seen = []
    group_freeze = WorkerGroup.freeze_heap

    def spy(group):
        seen.append((gc.get_freeze_count(), group_freeze(group), len(read_metrics(tmp_path / "r"))))
        return seen[-1][1]

    monkeypatch.setattr(WorkerGroup, "freeze_heap", spy)
    train(tmp_path / "r", sample_sets, **{"data.val_files": "[]"})
    [(controller, workers, steps_logged)] = seen
    assert controller > 10_000 and len(workers) == 1 and workers[0] > 10_000
    assert steps_logged == 0  # during step 1's end, before its metrics line
    assert gc.get_freeze_count() == 0


def test_a_table_that_cannot_be_written_fails_the_run_naming_the_error(tmp_path, sample_sets, monkeypatch):
    """The token view is written off the step's path; a write that fails must still end the run with its
    error, not vanish with its thread."""
    def full_disk(self, step, rows):
        raise OSError(28, "No space left on device", str(self.rollouts))

    monkeypatch.setattr(RunDir, "write_token_log", full_disk)
    with pytest.raises(OSError, match="No space left"):
        train(tmp_path / "r", sample_sets, **{"data.val_files": "[]"})
    status = read_status(tmp_path / "r")
    assert status["state"] == "failed" and "No space left on device" in status["error"]


def test_the_table_writer_writes_steps_in_order_at_most_one_step_behind_and_raises_a_failed_write():
    writer = TableWriter()
    gate, done = threading.Event(), []
    writer.submit(1, lambda: (gate.wait(10), done.append("1a")))
    writer.submit(1, lambda: done.append("1b"))  # the same step's: queued, not waited for
    assert done == []
    gate.set()
    writer.submit(2, lambda: done.append("2"))  # waits for step 1's writes first
    assert done[:2] == ["1a", "1b"]
    writer.submit(3, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        writer.wait()
    assert done == ["1a", "1b", "2"]
