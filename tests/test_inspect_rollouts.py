"""backend.services.rollouts on hand-made rollout and token files: grouping stats worked out by hand,
each filter (the episode ones of multi-turn runs too), one prompt across steps, an episode's turns, the
token log lookup, and the token HTML (escaped, coloured by sign, clipped tokens outlined, tokens the
policy did not sample greyed)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from backend.services import rollouts as ir

PROMPT_A = "What is 2 + 3?"
PROMPT_B = "Tom has 4 apples and eats 1. How many are left?"


def response(step: int, group: int, index: int, prompt: str, text: str, reward: float, *,
             source: str = "arithmetic", finish: str = "stop", truth: str = "5", pred: str | None = None,
             advantage: float = 0.0) -> dict:
    return {"step": step, "group": group, "data_source": source, "index": index, "prompt": prompt,
            "response": text, "ground_truth": truth, "pred": pred, "reward": reward, "advantage": advantage,
            "response_length": len(text.split()), "finish_reason": finish,
            "reward_correct": float(reward >= 1.0), "reward_format": 0.5}


def assistant(text: str, *calls: dict) -> dict:
    return {"role": "assistant", "text": text, "tokens": len(text.split()) + 1, "tool_calls": list(calls)}


def tool_call(arguments: dict | None, output: str, failure: str | None = None, name: str = "calculator") -> dict:
    return {"name": name, "arguments": arguments, "output": output, "failure": failure, "seconds": 0.25}


def observation(text: str, name: str = "calculator") -> dict:
    return {"role": "tool", "text": text, "name": name}


def episode(step: int, group: int, index: int, prompt: str, turns: list[dict], reward: float, *,
            error: str | None = None, **kwargs) -> dict:
    """A multi-turn row as the trainer writes it: `response` is the last assistant message, the turns are
    JSON, and the counts are those of the turns (an environment error is not a turn)."""
    calls = [c for t in turns for c in t.get("tool_calls", [])]
    last = [t["text"] for t in turns if t["role"] == "assistant"][-1]
    return {**response(step, group, index, prompt, last, reward, **kwargs), "reward_environment": reward,
            "turns": json.dumps(turns), "num_turns": sum(t["role"] != "error" for t in turns),
            "tool_calls": len(calls), "tool_failures": sum(c["failure"] is not None for c in calls),
            "episode_error": error}


def write_step(run_dir: Path, step: int, rows: list[dict]) -> Path:
    """A rollouts/step_NNNNNN.parquet as the trainer writes it (columns from the rows' keys; a column some
    rows lack is null in them)."""
    path = ir.step_file(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in columns}), path)
    return path


def write_tokens(run_dir: Path, step: int, records: list[dict]) -> Path:
    """A rollouts/tokens_step_NNNNNN.parquet in the token log's schema, types inferred as the trainer's
    writer does (a list of nulls, without a reference model, becomes list<null>)."""
    path = ir.tokens_file(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({k: [r[k] for r in records] for k in records[0]}), path)
    return path


def token_record(row: int, tokens: list[str], advantage: float, *, with_ref: bool = True,
                 sampled: list[bool] | None = None) -> dict:
    """A token log row; without `sampled` it has no such column, as token logs before multi-turn runs."""
    n = len(tokens)
    log_prob = [-0.1 * (i + 1) for i in range(n)]
    ref = [-0.2 * (i + 1) for i in range(n)] if with_ref else [None] * n
    record = {"row": row, "token_ids": list(range(100, 100 + n)), "tokens": tokens, "log_prob": log_prob,
              "ref_log_prob": ref,
              "kl": [a - b for a, b in zip(log_prob, ref, strict=True)] if with_ref else [None] * n,
              "entropy": [0.5 * i for i in range(n)], "advantage": [advantage] * n,
              "clipped": [i == 0 for i in range(n)]}
    if sampled is not None:
        record["sampled"] = sampled
    return record


def step_one() -> list[dict]:
    """Group 0 (index 10): rewards 1, 0, 0.5, 0.5. Group 1 (index 11, another source): all 0, one truncated."""
    return [
        response(1, 0, 10, PROMPT_A, "2 + 3 = 5. #### 5", 1.0, pred="5", advantage=1.41),
        response(1, 0, 10, PROMPT_A, "I think it is 6 #### 6", 0.0, pred="6", advantage=-1.41),
        response(1, 0, 10, PROMPT_A, "The answer is 5", 0.5, advantage=0.0),
        response(1, 0, 10, PROMPT_A, "five, so 5", 0.5, advantage=0.0),
        response(1, 1, 11, PROMPT_B, "4 - 1 = 3 so", 0.0, source="word", truth="3"),
        response(1, 1, 11, PROMPT_B, "Let me count the apples one by one", 0.0, source="word", truth="3",
                 finish="length"),
    ]


PROMPT_C = "What is 7 * 6?"
DIVIDE_ERROR = "ZeroDivisionError: division by zero"
SANDBOX_DIED = "step raised RuntimeError: the sandbox died"


def episode_step() -> list[dict]:
    """Step 1 of a multi-turn run. Group 0 (index 10): row 0 calls the calculator, which raises, then
    answers; row 1 calls it twice and the turn limit ends it. Group 1 (index 11, source word): row 2
    answers without a call; row 3 makes one good call, then answers. Group 2 (index 12): row 4 makes a
    good call, then the environment raises on its next message."""
    failed = [assistant("Let me divide.", tool_call({"expression": "5 / 0"}, DIVIDE_ERROR, "errors")),
              observation(DIVIDE_ERROR), assistant("It is 5. #### 5")]
    long = [assistant("Check 2 + 3.", tool_call({"expression": "2 + 3"}, "5")), observation("5"),
            assistant("Check again.", tool_call({"expression": "3 + 2"}, "5")), observation("5")]
    clean = [assistant("Count.", tool_call({"expression": "4 - 1"}, "3")), observation("3"), assistant("So #### 3")]
    broken = [assistant("Multiply.", tool_call({"expression": "7 * 6"}, "42")), observation("42"),
              assistant("Now what?"), {"role": "error", "text": SANDBOX_DIED}]
    return [
        episode(1, 0, 10, PROMPT_A, failed, 1.0, pred="5"),
        episode(1, 0, 10, PROMPT_A, long, 0.0, finish="max_turns"),
        episode(1, 1, 11, PROMPT_B, [assistant("#### 3")], 1.0, source="word", truth="3", pred="3"),
        episode(1, 1, 11, PROMPT_B, clean, 1.0, source="word", truth="3", pred="3"),
        episode(1, 2, 12, PROMPT_C, broken, 0.0, finish="env_error", error=SANDBOX_DIED, truth="42"),
    ]


def mixed_step() -> list[dict]:
    """episode_step, then group 3 (index 13): two single-turn rows (the second truncated), whose episode
    columns are null."""
    return episode_step() + [response(1, 3, 13, "Say hi.", "hi", 1.0),
                             response(1, 3, 13, "Say hi.", "hello hello hello", 0.0, finish="length")]


@pytest.fixture
def run_dir(tmp_path) -> Path:
    run = tmp_path / "runs" / "r"
    write_step(run, 1, step_one())
    write_step(run, 2, [response(2, 0, 12, "Other prompt", "x", 0.0),
                        response(2, 1, 10, PROMPT_A, "5", 1.0), response(2, 1, 10, PROMPT_A, "4", 0.0)])
    write_step(run, 3, [response(3, 0, 10, PROMPT_A, "#### 5", 1.0), response(3, 0, 10, PROMPT_A, "#### 5", 1.0)])
    return run


# ---- files ----


def test_rollout_steps_lists_step_files_only_and_a_missing_run_has_none(run_dir, tmp_path):
    write_tokens(run_dir, 1, [token_record(0, ["a"], 1.0)])
    (run_dir / "rollouts" / ".step_000004.parquet.tmp").write_bytes(b"half")
    assert ir.rollout_steps(run_dir) == [1, 2, 3]
    assert ir.rollout_steps(tmp_path / "gone") == []


def test_load_step_reads_rows_in_file_order_with_their_row_number(run_dir):
    rows = ir.load_step(run_dir, 1)
    assert [r["row"] for r in rows] == list(range(6))
    assert rows[1]["response"] == "I think it is 6 #### 6" and rows[5]["finish_reason"] == "length"
    assert ir.reward_parts(rows) == ["correct", "format"]


def test_a_missing_or_torn_step_file_is_an_inspect_error_that_names_it(run_dir):
    with pytest.raises(ir.InspectError, match="missing.*step_000009.parquet"):
        ir.load_step(run_dir, 9)
    ir.step_file(run_dir, 4).write_bytes(b"PAR1 then nothing")
    with pytest.raises(ir.InspectError, match="torn or not a parquet file"):
        ir.load_step(run_dir, 4)


def test_a_step_file_without_the_rollout_columns_is_refused(run_dir):
    pq.write_table(pa.table({"prompt": ["p"]}), ir.step_file(run_dir, 5))
    with pytest.raises(ir.InspectError, match="group, response, reward"):
        ir.load_step(run_dir, 5)


# ---- groups ----


def test_group_stats_are_mean_population_std_min_max_of_the_rewards(run_dir):
    first, second = ir.group_rows(ir.load_step(run_dir, 1))
    # rewards 1, 0, 0.5, 0.5: mean 0.5; deviations 0.5, -0.5, 0, 0 -> variance (0.25 + 0.25) / 4 = 0.125
    assert (first["group"], first["index"], first["prompt"], first["n"]) == (0, 10, PROMPT_A, 4)
    assert first["mean"] == pytest.approx(0.5) and first["std"] == pytest.approx(math.sqrt(0.125))
    assert (first["min"], first["max"], first["zero_spread"]) == (0.0, 1.0, False)
    assert [r["reward"] for r in first["responses"]] == [1.0, 0.5, 0.5, 0.0]
    assert (second["mean"], second["std"], second["zero_spread"], second["data_source"]) == (0.0, 0.0, True, "word")


def test_responses_without_a_finite_reward_sort_last_and_do_not_count_in_the_stats():
    rows = [response(1, 0, 1, "p", "a", float("nan")), response(1, 0, 1, "p", "b", 0.25),
            response(1, 0, 1, "p", "c", 0.75)]
    (group,) = ir.group_rows(rows)
    assert [r["response"] for r in group["responses"]] == ["c", "b", "a"]
    assert group["mean"] == pytest.approx(0.5) and group["std"] == pytest.approx(0.25)


# ---- filters ----


def _texts(rows: list[dict]) -> list[str]:
    return [r["response"] for r in rows]


def test_reward_bounds_are_inclusive(run_dir):
    rows = ir.load_step(run_dir, 1)
    assert _texts(ir.filter_rows(rows, reward_min=0.5)) == ["2 + 3 = 5. #### 5", "The answer is 5", "five, so 5"]
    assert _texts(ir.filter_rows(rows, reward_min=0.5, reward_max=0.5)) == ["The answer is 5", "five, so 5"]
    assert len(ir.filter_rows(rows, reward_max=0.0)) == 3


def test_data_source_filter_keeps_the_named_sources_and_none_means_all(run_dir):
    rows = ir.load_step(run_dir, 1)
    assert {r["data_source"] for r in ir.filter_rows(rows, data_sources=["word"])} == {"word"}
    assert len(ir.filter_rows(rows, data_sources=None)) == 6
    assert ir.filter_rows(rows, data_sources=[]) == []


def test_truncated_only_keeps_responses_that_hit_the_length_limit(run_dir):
    rows = ir.load_step(run_dir, 1)
    assert _texts(ir.filter_rows(rows, truncated_only=True)) == ["Let me count the apples one by one"]


def test_zero_spread_only_keeps_whole_groups_whose_rewards_are_all_equal(run_dir):
    rows = ir.load_step(run_dir, 1)
    kept = ir.filter_rows(rows, zero_spread_only=True)
    assert {r["group"] for r in kept} == {1} and len(kept) == 2


def test_text_search_is_case_insensitive_over_prompt_and_response(run_dir):
    rows = ir.load_step(run_dir, 1)
    assert _texts(ir.filter_rows(rows, text="I THINK")) == ["I think it is 6 #### 6"]
    assert len(ir.filter_rows(rows, text="apples")) == 2  # in group 1's prompt
    assert len(ir.filter_rows(rows, text="  ")) == 6


def test_filters_combine_and_filtered_groups_keep_stats_over_all_responses(run_dir):
    rows = ir.load_step(run_dir, 1)
    assert ir.filter_rows(rows, truncated_only=True, data_sources=["arithmetic"]) == []
    (group,) = ir.filtered_groups(rows, reward_min=1.0)
    assert group["group"] == 0 and _texts(group["shown"]) == ["2 + 3 = 5. #### 5"]
    assert group["n"] == 4 and group["mean"] == pytest.approx(0.5)


def test_step_summary_counts_what_the_header_shows(run_dir):
    summary = ir.step_summary(ir.load_step(run_dir, 1))
    assert summary == {"responses": 6, "groups": 2, "mean_reward": pytest.approx(2.0 / 6),
                       "min_reward": 0.0, "max_reward": 1.0, "zero_spread_groups": 1, "truncated": 1,
                       "data_sources": ["arithmetic", "word"]}


# ---- episodes ----


@pytest.fixture
def mixed_rows(tmp_path) -> list[dict]:
    write_step(tmp_path, 1, mixed_step())
    return ir.load_step(tmp_path, 1)


def test_episode_turns_parses_the_turns_and_a_single_turn_row_has_none(mixed_rows):
    turns = ir.episode_turns(mixed_rows[0])
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant"]
    (call,) = turns[0]["tool_calls"]
    assert (call["name"], call["arguments"], call["output"], call["failure"]) == \
        ("calculator", {"expression": "5 / 0"}, DIVIDE_ERROR, "errors")
    assert turns[1] == {"role": "tool", "text": DIVIDE_ERROR, "name": "calculator"}
    assert ir.episode_turns(mixed_rows[4])[-1] == {"role": "error", "text": SANDBOX_DIED}
    assert ir.episode_turns(mixed_rows[5]) is None  # a single-turn row in the same file: null turns
    assert ir.episode_turns(step_one()[0]) is None  # a single-turn run: no turns column at all
    assert (ir.is_episode(mixed_rows[0]), ir.is_episode(mixed_rows[5])) == (True, False)
    assert ir.has_episodes(mixed_rows) and not ir.has_episodes(step_one())


def test_episode_turns_of_a_malformed_value_is_none_and_never_raises():
    for garbage in ("[{\"role\": \"assistant\"", "not json", "42", '{"role": "assistant"}', "[1, 2]", '["a"]', ""):
        assert ir.episode_turns({"turns": garbage}) is None, garbage
    assert ir.episode_turns({"turns": '[{"role": "user", "text": "hi"}]'}) == [{"role": "user", "text": "hi"}]


def test_finish_reasons_are_put_in_words():
    assert ir.finish_words("max_turns") == "turn limit reached"
    assert ir.finish_words("length").startswith("token budget ran out")
    assert ir.finish_words("env_error").startswith("environment failed")
    assert ir.finish_words("abort") == "abort" and ir.finish_words(None) == "unknown"


def test_tool_error_keeps_episodes_with_a_failed_call_or_an_environment_error(mixed_rows):
    assert [r["row"] for r in ir.filter_rows(mixed_rows, tool_error=True)] == [0, 4]


def test_max_turns_keeps_episodes_the_turn_limit_ended(mixed_rows):
    assert _texts(ir.filter_rows(mixed_rows, max_turns=True)) == ["Check again."]


def test_no_tool_call_keeps_episodes_that_never_called_a_tool(mixed_rows):
    assert _texts(ir.filter_rows(mixed_rows, no_tool_call=True)) == ["#### 3"]


def test_episode_filters_combine_with_the_others_and_never_match_a_single_turn_row(mixed_rows):
    assert [r["row"] for r in ir.filter_rows(mixed_rows, tool_error=True, reward_min=1.0)] == [0]
    assert [r["row"] for r in ir.filter_rows(mixed_rows, tool_error=True, text="now WHAT")] == [4]
    assert ir.filter_rows(mixed_rows, no_tool_call=True, data_sources=["arithmetic"]) == []
    assert ir.filter_rows(mixed_rows, max_turns=True, tool_error=True) == []
    # the truncated single-turn row passes truncated_only alone, and no episode filter with it
    assert [r["row"] for r in ir.filter_rows(mixed_rows, truncated_only=True)] == [6]
    assert ir.filter_rows(mixed_rows, truncated_only=True, no_tool_call=True) == []
    for flag in ("tool_error", "max_turns", "no_tool_call"):
        assert ir.filter_rows(step_one(), **{flag: True}) == [], flag
    assert len(ir.filter_rows(mixed_rows)) == 7
    assert [(g["group"], _texts(g["shown"])) for g in ir.filtered_groups(mixed_rows, tool_error=True)] == \
        [(0, ["It is 5. #### 5"]), (2, ["Now what?"])]


# ---- one prompt across steps ----


def test_prompt_history_finds_every_response_to_a_prompt_in_every_step(run_dir):
    history = ir.prompt_history(run_dir, 10)
    assert [(r["step"], r["reward"]) for r in history] == [(1, 1.0), (1, 0.5), (1, 0.5), (1, 0.0),
                                                           (2, 1.0), (2, 0.0), (3, 1.0), (3, 1.0)]
    assert {r["prompt"] for r in history} == {PROMPT_A}
    # `row` is the response's row in its own step's file: step 2's answers to index 10 are rows 1 and 2
    assert [r["row"] for r in history if r["step"] == 2] == [1, 2]
    assert [g["mean"] for g in ir.group_rows(history)] == [pytest.approx(0.5), 0.5, 1.0]
    assert ir.prompt_history(run_dir, 999) == []


def test_prompt_history_skips_a_torn_step_file_and_tolerates_different_reward_parts(run_dir):
    ir.step_file(run_dir, 4).write_bytes(b"PAR1 torn")
    rows = [{**response(5, 0, 10, PROMPT_A, "5", 1.0), "reward_extra": 0.1}]
    write_step(run_dir, 5, rows)
    assert [r["step"] for r in ir.prompt_history(run_dir, 10)] == [1, 1, 1, 1, 2, 2, 3, 3, 5]


def test_prompt_history_of_a_run_without_rollouts_is_empty(tmp_path):
    assert ir.prompt_history(tmp_path / "nothing", 10) == []


# ---- token log ----


def test_token_view_returns_the_record_of_a_logged_row_and_none_otherwise(run_dir):
    write_tokens(run_dir, 1, [token_record(0, ["2", " +", " 3"], 1.41), token_record(1, ["I"], -1.41)])
    assert ir.logged_rows(run_dir, 1) == [0, 1]
    record = ir.token_view(run_dir, 1, 1)
    assert record["row"] == 1 and record["tokens"] == ["I"] and record["advantage"] == [-1.41]
    assert ir.token_view(run_dir, 1, 0)["tokens"] == ["2", " +", " 3"]
    assert ir.token_view(run_dir, 1, 4) is None  # a response that was not logged
    assert ir.token_view(run_dir, 2, 0) is None and ir.logged_rows(run_dir, 2) == []  # a step without a token log


def test_token_view_without_a_reference_model_has_null_kl(run_dir):
    write_tokens(run_dir, 1, [token_record(0, ["a", "b"], 0.5, with_ref=False)])
    record = ir.token_view(run_dir, 1, 0)
    assert record["kl"] == [None, None] and record["ref_log_prob"] == [None, None]
    assert ir.token_summary(record, "kl")["with_value"] == 0
    assert ir.token_summary(record, "entropy") == {"tokens": 2, "sampled": 2, "with_value": 2, "mean": 0.25,
                                                   "clipped": 1}


def test_token_view_reads_the_sampled_flags_and_an_older_log_as_all_sampled(run_dir):
    write_tokens(run_dir, 1, [token_record(0, ["a", "b", "c"], 1.0, sampled=[True, False, True])])
    assert ir.token_view(run_dir, 1, 0)["sampled"] == [True, False, True]
    write_tokens(run_dir, 1, [token_record(0, ["a", "b"], 1.0)])
    assert ir.token_view(run_dir, 1, 0)["sampled"] == [True, True]


def test_token_summary_counts_only_the_tokens_the_policy_sampled():
    # token 1 is a tool's output: its entropy 9 and its clipped flag must not count
    record = {"tokens": ["a", "<out>", "b"], "entropy": [0.5, 9.0, 1.5], "clipped": [False, True, True],
              "sampled": [True, False, True]}
    assert ir.token_summary(record, "entropy") == {"tokens": 3, "sampled": 2, "with_value": 2,
                                                   "mean": pytest.approx(1.0), "clipped": 1}


def test_a_torn_token_log_is_an_inspect_error(run_dir):
    ir.tokens_file(run_dir, 1).write_bytes(b"PAR1 torn")
    with pytest.raises(ir.InspectError, match="token log of step 1"):
        ir.token_view(run_dir, 1, 0)


# ---- token html ----


def _spans(html_text: str) -> list[tuple[str, str, str]]:
    """(title, style, text) of each token span."""
    return re.findall(r'<span title="([^"]*)" style="([^"]*)">(.*?)</span>', html_text)


def _background(style: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.search(r"background:rgb\((\d+), (\d+), (\d+)\)", style).groups())


def test_token_text_is_html_escaped_and_newlines_show_as_a_return_sign():
    out = ir.token_html(["<script>alert(1)</script>", "\n", 'say "hi" & go'], [0.1, 0.2, 0.3], "advantage")
    assert "<script>" not in out and "&lt;script&gt;alert(1)&lt;/script&gt;" in out
    texts = [t for _, _, t in _spans(out)]
    assert texts == ["&lt;script&gt;alert(1)&lt;/script&gt;", "⏎", "say &quot;hi&quot; &amp; go"]
    assert "⏎</span><br>" in out


def test_each_token_has_a_tooltip_with_its_value_and_missing_values_read_na():
    spans = _spans(ir.token_html(["a", "b"], [-0.123456789, None], "log_prob"))
    assert spans[0][0] == "Log-prob (policy) = -0.123457 · token 0"
    assert spans[1][0] == "Log-prob (policy) = n/a · token 1" and "background:#e6e6e6" in spans[1][1]


def test_positive_and_negative_advantages_get_different_hues_and_zero_is_white():
    pos, neg, zero = (_background(s) for _, s, _ in _spans(ir.token_html(["+", "-", "0"], [2.0, -2.0, 0.0],
                                                                            "advantage")))
    assert pos[2] > pos[0]  # blue
    assert neg[0] > neg[2]  # red
    assert zero == (255, 255, 255)
    assert pos != neg


def test_diverging_colours_scale_with_magnitude_and_log_probs_darken_as_probability_drops():
    strong, weak = (_background(s) for _, s, _ in _spans(ir.token_html(["a", "b"], [1.0, 0.25], "kl")))
    assert sum(strong) < sum(weak)
    likely, unlikely = (_background(s) for _, s, _ in _spans(ir.token_html(["a", "b"], [-0.01, -5.0], "log_prob")))
    assert sum(likely) > sum(unlikely) and likely[0] > 250


def test_clipped_tokens_are_outlined_and_others_are_not():
    spans = _spans(ir.token_html(["a", "b"], [0.5, 0.5], "entropy", clipped=[False, True]))
    assert "outline" not in spans[0][1] and "outline" in spans[1][1]
    assert spans[1][0].endswith("· clipped")


def test_tokens_the_policy_did_not_sample_are_grey_with_a_tooltip_and_set_no_colour():
    tokens = ["<tool_call>", "calc", "36", "\n", "ok"]
    sampled = [True, True, False, False, True]
    out = ir.token_html(tokens, [1.0, 0.5, 100.0, -100.0, -0.5], "advantage", sampled=sampled,
                        clipped=[False, False, True, False, False])
    spans = _spans(out)
    grey = [i for i, (title, style, _) in enumerate(spans) if "background:#bdbdbd" in style]
    told = [i for i, (title, _, _) in enumerate(spans)
            if title.startswith("not sampled by the policy (tool or environment output): no loss")]
    assert grey == told == [2, 3]
    assert "outline" not in spans[2][1]  # a clipped flag means nothing where there is no loss
    # the scale comes from the sampled tokens only: 1.0 is the darkest blue, not 1 / 100 of it
    assert _background(spans[0][1]) == (33, 102, 172)
    assert [t for _, _, t in spans] == ["&lt;tool_call&gt;", "calc", "36", "⏎", "ok"]
    legend = ir.token_legend_html("advantage", [1.0, 0.5, 100.0, -100.0, -0.5], sampled=sampled)
    assert "+1" in legend and "100" not in legend and "background:#bdbdbd" in legend
    assert "#bdbdbd" not in ir.token_legend_html("advantage", [1.0], sampled=[True])
    assert "#bdbdbd" not in ir.token_html(["a"], [1.0], "advantage", sampled=None)


def test_an_unknown_quantity_names_the_known_ones():
    with pytest.raises(ValueError, match="known: advantage, kl"):
        ir.token_html(["a"], [1.0], "reward")


def test_every_quantity_has_a_label_and_only_signed_ones_diverge():
    assert {q for q, spec in ir.TOKEN_QUANTITIES.items() if spec.diverging} == {"advantage", "kl"}
    for q in ir.TOKEN_QUANTITIES:
        assert "linear-gradient" in ir.token_legend_html(q, [0.1, -0.3])
