"""The engine's first GRPO step (FSDP2 worker, chunked log-probs) equals a plain fp32 implementation of it."""

from __future__ import annotations

import sys
from pathlib import Path

from backend.core.config import load_config

from .conftest import tiny_overrides

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import reference_step  # noqa: E402


def test_first_step_losses_and_gradient_norm_equal_a_plain_fp32_step(sample_sets):
    cfg = load_config(None, tiny_overrides(sample_sets, **{
        "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 4, "data.max_response_length": 12,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.actor.kl_loss_coef": 0.04}))
    result = reference_step.compare_first_step(cfg, "cpu")
    assert result["relative_tolerance"] == 1e-4
    assert result["agree"], result["metrics"]
    assert result["metrics"]["actor/grad_norm"]["ours"] > 0
