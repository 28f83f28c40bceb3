"""Shared fixtures: tiny random models (built once per machine, cached) and the sample data sets."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

# Triton kernels written for the GPU run in Triton's interpreter on a machine without one; it is chosen
# when Triton is first imported, so before any test imports it. On a GPU it must stay off: it is inherited
# by the Ray workers, where vLLM's compiled Triton kernels would run in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
# AppTest runs a page as its own entry point, without the app/ folder that `streamlit run app/main.py` puts
# on the import path; the pages import their shared helpers (app/page_support.py) from there.
sys.path.insert(0, str(REPO / "app"))
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def sample_sets(tmp_path_factory) -> dict[str, Path]:
    from backend.core import data

    out = tmp_path_factory.mktemp("sample_data")
    return data.write_sample_sets(out, seed=0, n_train=64, n_val=16)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from backend.core.models import load_tokenizer

    return load_tokenizer("tiny-qwen3")


def wait_for(predicate, timeout: float = 240.0, every_s: float = 0.05) -> None:
    """Poll `predicate` every `every_s` seconds until it is true; fail the test after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout:.0f} s")


def tiny_overrides(sample_sets: dict[str, Path], model: str = "tiny-qwen3", **extra) -> list[str]:
    """Config overrides for a fast CPU run of a tiny model on the sample sets."""
    base = {
        "actor_rollout_ref.model.path": model,
        "data.train_files": f"[{sample_sets['train']}]",
        "data.val_files": f"[{sample_sets['val']}]",
        "data.train_batch_size": 2,
        "data.max_prompt_length": 128,
        "data.max_response_length": 8,
        "data.val_max_samples": 4,
        "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.actor.optim.lr": 1e-3,
        "trainer.total_training_steps": 2,
        "trainer.device": "cpu",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


# The browser tests' fixtures (the workbench served on localhost, Chromium, a page of it), for any test file.
from .browser import app_url, browser, finished_run, page, workspace  # noqa: E402, F401
