"""Shared fixtures: tiny random models (built once per machine, cached) and the sample data sets.

`make test` runs the files in two processes at once (pytest-xdist): a test takes free ports and folders of its
own, and what it caches for the machine it writes atomically (`backend.core.models` builds models so)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

# In two test processes (`make test`), one OpenMP thread in every process the tests start: the two share two cores,
# each starting runs with a worker beside them, and a torch thread pool of one thread per core in each of those
# processes oversubscribed the cores. Set before torch is imported here; the runs, their workers and servers
# inherit it. In one process (`make test-fast`) a test has the other core to itself and keeps torch's default.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

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


CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 3"}}\n</tool_call>'


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> Path:
    """tiny-qwen3 taught (150 supervised steps) to answer questions like "What is 55 + 1?" on every turn, first
    or after a tool's output, with one calculator call: a real model whose episodes call a real tool.

    Taught once for the whole suite: the test processes of `make test` share it, the first to need it teaching
    it while the others wait (it is half a minute of CPU, and the files that use it often land in both)."""
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each process has a folder of its own inside the suite's; the suite's is shared.
    out = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "tool_model"
    with open(out.with_name("tool_model.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            partial = out.with_name("tool_model.partial")
            shutil.rmtree(partial, ignore_errors=True)
            _teach_tool_model(partial)
            partial.rename(out)
    return out


def _teach_tool_model(out: Path) -> None:
    from backend.core.models import load_model, load_tokenizer
    from backend.envs.tools import get_tool
    from backend.rollout.episodes import ChatRenderer

    tokenizer = load_tokenizer("tiny-qwen3")
    model = load_model("tiny-qwen3", torch.device("cpu"))
    renderer = ChatRenderer(tokenizer, [get_tool("calculator")], [tokenizer.eos_token_id])
    call = tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    observation = renderer.observation([{"role": "tool", "name": "calculator", "content": "36"}])
    sequences = []
    for a, b in ((2, 3), (17, 5), (40, 2), (9, 9), (123, 7), (6, 60)):
        question = f"What is {a} + {b}?"
        ids, _ = renderer.prompt([{"role": "user", "content": question}])
        labels = [-100] * len(ids)
        for turn in range(3):
            ids, labels = ids + call, labels + call
            if turn < 2:
                ids, labels = ids + observation, labels + [-100] * len(observation)
        sequences.append((ids, labels))
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in sequences])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in sequences])
    attention = (torch.arange(width) < torch.tensor([len(ids) for ids, _ in sequences]).unsqueeze(1)).long()
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(150):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


_IMPORT_HOOK = """

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
"""


def patching_sitecustomize(target: str, patch: str) -> str:
    """The text of a sitecustomize.py that runs `patch(module)` (defined in `patch`, the source of a function)
    on module `target` as it is imported, in every Python process started with its folder on PYTHONPATH: a
    launched run's workers get the run's, so a fault can be planted inside a Ray worker."""
    return ("import importlib.abc\nimport importlib.util\nimport sys\n\n"
            f"TARGET = {target!r}\n\n" + patch.strip("\n") + "\n" + _IMPORT_HOOK)


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
        # The tests compare the engine with plain fp32 models and engines with each other token for token; the
        # configs' own runs (the default, the quick try) cover bf16 on CPUs that have it.
        "actor_rollout_ref.actor.fsdp_config.param_dtype": "fp32",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def finished_trials(folder: Path, spec, runs_root: Path) -> list[Path]:
    """Two trials of a grid sweep recorded as the sweep records them, each with a finished run directory, without
    training."""
    from backend.services import sweeps  # after TRITON_INTERPRET is set above

    study = sweeps._study(folder, spec)
    runs = []
    for i in range(2):
        trial = study.ask()
        for p in spec.params:
            trial.suggest_categorical(p.key, p.values)
        run = runs_root / f"20260101-00000{i}-{folder.name}-{i:03d}"
        run.mkdir(parents=True)
        (run / "status.json").write_text(json.dumps({"state": "succeeded", "host": "elsewhere"}))
        trial.set_user_attr("run", str(run))
        study.tell(trial, 0.5)
        runs.append(run)
    return runs


# The browser tests' fixtures (the workbench served on localhost, Chromium, a page of it), for any test file.
from .browser import app_url, browser, finished_run, page, workspace  # noqa: E402, F401
