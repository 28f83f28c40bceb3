"""The Python API: the three-file example run as a user runs it, and the errors an API user meets."""

from __future__ import annotations

import subprocess
import sys

import pytest

import backend
from backend.core.runs import read_metrics
from backend.rewards.registry import register_reward
from backend.rewards.rules import arithmetic_score

from .conftest import REPO, tiny_overrides

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples/three_files"


def test_public_names_are_few_and_all_resolve():
    assert backend.__all__ == sorted(["load_config", "Config", "Trainer", "register_reward", "generate", "evaluate",
                                      "ConfigError", "DataError", "RewardError", "ModelError", "Environment", "Step",
                                      "register_environment", "register_tool", "SweepSpec", "SweepParam",
                                      "create_sweep", "run_sweep", "read_sweep"])
    for name in backend.__all__:
        assert getattr(backend, name) is not None


def test_three_file_example_trains_evaluates_generates_and_exports(tmp_path):
    result = subprocess.run(
        [sys.executable, "train.py", "actor_rollout_ref.model.path=tiny-qwen3", "trainer.total_training_steps=2",
         f"trainer.runs_root={tmp_path}", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "data.max_response_length=8", "data.val_max_samples=4", "trainer.device=cpu"],
        cwd=EXAMPLE, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    [run_dir] = list(tmp_path.iterdir())
    assert len(read_metrics(run_dir)) == 2
    assert "validation: {'val/arithmetic/accuracy':" in result.stdout
    assert "answer:" in result.stdout
    assert (run_dir / "export/config.json").exists()
    # the user's scorer, not the built-in one, scored the run: it gives -0.5 for a missing answer
    assert min(m["critic/score/min"] for m in read_metrics(run_dir)) == -0.5


def test_a_reward_function_with_the_wrong_signature_is_refused_when_registered():
    with pytest.raises(backend.RewardError, match="define it as def bad"):
        @backend.register_reward("api-test-bad")
        def bad(text):
            return 1.0


def test_a_reward_function_returning_a_non_number_scores_zero_and_is_reported(tmp_path, sample_sets):
    @backend.register_reward("arithmetic")
    def says_yes(data_source, solution_str, ground_truth, extra_info=None):
        return "yes"

    try:
        cfg = backend.load_config(None, tiny_overrides(sample_sets, **{"data.val_files": "[]"}))
        metrics = backend.Trainer(cfg, tmp_path / "r", show_progress=False).train()
    finally:
        register_reward("arithmetic")(arithmetic_score)
    assert metrics["reward/invalid"] == 8 and metrics["critic/score/max"] == 0.0
    assert "says_yes" in metrics["reward/first_error"] or "yes" in metrics["reward/first_error"]


def test_a_missing_data_file_reads_like_the_cli_error(tmp_path, sample_sets):
    cfg = backend.load_config(None, tiny_overrides(sample_sets, **{"data.train_files": "[missing.parquet]"}))
    with pytest.raises(backend.ConfigError, match="data.train_files: missing.parquet does not exist"):
        backend.Trainer(cfg, tmp_path / "r")


def test_a_config_key_typo_names_the_intended_key():
    with pytest.raises(backend.ConfigError, match="did you mean 'trainer.total_training_steps'"):
        backend.load_config(None, ["trainer.total_trainig_steps=2"])


def test_trainer_generate_and_evaluate_work_before_training(tmp_path, sample_sets):
    cfg = backend.load_config(None, tiny_overrides(sample_sets))
    trainer = backend.Trainer(cfg, tmp_path / "r", show_progress=False)
    [[a, b]] = trainer.generate("What is 1 + 1?", n=2, max_new_tokens=4)
    assert isinstance(a, str) and isinstance(b, str)
    metrics = trainer.evaluate(sample_sets["val"], limit=3)
    assert 0.0 <= metrics["val/arithmetic/accuracy"] <= 1.0
