"""backend.services.preview: what the data page shows about a parquet file, and the SQL it refuses."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from backend.core import data
from backend.rewards import registry
from backend.rewards.registry import _REGISTRY, register_reward
from backend.services import preview
from backend.services.preview import PreviewError

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data" / "arithmetic_train.parquet"


def _rows() -> list[dict]:
    return [
        {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "What is 3 + 4?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "7"}, "extra_info": {"index": 0}},
        {"data_source": "arithmetic", "prompt": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "What is 9 - 2?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "7"}, "extra_info": {"index": 1}},
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "Tom has 2 apples..."}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
         "extra_info": {"index": 2, "answer": "He has 2 + 3 = 5 apples.\n#### 5"}},
    ]


@pytest.fixture()
def small(tmp_path) -> Path:
    path = tmp_path / "small.parquet"
    data.write_rows(_rows(), path)
    pq.write_table(pa.table({"secret": ["do not read me"]}), tmp_path / "secret.parquet")
    return path


@pytest.fixture()
def pv(small):
    with preview.open_parquet(small) as opened:
        yield opened


# ---- what the file holds ----


def test_schema_row_count_and_head_describe_a_verl_file(pv):
    names = [name for name, _ in pv.schema()]
    assert names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert pv.row_count() == 3
    head = pv.head(2)
    assert len(head) == 2
    assert head[1]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert head[0]["reward_model"]["ground_truth"] == "7"


def test_data_source_counts_are_sorted_by_rows(pv):
    assert pv.data_source_counts() == [("arithmetic", 2), ("openai/gsm8k", 1)]


def test_ground_truth_presence_counts_empty_and_missing_values(tmp_path):
    path = tmp_path / "gt.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c", "d"], "ground_truth": ["1", "", None, " 4 "]}), path)
    with preview.open_parquet(path) as pv:
        presence = pv.ground_truth_presence()
        assert pv.data_source_counts() == []  # no data_source column
    assert presence == {"rows": 4, "with_ground_truth": 2, "without_ground_truth": 2,
                        "by_column": {"ground_truth": 2}}


def test_the_sample_set_previews_whole(tmp_path):
    with preview.open_parquet(SAMPLE) as pv:
        assert pv.row_count() == 2000
        assert pv.data_source_counts() == [("arithmetic", 2000)]
        assert pv.ground_truth_presence()["with_ground_truth"] == 2000
        assert len(pv.head()) == 20
        sample = pv.prompt_texts(limit=100)
        assert len(sample) == 100 and sample == pv.prompt_texts(limit=100)  # fixed seed: same sample
        assert len(pv.prompt_texts()) == 2000  # no more rows than the limit: all of them


def test_a_file_that_is_not_parquet_gets_a_message_naming_it(tmp_path):
    bad = tmp_path / "notes.parquet"
    bad.write_text("hello, not parquet")
    with pytest.raises(PreviewError, match=r"notes\.parquet is not a readable parquet file"):
        preview.open_parquet(bad)
    with pytest.raises(PreviewError, match="file not found"):
        preview.open_parquet(tmp_path / "missing.parquet")
    with pytest.raises(PreviewError, match="is a directory"):
        preview.open_parquet(tmp_path)


# ---- read-only SQL ----


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("INSERT INTO data VALUES (1)", "INSERT statement"),
        ("UPDATE data SET ability = 'x'", "UPDATE statement"),
        ("DELETE FROM data", "DELETE statement"),
        ("CREATE TABLE t AS SELECT * FROM data", "CREATE statement"),
        ("COPY data TO 'out.csv'", "COPY statement"),
        ("ATTACH 'other.db'", "ATTACH statement"),
        ("PRAGMA version", "PRAGMA statement"),
        ("SET threads = 1", "SET statement"),
        ("INSTALL httpfs", "LOAD statement"),
        ("LOAD httpfs", "LOAD statement"),
        ("EXPORT DATABASE 'dump'", "EXPORT statement"),
        ("SELECT 1; SELECT 2", "only one statement"),
        ("SELECT * FROM data; DROP VIEW data", "only one statement"),
        ("DESCRIBE data", "not DESCRIBE"),
        ("SELECT * FROM 'secret.parquet'", "looks like a file"),
        ("SELECT * FROM data, 'secret.parquet'", "looks like a file"),
        ("SELECT * FROM read_parquet('secret.parquet')", r"read_parquet\(\) reads files"),
        ("SELECT * FROM read_csv_auto('/etc/passwd')", r"read_csv_auto\(\) reads files"),
        ("SELECT * FROM read_json('x.json')", r"read_json\(\) reads files"),
        ("SELECT * FROM read_text('/etc/passwd')", r"read_text\(\) reads files"),
        ("SELECT * FROM read_blob('/etc/passwd')", r"read_blob\(\) reads files"),
        ("SELECT * FROM glob('*')", r"glob\(\) reads files"),
        ("SELECT (SELECT count(*) FROM read_csv('/etc/passwd')) FROM data", r"read_csv\(\) reads files"),
        ("WITH x AS (SELECT * FROM parquet_scan('secret.parquet')) SELECT * FROM x", "reads files"),
        ("SELECT * FROM duckdb_settings()", "not allowed"),
        ("SELECT * FROM information_schema.tables", "not allowed"),
        ("   ", "empty"),
        ("-- just a comment", "empty"),
    ],
)
def test_sql_other_than_one_select_over_data_is_refused(pv, sql, message):
    with pytest.raises(PreviewError, match=message):
        pv.query(sql)


def test_another_file_cannot_be_read_even_past_the_sql_check(pv, small):
    # Belt and braces: the connection itself is sealed, so a query the check missed still cannot reach
    # another file, and the seal cannot be lifted.
    con = pv._con
    secret = small.parent / "secret.parquet"
    for sql in (f"SELECT * FROM '{secret}'", "SELECT * FROM read_csv_auto('/etc/passwd')",
                f"COPY (SELECT 1) TO '{small.parent / 'out.csv'}'"):
        with pytest.raises(duckdb.PermissionException):
            con.execute(sql)
    with pytest.raises(duckdb.Error):
        con.execute("SET enable_external_access = true")
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute(f"SET allowed_paths = ['{secret}']")
    assert not (small.parent / "out.csv").exists()
    assert pv.query("SELECT count(*) AS n FROM data") == (["n"], [(3,)])  # the view still reads its file


def test_legal_queries_answer_with_columns_and_rows(pv):
    assert pv.query("SELECT data_source, count(*) AS n FROM data GROUP BY 1 ORDER BY 1") == (
        ["data_source", "n"], [("arithmetic", 2), ("openai/gsm8k", 1)])
    columns, rows = pv.query(
        "WITH m AS (SELECT unnest(prompt) AS msg FROM data) SELECT msg.role, count(*) FROM m GROUP BY 1 ORDER BY 1")
    assert rows == [("system", 1), ("user", 3)]
    assert pv.query("select 'a;b' as s; -- trailing comment")[1] == [("a;b",)]
    assert pv.query("FROM data SELECT reward_model.ground_truth AS gt LIMIT 1") == (["gt"], [("7",)])
    assert len(pv.query("SELECT * FROM range(5000)", limit=10)[1]) == 10


def test_a_query_error_is_duckdbs_message_without_a_traceback(pv):
    with pytest.raises(PreviewError, match="no_such_column") as info:
        pv.query("SELECT no_such_column FROM data")
    assert "Traceback" not in str(info.value)


def test_a_query_past_its_timeout_is_stopped(pv):
    with pytest.raises(PreviewError, match="ran longer than"):
        pv.query("SELECT sum(a.range * b.range) FROM range(200000) a, range(200000) b", timeout_s=0.3)


# ---- rendering and lengths ----


def test_render_prompt_shows_each_role_and_leaves_strings_alone():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert preview.render_prompt(messages) == "system: Be brief.\n\nuser: 2+2?"
    assert preview.render_prompt("plain prompt") == "plain prompt"
    assert preview.render_prompt(None) == ""


def test_display_columns_turns_nested_values_into_text_and_keeps_repeated_names():
    table = preview.display_columns(["a", "b", "a"], [(1, {"x": [1, 2]}, None)])
    assert table == {"a": [1], "b": ['{"x": [1, 2]}'], "a (2)": [None]}


def test_token_lengths_match_the_engines_prompt_dataset(tiny_tokenizer):
    rows = _rows()
    expected = data.PromptDataset(rows, tiny_tokenizer, 10_000).prompt_lengths()
    hist = preview.token_length_histogram([r["prompt"] for r in rows] + [""], tiny_tokenizer, expected[0])
    assert hist["lengths"] == expected
    assert hist["n"] == 3 and hist["n_invalid"] == 1  # the empty prompt the engine would reject
    assert hist["max"] == max(expected)
    assert hist["n_over"] == sum(length > expected[0] for length in expected)
    assert hist["mean"] == pytest.approx(sum(expected) / 3)


# ---- reward playground ----


@pytest.mark.parametrize(
    ("source", "response", "truth", "score", "strict", "flexible", "boxed"),
    [
        ("arithmetic", "#### 7", "7", 1.0, "7", "7", None),
        ("arithmetic", "3 + 4 = 7", "7", 0.5, None, "7", None),
        ("arithmetic", "#### 8", "7", 0.1, "8", "8", None),
        ("arithmetic", "", "7", 0.0, None, None, None),
        # GSM8K rows score by verl's rule: "#### $" and "#### -$" do not match it; a later "####" with no number
        # does not hide an earlier one.
        ("openai/gsm8k", "So $1,234 in all.\n#### $1,234.", "1234", 0.0, "1,234", "1,234", None),
        ("openai/gsm8k", "#### -$5", "-5", 0.0, "-5", "-5", None),
        ("openai/gsm8k", "#### 5 #### ", "5", 1.0, None, "5", None),
        ("math", r"so \boxed{\frac{1}{2}}", "0.5", 1.0, None, "2", r"\frac{1}{2}"),
    ],
)
def test_score_response_scores_and_shows_what_each_extractor_reads(source, response, truth, score, strict,
                                                                  flexible, boxed):
    result = preview.score_response(source, response, truth)
    assert result["error"] is None
    assert result["score"] == pytest.approx(score)
    assert (result["strict"], result["flexible"], result["boxed"]) == (strict, flexible, boxed)


def test_score_response_reports_problems_instead_of_raising():
    unknown = preview.score_response("no-such-source", "#### 7", "7")
    assert unknown["score"] is None and "no reward function is registered" in unknown["error"]
    bad_truth = preview.score_response("arithmetic", "#### 7", "seven")
    assert bad_truth["score"] == 0.0 and "not a number" in bad_truth["error"]
    outside = preview.score_response("arithmetic", "#### 7", "7", custom_path="/etc/reward.py", custom_name="f")
    assert outside["score"] is None and "outside the allowed folders" in outside["error"]


def test_score_response_uses_a_custom_reward_file_in_the_workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_WB_HOME", str(tmp_path))
    (tmp_path / "my_reward.py").write_text(
        "def length_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': len(solution_str) / 10, 'chars': len(solution_str)}\n")
    result = preview.score_response("anything", "12345", "x", custom_path="my_reward.py", custom_name="length_score")
    assert result["error"] is None and result["score"] == 0.5 and result["parts"] == {"chars": 5.0}


def test_reference_answers_get_full_marks_from_the_built_in_scorers(pv):
    report = preview.score_reference_answers(pv.head(50))
    assert report == {"n": 3, "full_marks": 3, "skipped": 0, "error": None, "failures": []}


def test_reference_answers_flag_a_scorer_that_gives_zero_to_correct_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(_REGISTRY))  # the registration ends with the test

    @register_reward("test/broken-scorer")
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    rows = _rows()
    rows[1]["data_source"] = "test/broken-scorer"
    path = tmp_path / "broken.parquet"
    data.write_rows(rows, path)
    with preview.open_parquet(path) as pv:
        report = preview.score_reference_answers(pv.head())
    assert report["n"] == 3 and report["full_marks"] == 2
    [failure] = report["failures"]
    assert failure["row"] == 1 and failure["data_source"] == "test/broken-scorer"
    assert failure["response"] == "#### 7" and failure["score"] == 0.0


def test_reference_answer_uses_gsm8k_solutions_and_boxes_for_math():
    gsm8k = _rows()[2]
    assert preview.reference_answer(gsm8k) == ("He has 2 + 3 = 5 apples.\n#### 5", "5")
    assert preview.reference_answer({"data_source": "math", "ground_truth": "\\frac{1}{2}"}) == \
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}")
    assert preview.reference_answer({"data_source": "arithmetic", "answer": 12.0}) == ("#### 12", "12")
    assert preview.reference_answer({"data_source": "arithmetic", "prompt": "x"}) is None


# ---- what the engine would reject ----


def test_file_problems_is_empty_for_a_file_the_engine_loads(small, tiny_tokenizer):
    assert preview.file_problems(small) == []
    assert preview.file_problems(small, max_prompt_length=512, tokenizer=tiny_tokenizer) == []


def test_file_problems_are_the_engines_own_messages(tmp_path, small, tiny_tokenizer):
    no_prompt = tmp_path / "no_prompt.parquet"
    pq.write_table(pa.table({"question": ["q"], "answer": ["#### 1"]}), no_prompt)
    [message] = preview.file_problems(no_prompt)
    assert "missing column 'prompt'" in message and str(no_prompt) in message

    rows = _rows()
    rows[0]["data_source"] = "my/own-set"
    unknown = tmp_path / "unknown.parquet"
    data.write_rows(rows, unknown)
    [message] = preview.file_problems(unknown)
    assert "no reward function is registered for data_source 'my/own-set'" in message

    [message] = preview.file_problems(small, max_prompt_length=5, tokenizer=tiny_tokenizer)
    assert "over data.max_prompt_length=5" in message and "row 0" in message
