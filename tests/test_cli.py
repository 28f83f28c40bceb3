"""The command line, run as a user runs it: `python -m backend ...` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from backend.core import data
from backend.core.runs import read_metrics, read_status

from .conftest import REPO, SHARED, tiny_overrides

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow

GSM8K = SHARED / "data/gsm8k/train.jsonl"


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "backend", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_make_sample_writes_the_committed_sample_sets(tmp_path):
    result = cli("data", "make-sample", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for name in ("arithmetic_train.parquet", "arithmetic_val.parquet"):
        assert data.load_rows(tmp_path / name) == data.load_rows(REPO / "sample_data" / name)


def test_gsm8k_conversion_takes_the_number_after_the_hashes(tmp_path):
    out = tmp_path / "gsm8k.parquet"
    result = cli("data", "gsm8k", "--input", str(GSM8K), "--output", str(out), "--limit", "20")
    assert result.returncode == 0, result.stderr
    rows = pq.read_table(out).to_pylist()
    first = json.loads(GSM8K.read_text().splitlines()[0])
    assert len(rows) == 20
    assert rows[0]["reward_model"]["ground_truth"] == first["answer"].split("####")[-1].strip().replace(",", "")
    assert rows[0]["data_source"] == "openai/gsm8k"


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, sample_sets) -> Path:
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    result = cli("train", "configs/default.yaml", *tiny_overrides(sample_sets), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "step 2/2 | score" in result.stdout
    return run_dir


def test_train_leaves_a_succeeded_run_and_its_log(cli_run):
    assert read_status(cli_run)["state"] == "succeeded"
    assert len(read_metrics(cli_run)) == 2
    assert "step 1/2" in (cli_run / "logs/train.log").read_text()


def test_train_refuses_a_run_directory_that_already_holds_a_run(cli_run, sample_sets):
    before = (cli_run / "metrics.jsonl").read_text()
    result = cli("train", "configs/default.yaml", *tiny_overrides(sample_sets), "--run-dir", str(cli_run))
    assert result.returncode == 2
    assert "already holds a run" in result.stderr and "trainer.resume_mode=auto" in result.stderr
    assert (cli_run / "metrics.jsonl").read_text() == before


def test_train_with_resume_auto_continues_from_the_last_checkpoint(tmp_path, cli_run, sample_sets):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(cli_run, run_dir)
    result = cli("train", "configs/default.yaml",
                 *tiny_overrides(sample_sets, **{"trainer.total_training_steps": 3, "trainer.resume_mode": "auto"}),
                 "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert "step 3/3" in result.stdout and "step 1/3" not in result.stdout


def test_a_bad_config_starts_nothing_and_names_the_key(tmp_path):
    run_dir = tmp_path / "never"
    result = cli("train", "configs/default.yaml", "actor_rollout_ref.rollout.temprature=0.5",
                 "data.train_batch_size=0", "--run-dir", str(run_dir))
    assert result.returncode == 2
    assert "did you mean 'actor_rollout_ref.rollout.temperature'" in result.stderr
    assert "data.train_batch_size=0 must be >= 1" in result.stderr
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()


def test_missing_data_file_and_model_path_are_reported_before_start(tmp_path):
    result = cli("train", "configs/default.yaml", "data.train_files=[nowhere.parquet]",
                 "actor_rollout_ref.model.path=./no/such/model", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2
    assert "nowhere.parquet does not exist" in result.stderr
    assert "model path ./no/such/model does not exist" in result.stderr
    assert not (tmp_path / "r").exists()


def test_lengths_past_the_models_context_are_refused_before_start(tmp_path, sample_sets):
    run_dir = tmp_path / "r"
    result = cli("train", "defaults", *tiny_overrides(sample_sets, **{"data.max_prompt_length": 1000,
                                                                    "data.max_response_length": 100}),
                 "--run-dir", str(run_dir))
    assert result.returncode == 2
    assert ("data.max_prompt_length + data.max_response_length = 1100 is longer than the model's context "
            "(1024 positions for tiny-qwen3)") in result.stderr
    assert "Traceback" not in result.stderr and not run_dir.exists()


def test_generate_prints_the_greedy_answer_that_plain_transformers_gives(cli_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backend.core.models import resolve_model

    for model in (str(cli_run / "export"), "tiny-qwen3"):
        result = cli("generate", "--model", model, "--prompt", "What is 2 + 2?", "--max-new-tokens", "5")
        assert result.returncode == 0, result.stderr
        folder = resolve_model(model)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                            add_generation_prompt=True, return_tensors="pt")["input_ids"]
        out = AutoModelForCausalLM.from_pretrained(folder).generate(ids, max_new_tokens=5, do_sample=False)
        assert result.stdout == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) + "\n"


def test_eval_reports_accuracy_on_the_exported_and_the_base_model(cli_run, sample_sets, tmp_path):
    for model in (str(cli_run / "export"), "tiny-qwen3"):
        out = tmp_path / "eval.json"
        result = cli("eval", "--model", model, "--data", str(sample_sets["val"]), "--limit", "4",
                     "--max-new-tokens", "6", "--output", str(out))
        assert result.returncode == 0, result.stderr
        assert "val/arithmetic/accuracy:" in result.stdout
        report = json.loads(out.read_text())
        assert len(report["records"]) == 4 and 0.0 <= report["metrics"]["val/accuracy"] <= 1.0
