"""The Compare page through Streamlit's AppTest: it compares, evaluates and exports, and every mistake
is a message, never an exception."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from page_support import OPENED_RUN
from streamlit.testing.v1 import AppTest

from backend.core.config import load_config
from backend.engine.trainer import Trainer

from .conftest import REPO, tiny_overrides

PAGE = str(REPO / "pages/compare.py")
RUN = "20260101-000000-tiny"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, sample_sets) -> Path:
    run_dir = tmp_path_factory.mktemp("trained") / RUN
    cfg = load_config(None, tiny_overrides(sample_sets, **{"trainer.save_freq": 1}))
    Trainer(cfg, run_dir, show_progress=False).train()
    return run_dir


@pytest.fixture
def home(tmp_path, monkeypatch, trained, sample_sets) -> Path:
    """A workspace with the sample sets in sample_data/ and one finished tiny run in runs/."""
    monkeypatch.setenv("GRPO_WB_HOME", str(tmp_path))
    (tmp_path / "sample_data").mkdir()
    for path in sample_sets.values():
        shutil.copy(path, tmp_path / "sample_data" / Path(path).name)
    shutil.copytree(trained, tmp_path / "runs" / RUN)
    return tmp_path


def page(**state) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["compare_model_a"] = "tiny-qwen3 (shipped)"
    at.session_state["compare_max_tokens"] = 8
    for key, value in state.items():
        at.session_state[key] = value
    return at


@pytest.mark.slow
def test_the_page_renders_with_models_of_the_run_to_pick(home):
    at = page().run()
    assert not at.exception and not at.error
    assert at.selectbox(key="compare_model_a").value == "tiny-qwen3 (shipped)"
    assert at.selectbox(key="compare_model_b").value == f"run {RUN} · export"  # the newest trained model
    assert f"run {RUN} · step_2" in at.selectbox(key="compare_model_b").options
    assert at.selectbox(key="compare_data").value == "sample_data/arithmetic_val.parquet"
    assert at.selectbox(key="evalx_run").value == RUN
    assert at.selectbox(key="evalx_checkpoint").options == ["step_2", "step_1", "export"]
    for key in ("compare_go", "compare_batch_go", "evalx_eval", "evalx_export"):
        assert at.button(key=key)


def test_the_page_renders_without_runs_or_data(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_WB_HOME", str(tmp_path))
    at = page().run()
    assert not at.exception
    assert any("No runs yet" in i.value for i in at.info)
    assert any("Pick a parquet file" in i.value for i in at.info)
    assert at.button(key="compare_batch_go").disabled


def test_prompts_are_answered_by_both_models_side_by_side(home):
    at = page(compare_prompts="What is 2 + 3?\nWhat is 4 + 4?").run()
    at.button(key="compare_go").click().run()
    assert not at.exception and not at.error
    assert len(at.code) == 4  # two prompts, two answers each
    assert sum("What is 4 + 4?" in m.value for m in at.markdown) == 1
    at.run()  # a rerun shows the same answers without generating again
    assert len(at.code) == 4


def test_an_answer_of_newlines_only_says_so_and_why(home):
    # tiny random models answer these prompts greedily with newlines and nothing else
    at = page(compare_prompts="What is 2 + 3?", compare_model_b="tiny-llama (shipped)").run()
    at.button(key="compare_go").click().run()
    assert not at.exception and not at.error
    blank = [c.value for c in at.caption if c.value.startswith("The answer is")]
    assert len(blank) == 2 and all(re.match(r"The answer is \d+ newlines, nothing else", b) for b in blank)
    assert "Small random models" in blank[0]


def test_b_starts_at_the_export_of_the_run_opened_last_not_the_newest_export(home):
    newer = home / "runs" / "20260102-000000-newer"
    shutil.copytree(home / "runs" / RUN, newer)
    status = json.loads((newer / "status.json").read_text())
    status["started"] += 3600
    (newer / "status.json").write_text(json.dumps(status))
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state[OPENED_RUN] = RUN  # what the Runs and Rollouts pages record
    at.run()
    assert not at.exception
    assert at.selectbox(key="compare_model_a").value == "tiny-qwen3 (shipped)"  # the run's base model
    assert at.selectbox(key="compare_model_b").value == f"run {RUN} · export"
    assert at.selectbox(key="evalx_run").value == RUN
    assert not page().run().selectbox(key="compare_model_b").value.startswith(f"run {RUN}")  # else the newest


def test_batch_compare_with_limit_4_shows_accuracy_difference_and_interval(home):
    at = page(compare_limit=4).run()
    at.button(key="compare_batch_go").click().run()
    assert not at.exception and not at.error
    labels = [m.label for m in at.metric]
    assert labels.count("Accuracy") == 2 and labels.count("pass@1") == 2 and labels.count("maj@1") == 2
    assert "Accuracy difference B − A" in labels
    for m in at.metric:
        if m.label == "Accuracy":
            assert 0.0 <= float(m.value) <= 1.0
    assert any("4 questions" in c.value for c in at.caption)
    assert any("95% confidence interval" in m.value for m in at.markdown)
    assert at.get("expander") is not None  # one expander per disagreement (possibly none)


def test_a_bad_model_path_or_data_path_is_a_message(home):
    at = page().run()
    at.text_input(key="compare_path_a").set_value("/etc").run()
    assert not at.exception
    assert any("outside the allowed folders" in e.value for e in at.error)
    assert at.button(key="compare_go").disabled and at.button(key="compare_batch_go").disabled
    at.text_input(key="compare_path_a").set_value("sample_data").run()
    assert any("not a model folder" in e.value for e in at.error)
    at.text_input(key="compare_path_a").set_value(f"runs/{RUN}/checkpoints/step_1").run()
    assert not at.error
    at.text_input(key="compare_data_path").set_value("nowhere.parquet").run()
    assert any("does not exist" in e.value for e in at.error)


def test_a_file_that_does_not_fit_is_a_message(home):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["1+1?"]}), home / "sample_data" / "bad.parquet")
    at = page(compare_data_path="sample_data/bad.parquet", compare_limit=2).run()
    at.button(key="compare_batch_go").click().run()
    assert not at.exception
    assert any("Comparison failed" in e.value and "prompt" in e.value for e in at.error)


def test_evaluating_a_checkpoint_shows_its_accuracy_and_keeps_it(home):
    at = page(evalx_limit=3).run()
    at.button(key="evalx_eval").click().run()
    assert not at.exception and not at.error
    assert any(m.label.startswith("Accuracy of step_2 on arithmetic_val.parquet (3 questions)") for m in at.metric)
    assert (home / "runs" / RUN / "evals" / "step_2__arithmetic_val.json").exists()
    [table] = [d.value for d in at.dataframe if "checkpoint" in d.value.columns]
    assert table["checkpoint"].tolist() == ["step_2"] and table["questions"].tolist() == [3]


def test_the_export_button_writes_a_folder_under_exports(home):
    from transformers import AutoModelForCausalLM

    at = page().run()
    assert at.text_input(key="evalx_export_name").value == f"{RUN}-step_2"
    at.selectbox(key="evalx_checkpoint").set_value("step_1").run()
    assert at.text_input(key="evalx_export_name").value == f"{RUN}-step_1"  # follows the checkpoint
    at.text_input(key="evalx_export_name").set_value("my-model").run()
    at.button(key="evalx_export").click().run()
    assert not at.exception and not at.error
    out = home / "exports" / "my-model"
    assert any(str(out) in s.value for s in at.success)
    AutoModelForCausalLM.from_pretrained(out)
    assert "step 1 of 2" in (out / "README.md").read_text()
    at.run()
    assert "export my-model" in at.selectbox(key="compare_model_b").options
    at.button(key="evalx_export").click().run()  # again: the folder exists
    assert any("already exists" in e.value for e in at.error) and not at.success
    at.text_input(key="evalx_export_name").set_value("../escape").run()
    at.button(key="evalx_export").click().run()
    assert any("is not allowed" in e.value for e in at.error)
    assert not (home.parent / "escape").exists()
