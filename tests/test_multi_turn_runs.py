"""Multi-turn runs end to end on a tiny model that calls the calculator: the run directory holds each
episode's turns and tool calls, the token log marks observation tokens as not sampled, the tool metrics
are logged, and GRPO and PPO (a critic over interior zeros) both train."""

from __future__ import annotations

import importlib.util
import json
import math

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from backend.core.config import load_config
from backend.core.data import write_rows
from backend.core.runs import read_metrics, read_status
from backend.engine.trainer import Trainer

from .conftest import tiny_overrides

pytestmark = pytest.mark.slow

ENV = """
from backend import Step, register_environment
from backend.envs.environment import ToolEnvironment


class Graded(ToolEnvironment):
    '''The tool environment, with a reward part for each call that answered.'''

    def step(self, assistant_text):
        step = super().step(assistant_text)
        step.reward = {"answered_calls": 0.5 * sum(c.failure is None for c in step.tool_calls)}
        return step
"""


@pytest.fixture(scope="module")
def sums(tmp_path_factory) -> dict[str, str]:
    """Questions in the form the tool model was taught to answer with a calculator call."""
    folder = tmp_path_factory.mktemp("sums")
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {}}
            for a, b in ((3, 4), (20, 5), (41, 8), (7, 70), (16, 2), (90, 9), (5, 55), (12, 12))]
    write_rows(rows, folder / "train.parquet")
    write_rows(rows[:4], folder / "val.parquet")
    return {"train": str(folder / "train.parquet"), "val": str(folder / "val.parquet")}


def multi_turn_overrides(sums, tool_model, env_file, **extra):
    return tiny_overrides(sums, **{
        "actor_rollout_ref.model.path": str(tool_model), "data.max_response_length": 200,
        "data.max_prompt_length": 300, "actor_rollout_ref.rollout.multi_turn.enable": True,
        "actor_rollout_ref.rollout.multi_turn.tools": "[calculator]",
        "actor_rollout_ref.rollout.multi_turn.environment": f"{env_file}:Graded",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
        "actor_rollout_ref.rollout.name": "workbench", "trainer.total_training_steps": 1, "trainer.test_freq": 1,
        **extra})


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "graded.py"
    path.write_text(ENV)
    return path


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, sums, tool_model, env_file):
    run_dir = tmp_path_factory.mktemp("runs") / "multi_turn"
    cfg = load_config(None, multi_turn_overrides(sums, tool_model, env_file, **{"trainer.save_freq": 1}))
    Trainer(cfg, run_dir, show_progress=False).train()
    return run_dir


def test_a_multi_turn_grpo_run_logs_turns_tool_calls_and_environment_rewards(grpo_run):
    assert read_status(grpo_run)["state"] == "succeeded"
    (m,) = read_metrics(grpo_run)
    for key in ("num_turns/mean", "multi_turn/assistant_turns/mean", "tool/calls_per_episode/mean",
                "tool/calculator/calls", "tool/success_rate", "multi_turn/truncated_by_turns",
                "multi_turn/observation_tokens/mean", "timing_s/tools", "reward/environment/mean",
                "val/tool_call_rate"):
        assert key in m and math.isfinite(m[key]), key
    assert m["tool/calculator/calls"] >= 1 and m["multi_turn/observation_tokens/mean"] > 0

    table = pq.read_table(grpo_run / "rollouts" / "step_000001.parquet").to_pylist()
    assert len(table) == 8
    for row in table:
        turns = json.loads(row["turns"])
        assert turns[0]["role"] == "assistant" and row["num_turns"] == len(turns)
        assert row["finish_reason"] in ("stop", "length", "max_turns")
        answered = sum(c["failure"] is None for t in turns for c in t.get("tool_calls", []))
        assert row["reward_environment"] == pytest.approx(0.5 * answered)
        assert row["response"] == turns[-1]["text"] if turns[-1]["role"] == "assistant" else True
        assert "You can call tools" in row["prompt"]  # the tools offered in the system text


def test_the_token_log_marks_observation_tokens_inside_an_episode_as_not_sampled(grpo_run):
    tokens = pq.read_table(grpo_run / "rollouts" / "tokens_step_000001.parquet").to_pylist()
    with_observation = [r for r in tokens if not all(r["sampled"])]
    assert with_observation, "no logged episode held an observation"
    # An episode may end on an observation (its last turn's call, cut by the turn limit); one that samples
    # again after it shows the gap inside the episode.
    interior = [r for r in with_observation if any(r["sampled"][r["sampled"].index(False):])]
    assert interior, "no logged episode sampled again after an observation"
    for row in with_observation:
        assert all(a == 0 for a, s in zip(row["advantage"], row["sampled"], strict=True) if not s)


def test_ppo_with_a_critic_trains_on_episodes_from_hugging_face_generate(tmp_path, sums, tool_model, env_file,
                                                                         grpo_run):
    run_dir = tmp_path / "ppo"
    cfg = load_config(None, multi_turn_overrides(sums, tool_model, env_file, **{
        "algorithm.adv_estimator": "gae", "actor_rollout_ref.rollout.name": "hf", "trainer.val_before_train": False,
        "trainer.test_freq": 0}))
    Trainer(cfg, run_dir, show_progress=False).train()
    (m,) = read_metrics(run_dir)
    assert math.isfinite(m["critic/vf_loss"]) and math.isfinite(m["actor/pg_loss"])
    before = load_file(tool_model / "model.safetensors")
    after = load_file(run_dir / "export" / "model.safetensors")
    assert any(not before[k].equal(after[k]) for k in before)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="vLLM is optional and runs on CUDA GPUs only: this test runs where both are")
def test_vllm_plays_episodes_keeping_its_log_probs_on_the_sampled_tokens_only(tmp_path, sums, tool_model, env_file):
    """Lockstep turns through vLLM inside the workers, one weight push per step."""
    run_dir = tmp_path / "vllm"
    cfg = load_config(None, multi_turn_overrides(sums, tool_model, env_file, **{
        "trainer.device": "cuda", "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.2, "actor_rollout_ref.rollout.enforce_eager": True,
        "actor_rollout_ref.actor.use_torch_compile": False, "trainer.total_training_steps": 2,
        "trainer.test_freq": 0, "trainer.val_before_train": False}))
    Trainer(cfg, run_dir, show_progress=False).train()
    assert read_status(run_dir)["state"] == "succeeded"
    metrics = read_metrics(run_dir)
    for m in metrics:
        assert m["tool/calculator/calls"] >= 1 and m["multi_turn/observation_tokens/mean"] > 0
        # vLLM's log-prob of each sampled token against the trainer's, observations left out of the mean.
        assert 0 <= m["rollout/log_prob_diff_mean"] < 0.05, m["step"]
    episodes = [json.loads(r["turns"]) for r in pq.read_table(run_dir / "rollouts" / "step_000002.parquet").to_pylist()]
    assert all(t["tokens"] > 0 for turns in episodes for t in turns if t["role"] == "assistant"), episodes
    tokens = pq.read_table(run_dir / "rollouts" / "tokens_step_000002.parquet").to_pylist()
    gaps = [r["sampled"] for r in tokens if not all(r["sampled"])]
    # Sampled again after an observation: an interior gap. (An episode may also end on an observation that
    # filled its token budget.)
    assert any(any(s[s.index(False):]) for s in gaps), episodes
