"""The data page (pages/data.py) in Streamlit's AppTest: it renders, answers, refuses, and never crashes.

The page runs in a temporary workspace (GRPO_WB_HOME) holding a copy of the sample set, with the tiny
test tokenizer preset so that no test converts SmolLM2.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "pages" / "data.py"
SAMPLE = REPO / "sample_data" / "arithmetic_train.parquet"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """One workspace for the module, so the page's caches of the sample file carry from test to test;
    tests that add files give them names of their own."""
    root = tmp_path_factory.mktemp("workspace")
    (root / "sample_data").mkdir()
    shutil.copy(SAMPLE, root / "sample_data" / SAMPLE.name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRPO_WB_HOME", str(root))
        mp.delenv("GRPO_WB_ROOTS", raising=False)
        mp.chdir(root)
        yield root


def _page() -> AppTest:
    at = AppTest.from_file(str(PAGE), default_timeout=120)
    at.session_state["data_model_name"] = "tiny-qwen3"
    return at.run()


def _texts(elements) -> list[str]:
    return [str(e.value) for e in elements]


def _assert_whole_page(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    headers = _texts(at.subheader)
    for section in ("Schema", "First rows", "SQL (read-only)", "Reward playground",
                    "Problems the engine would reject"):
        assert section in headers


def test_page_renders_the_sample_file_without_exceptions(workspace):
    at = _page()
    _assert_whole_page(at)
    assert not at.error, _texts(at.error)
    assert at.selectbox(key="data_file_select").value == "sample_data/arithmetic_train.parquet"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Rows"] == "2,000" and metrics["With ground truth"] == "2,000"
    # the landing preset's length, as no config was edited
    assert any("0 over data.max_prompt_length=128" in c for c in _texts(at.caption))
    assert any("The engine would load this file" in s for s in _texts(at.success))


def test_the_model_and_prompt_length_follow_the_config_being_edited(workspace):
    from backend.services import presets

    quick_try = presets.preset_yaml_text(presets.DEFAULT_PRESET)
    at = AppTest.from_file(str(PAGE), default_timeout=120)
    at.session_state[presets.SESSION_KEY] = quick_try.replace("max_prompt_length: 128", "max_prompt_length: 40")
    at.run()
    assert not at.exception
    assert at.text_input(key="data_model_name").value == "tiny-qwen3"
    assert at.number_input(key="data_max_prompt_length").value == 40
    # sample prompts are up to 72 tiny-qwen3 tokens long: most are over 40, and the engine check says so
    assert any(re.search(r"[1-9][\d,]* over data.max_prompt_length=40", c) for c in _texts(at.caption))
    assert any("data.max_prompt_length=40" in e for e in _texts(at.error))

    at.number_input(key="data_max_prompt_length").set_value(100).run()  # an edit here holds ...
    assert any("0 over data.max_prompt_length=100" in c for c in _texts(at.caption))
    at.session_state[presets.SESSION_KEY] = quick_try.replace("tiny-qwen3", "tiny-llama")
    at.run()  # ... until the config names another model or length
    assert at.text_input(key="data_model_name").value == "tiny-llama"
    assert at.number_input(key="data_max_prompt_length").value == 128


def test_a_sql_query_shows_its_result(workspace):
    at = _page()
    at.text_area(key="sql_input").input("SELECT count(*) AS n FROM data WHERE data_source = 'arithmetic'")
    at.button(key="sql_run").click().run()
    assert not at.exception and not at.error
    [result] = [df.value for df in at.dataframe if list(df.value.columns) == ["n"]]
    assert result["n"].tolist() == [2000]


def test_a_forbidden_query_shows_an_error_and_the_page_still_renders(workspace):
    (workspace / "secret.parquet").write_bytes(SAMPLE.read_bytes())
    at = _page()
    for sql, message in (("SELECT * FROM 'secret.parquet'", "looks like a file"),
                         ("SELECT * FROM read_csv_auto('/etc/passwd')", "reads files"),
                         ("DROP VIEW data", "only read-only SELECT")):
        at.text_area(key="sql_input").input(sql)
        at.button(key="sql_run").click().run()
        assert any(message in e for e in _texts(at.error)), _texts(at.error)
        _assert_whole_page(at)


@pytest.mark.parametrize(("path", "message"), [
    ("nowhere/missing.parquet", "does not exist"),
    ("../outside.parquet", "contains '..'"),
    ("/etc/passwd", "outside the allowed folders"),
    ("sample_data", "is not a .parquet file"),
])
def test_a_bad_path_shows_a_message(workspace, path, message):
    at = _page()
    at.text_input(key="data_path_input").input(path).run()
    assert not at.exception
    assert any(message in e for e in _texts(at.error)), _texts(at.error)


def test_a_file_that_is_not_parquet_shows_a_message(workspace):
    (workspace / "notes.parquet").write_text("not parquet at all")
    at = _page()
    at.text_input(key="data_path_input").input("notes.parquet").run()
    assert not at.exception
    assert any("is not a readable parquet file" in e for e in _texts(at.error))


def test_the_reward_playground_scores_a_right_answer_as_one(workspace):
    at = _page()
    at.selectbox(key="reward_source").select("arithmetic")
    at.text_area(key="reward_response").input("#### 7")
    at.text_input(key="reward_ground_truth").input("7")
    at.button(key="reward_score_button").click().run()
    assert not at.exception and not at.error
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Score"] == "1.0"
    assert metrics["Strict (#### n)"] == "7" and metrics["Flexible (last number)"] == "7"


def test_reference_answers_fill_the_playground_and_all_get_full_marks(workspace):
    at = _page()
    first = at.selectbox(key="reward_reference_pick").options[1]
    at.selectbox(key="reward_reference_pick").select(first).run()
    assert at.text_area(key="reward_response").value.startswith("#### ")
    at.button(key="score_references_button").click().run()
    assert not at.exception
    assert "All 50 reference answers get full marks." in _texts(at.success)


def test_an_upload_is_saved_into_the_uploads_folder_and_shown(workspace):
    at = _page()
    at.file_uploader(key="data_upload").set_value(("my data.parquet", SAMPLE.read_bytes(), "application/octet-stream"))
    at.run()
    assert not at.exception and not at.error, _texts(at.error)
    assert (workspace / "uploads" / "my_data.parquet").is_file()
    assert any("uploads/my_data.parquet" in c for c in _texts(at.caption))

    at.file_uploader(key="data_upload").set_value(("junk.parquet", b"not parquet", "application/octet-stream"))
    at.run()
    assert any("junk.parquet is not a readable parquet file" in e for e in _texts(at.error))
    assert not (workspace / "uploads" / "junk.parquet").exists()



def test_an_upload_named_like_an_existing_file_is_refused_and_the_old_file_kept(workspace):
    uploads = workspace / "uploads"
    uploads.mkdir(exist_ok=True)
    old = uploads / "kept_data.parquet"
    old_bytes = (REPO / "sample_data" / "arithmetic_val.parquet").read_bytes()
    old.write_bytes(old_bytes)
    assert old_bytes != SAMPLE.read_bytes()  # so a replaced file would show
    at = _page()
    at.file_uploader(key="data_upload").set_value(("kept data.parquet", SAMPLE.read_bytes(),
                                                   "application/octet-stream"))
    at.run()
    assert not at.exception
    errors = _texts(at.error)
    assert any(f"{old} already exists" in e and "Rename the file, or delete the old one first" in e
               for e in errors), errors
    assert old.read_bytes() == old_bytes
    assert sorted(p.name for p in uploads.iterdir() if "kept" in p.name) == ["kept_data.parquet"]  # no .part left


def _big_parquet(min_bytes: int) -> bytes:
    """A real parquet file of at least `min_bytes`: refused for its size, not its content."""
    import io
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"blob": [os.urandom(min_bytes)]}), buf, compression="none")
    return buf.getvalue()


def test_an_upload_over_the_size_cap_is_refused_and_nothing_written(workspace):
    # AppTest runs a script fresh, so the cap is lowered by an entry script that loads the page as a module
    # (not as __main__, so it does not draw itself), sets the constant and then draws it
    entry = workspace / "entry_small_cap.py"
    entry.write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('data_page_small_cap', {str(PAGE)!r})\n"
        "page = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(page)\n"
        "page.UPLOAD_LIMIT_MB = 1\n"
        "page.main()\n")
    big = _big_parquet(1024 * 1024 + 100_000)
    at = AppTest.from_file(str(entry), default_timeout=120)
    at.session_state["data_model_name"] = "tiny-qwen3"
    at.run()
    assert not at.exception
    at.file_uploader(key="data_upload").set_value(("too big.parquet", big, "application/octet-stream"))
    at.run()
    assert not at.exception
    errors = _texts(at.error)
    assert any(f"too big.parquet is {len(big) / 2**20:.1f} MB ({len(big):,} bytes)" in e
               and "uploads are limited to 1 MB (1,048,576 bytes)" in e for e in errors), errors
    uploads = workspace / "uploads"
    assert not uploads.exists() or not [p.name for p in uploads.iterdir() if "too_big" in p.name]
    assert not any(c.startswith("Showing") for c in _texts(at.caption))

def test_a_tokenizer_that_cannot_load_skips_the_histogram_only(workspace):
    at = _page()
    at.text_input(key="data_model_name").input("./no-such-model").run()
    assert not at.exception
    assert any("Token lengths skipped" in w for w in _texts(at.warning))
    _assert_whole_page(at)


def test_run_as_a_page_of_the_app_it_leaves_the_page_config_to_the_entry_point(workspace, monkeypatch):
    calls = []
    monkeypatch.setattr(st, "set_page_config", lambda *a, **k: calls.append(k))
    entry = workspace / "entry.py"
    entry.write_text(
        "import streamlit as st\n"
        f"st.navigation([st.Page({str(PAGE)!r}, title='Data')]).run()\n")
    at = AppTest.from_file(str(entry), default_timeout=120)
    at.session_state["data_model_name"] = "tiny-qwen3"
    at.run()
    assert not at.exception
    assert "Data" in _texts(at.title)
    assert calls == []

    standalone = _page()  # run directly, the page is its own entry point and sets the config
    assert not standalone.exception
    assert calls and calls[-1]["layout"] == "wide"


def test_a_file_in_another_shape_renders_and_lists_what_the_engine_would_reject(workspace):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # the offline seeds' shape: no data_source, no ground truth, a plain string prompt
    pq.write_table(pa.table({"prompt": ["What is 2 + 2?", "Name a colour."], "response": ["4", "red"],
                             "reward": [1.0, 0.0]}), workspace / "offline.parquet")
    at = _page()
    at.text_input(key="data_path_input").input("offline.parquet").run()
    _assert_whole_page(at)
    assert {m.label: m.value for m in at.metric}["Rows"] == "2"
    errors = _texts(at.error)
    assert any("missing column 'reward_model'" in e for e in errors), errors


def _two_gigabyte_parquet(path: Path) -> int:
    """Over 2 GB: 17 row groups of 122,880 rows, each prompt 1,000 random hex characters (so nothing
    compresses), built from raw buffers rather than Python strings. Returns the file's size."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, width = 122_880, 1_000
    alphabet = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    schema = pa.schema([("data_source", pa.string()), ("prompt", pa.string()), ("ground_truth", pa.string())])
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        for group in range(17):
            chars = alphabet[np.random.default_rng(group).integers(0, 16, rows * width, dtype=np.uint8)]
            offsets = np.arange(0, rows * width + 1, width, dtype=np.int32)
            prompts = pa.StringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(chars.tobytes()))
            writer.write_table(pa.table({"data_source": pa.array(["arithmetic"] * rows), "prompt": prompts,
                                         "ground_truth": pa.array([str(group)] * rows)}, schema=schema),
                               row_group_size=rows)
    return path.stat().st_size


def _bytes_read() -> int:
    return int(next(line.split()[1] for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")))


@pytest.mark.slow
def test_a_two_gigabyte_file_previews_reading_a_small_part_of_it(workspace):
    import time

    path = workspace / "two_gigabytes.parquet"
    size = _two_gigabyte_parquet(path)
    assert size > 2e9
    at = _page()  # the page and its imports first, on the sample file, so only the preview's reads are counted
    before, start = _bytes_read(), time.perf_counter()
    at.text_input(key="data_path_input").input(path.name).run()
    seconds, read = time.perf_counter() - start, _bytes_read() - before
    assert not at.exception and not at.error, _texts(at.error)
    assert any(m.label == "Rows" and m.value == "2,088,960" for m in at.metric)
    # The page shows the head, the sources, ground-truth counts and a 2,000-prompt length sample: DuckDB
    # and pyarrow read those columns and a couple of row groups of prompts, not the whole file.
    assert read < 0.25 * size, f"read {read / 1e9:.2f} GB of a {size / 1e9:.2f} GB file"
    print(f"\n2 GB preview: first render {seconds:.1f} s, {read / 1e6:.0f} MB read of {size / 1e6:.0f} MB")
    path.unlink()


def _with_calculator(at: AppTest, extra: str = "") -> AppTest:
    from backend.services import presets

    quick_try = presets.preset_yaml_text(presets.DEFAULT_PRESET)
    at.session_state[presets.SESSION_KEY] = quick_try.replace(
        "    temperature: 1.0\n", "    temperature: 1.0\n    multi_turn:\n      enable: true\n"
        f"      tools: [calculator]\n{extra}")
    return at


def test_the_environment_playground_runs_a_typed_tool_call_and_shows_its_answer(workspace):
    at = _with_calculator(AppTest.from_file(str(PAGE), default_timeout=120))
    at.session_state["data_model_name"] = "tiny-qwen3"
    at.run()
    assert "Environment playground" in _texts(at.subheader)
    assert any("Tom" in m.value or "How many" in m.value for m in at.markdown)  # the row's first message
    at.text_area(key="env_assistant_text").input(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 86"}}</tool_call>')
    at.button(key="env_send").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "29842" in _texts(at.code)
    assert any('"expression"' in str(j.value) or "347 * 86" in str(j.value) for j in at.json)
    # A turn without a call ends the episode; the last message would be scored by the run's reward.
    at.text_area(key="env_assistant_text").input("The product is 29842. #### 29842")
    at.button(key="env_send").click().run()
    assert any("Episode over after 2 assistant turn(s)" in s for s in _texts(at.success))
    at.button(key="env_restart").click().run()
    at.text_area(key="env_assistant_text").input('<tool_call>{"name": "calculator", "arguments": {"x": 1}}')
    at.button(key="env_send").click().run()
    assert any("missing argument 'expression'" in e for e in _texts(at.error))


def test_an_environment_that_cannot_load_is_named_and_the_page_still_renders(workspace):
    at = _with_calculator(AppTest.from_file(str(PAGE), default_timeout=120), "      environment: nowhere.py:Env\n")
    at.session_state["data_model_name"] = "tiny-qwen3"
    at.run()
    assert not at.exception
    assert any("file not found: 'nowhere.py'" in e for e in _texts(at.error))
    _assert_whole_page(at)


def test_a_page_that_waits_for_the_import_warm_up_finds_its_modules_imported():
    """A fresh interpreter starts the server's import warm-up and at once waits for it, as the Data page does
    before loading a tokenizer: every warmed module is then whole (importing transformers from a second
    thread while the warm-up is inside it could hand that thread a half-made module)."""
    code = ("import sys; sys.path.insert(0, 'app'); import page_support as ps; ps.warm_up_imports(); "
            "ps.imports_warmed_up(); missing = [m for m in ps._SLOW_IMPORTS if m not in sys.modules]; "
            "from transformers import AutoTokenizer; print(missing)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
