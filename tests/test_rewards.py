"""Reward scorers: answer extraction on tricky strings, the registry, users' functions, batch isolation."""

from __future__ import annotations

import math
import threading
import time

import pytest

from backend.rewards import registry, scoring
from backend.rewards.registry import (
    _REGISTRY,
    RewardError,
    get_scorer,
    known_data_sources,
    load_custom_reward,
    register_reward,
)
from backend.rewards.rules import (
    GSM8K_SCORERS,
    arithmetic_score,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    gsm8k_lenient_score,
    gsm8k_score,
    math_score,
    normalize_number,
)
from backend.rewards.scoring import ScoredBatch, concat_scored, from_scores, score_batch, weighted_sum


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test vanish after it."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(_REGISTRY))


# ---- normalize_number ----

@pytest.mark.parametrize(
    ("written", "canonical"),
    [("3.0", "3"), ("3", "3"), ("-0", "0"), ("0.0", "0"), ("1,234", "1234"), ("0.50", "0.5"),
     ("$18", "18"), ("-$5", "-5"), ("42.", "42"), (" 7 ", "7"), ("1 000", "1000"), ("+3", "3"),
     ("\u22124", "-4"), ("1,234,567.80", "1234567.8")],
)
def test_normalize_number_gives_one_string_for_every_way_of_writing_a_value(written, canonical):
    assert normalize_number(written) == canonical


@pytest.mark.parametrize("text", ["", "abc", "1/2", "nan", "inf", "Infinity", "1e5", "5 apples", "-", "."])
def test_normalize_number_returns_none_for_text_that_is_not_a_plain_number(text):
    assert normalize_number(text) is None


# ---- extract_hash_answer / extract_last_number ----

def test_hash_answer_with_thousands_commas_matches_the_plain_ground_truth():
    assert extract_hash_answer("so the total is\n#### 1,234") == "1,234"
    assert gsm8k_score("gsm8k", "#### 1,234", "1234")["score"] == 1.0


def test_hash_answer_keeps_a_negative_sign():
    assert extract_hash_answer("#### -5") == "-5"
    assert gsm8k_score("gsm8k", "#### -5", "-5")["score"] == 1.0
    assert gsm8k_score("gsm8k", "#### -5", "5")["score"] == 0.0


def test_hash_answer_with_a_trailing_zero_decimal_equals_the_shorter_ground_truth_under_the_lenient_rule():
    assert extract_hash_answer("#### 3.50") == "3.50"
    result = gsm8k_lenient_score("gsm8k", "#### 3.50", "3.5")
    assert result["score"] == 1.0
    assert result["pred"] == "3.5"


def test_a_response_without_any_answer_scores_zero_with_no_format_credit():
    assert extract_hash_answer("I am not sure how to solve this.") is None
    assert extract_last_number("I am not sure how to solve this.") is None
    assert gsm8k_score("gsm8k", "I am not sure.", "7") == {"score": 0.0, "correct": 0.0, "format": 0.0,
                                                           "pred": None}


def test_the_last_of_two_hash_answers_wins():
    text = "First guess #### 3\nWait, that is wrong.\n#### 7"
    assert extract_hash_answer(text) == "7"
    assert gsm8k_score("gsm8k", text, "7")["score"] == 1.0
    assert gsm8k_score("gsm8k", text, "3")["score"] == 0.0


def test_an_empty_last_hash_marker_means_no_strict_answer_even_after_an_earlier_one():
    assert extract_hash_answer("#### 3\nActually I cannot tell.\n####") is None


def test_text_after_the_hash_answer_is_ignored():
    assert extract_hash_answer("#### 42 apples in total, as computed above 17 times.") == "42"


@pytest.mark.parametrize("text", ["#### $18", "#### \\$18", "#### $ 18", "#### 18$"])
def test_dollar_signs_around_the_hash_answer_are_ignored(text):
    assert normalize_number(extract_hash_answer(text)) == "18"


def test_a_dollar_before_a_negative_number_keeps_the_sign():
    assert extract_hash_answer("#### -$5") == "-5"
    assert extract_hash_answer("#### $-5") == "-5"


def test_a_period_ending_the_sentence_is_not_part_of_the_number():
    assert extract_hash_answer("#### 42.") == "42"
    assert extract_last_number("So she pays 42.") == "42"
    assert extract_last_number("So she pays 3.5.") == "3.5"


def test_a_dash_between_numbers_is_not_read_as_a_minus_sign():
    assert extract_last_number("pages 10-15") == "15"
    assert extract_last_number("x = -15") == "-15"


def test_a_comma_separated_list_is_read_as_separate_numbers_not_one():
    assert extract_last_number("the answers are 5,6") == "6"


def test_strict_and_flexible_differ_when_the_answer_is_not_after_the_marker():
    text = "Each box holds 6, so 7 boxes hold 42."
    assert extract_hash_answer(text) is None
    assert extract_last_number(text) == "42"
    assert gsm8k_score("gsm8k", text, "42", method="strict")["score"] == 0.0
    # verl's flexible run of digits, dots and commas takes the sentence's full stop with it: "42." != "42"
    flexible = gsm8k_score("gsm8k", text, "42", method="flexible", format_score=0.1)
    assert flexible == {"score": 0.1, "correct": 0.0, "format": 1.0, "pred": "42."}


def test_words_between_the_marker_and_the_number_fail_strict_but_not_flexible():
    text = "#### The answer is 5"
    assert extract_hash_answer(text) is None
    assert extract_last_number(text) == "5"


# ---- extract_boxed ----

def test_boxed_content_keeps_nested_braces():
    assert extract_boxed(r"so $\boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"


def test_the_last_box_wins_and_fbox_counts_as_a_box():
    assert extract_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert extract_boxed(r"\boxed{1} then \fbox{3}") == "3"


def test_a_missing_box_gives_none():
    assert extract_boxed("The answer is 1/2.") is None
    assert math_score("math", "The answer is 1/2.", "\\frac{1}{2}") == {"score": 0.0, "correct": 0.0,
                                                                          "format": 0.0, "pred": None}


def test_a_box_cut_off_before_its_closing_brace_gives_none():
    assert extract_boxed(r"\boxed{1} and finally \boxed{\frac{3}{") is None


def test_escaped_braces_inside_a_box_are_content_even_when_unpaired():
    assert extract_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert extract_boxed(r"\boxed{\left\{ x \right.} done") == r"\left\{ x \right."


def test_the_brace_less_box_form_reads_one_token():
    assert extract_boxed(r"$\boxed 5$") == "5"


# ---- built-in scorers ----

def test_math_score_accepts_dfrac_for_frac_against_a_boxed_ground_truth():
    result = math_score("math", r"Thus \boxed{\dfrac{1}{2}}.", r"so \boxed{\frac{1}{2}}")
    assert result == {"score": 1.0, "correct": 1.0, "format": 1.0, "pred": r"\dfrac{1}{2}"}


def test_math_score_ignores_left_right_spacing_and_trailing_periods():
    assert math_score("math", r"\boxed{\left( 1,\! 2 \right).}", "(1,2)")["score"] == 1.0


def test_math_score_compares_numbers_and_simple_fractions_by_value():
    assert math_score("math", r"\boxed{3.0}", "3")["score"] == 1.0
    assert math_score("math", r"\boxed{0.50}", r"\frac{1}{2}")["score"] == 1.0
    assert math_score("math", r"\boxed{1/2}", r"\frac12 wrong form \boxed{\tfrac{1}{2}}")["score"] == 1.0


def test_math_score_does_not_read_a_list_as_a_thousands_number():
    assert math_score("math", r"\boxed{1,2}", "12")["score"] == 0.0


def test_math_score_gives_zero_but_format_for_a_wrong_box():
    assert math_score("math", r"\boxed{3}", "4") == {"score": 0.0, "correct": 0.0, "format": 1.0, "pred": "3"}


@pytest.mark.parametrize(
    ("response", "expected"),
    [("#### 12", 1.0),
     ("The sum is 12.", 0.5),
     ("I think 12 but #### 13", 0.0),
     ("Nothing here", 0.0)],
)
def test_lenient_gsm8k_rule_gives_half_credit_only_for_a_right_answer_without_marker(response, expected):
    assert gsm8k_lenient_score("openai/gsm8k", response, "12")["score"] == expected


def test_gsm8k_format_score_is_given_for_a_wrong_extracted_answer():
    result = gsm8k_score("gsm8k", "#### 41", "42", format_score=0.1)
    assert result == {"score": 0.1, "correct": 0.0, "format": 1.0, "pred": "41"}


# verl 0.9.1's GSM8K rule, worked by hand from its source: the last 300 characters; strict takes the last
# match of "#### (-?[0-9.,]+)" and drops its commas; flexible takes the last run of "-?[0-9.,]+" that is
# not a lone "." (all lone dots: the first), commas kept; the answer is compared with the ground truth as
# strings. Scored with format_score 0.1, so 0.0 means no answer read and 0.1 a wrong one.
PAD = " " * 293  # "#### 18" + PAD is 300 characters; one more pushes the first "#" out of the window
VERL_GSM8K_PROBES = [
    # (method, response, ground truth, score, pred)
    ("strict", "#### 18", "18", 1.0, "18"),
    ("strict", "#### 18.0", "18", 0.1, "18.0"),
    ("strict", "#### 2.50", "2.5", 0.1, "2.50"),
    ("strict", "#### 2.5", "2.5", 1.0, "2.5"),
    ("strict", "#### 018", "18", 0.1, "018"),
    ("strict", "#### $18", "18", 0.0, None),
    ("strict", "####18", "18", 0.0, None),
    ("strict", "#### - 5", "-5", 0.0, None),
    ("strict", "#### -5", "-5", 1.0, "-5"),
    ("strict", "#### 1,2,3", "123", 1.0, "123"),
    ("strict", "#### 1,234", "1234", 1.0, "1234"),
    ("strict", "#### 1,234", "1,234", 0.1, "1234"),  # the ground truth is compared as given
    ("strict", "#### 18,000", "18000", 1.0, "18000"),
    ("strict", "#### ,18", "18", 1.0, "18"),
    ("strict", "#### .5", "0.5", 0.1, ".5"),
    ("strict", "#### -.5", "-0.5", 0.1, "-.5"),
    ("strict", "#### 18.", "18", 0.1, "18."),
    ("strict", "#### 1.8e1", "18", 0.1, "1.8"),
    ("strict", "#### 18 apples", "18", 1.0, "18"),
    ("strict", "#### 18/1", "18", 1.0, "18"),
    ("strict", "#### \u221218", "-18", 0.0, None),  # U+2212 is not a minus
    ("strict", "#### -", "-5", 0.0, None),
    ("strict", "####  18", "18", 0.0, None),  # two spaces
    ("strict", "##### 18", "18", 1.0, "18"),
    ("strict", "#### 17\n#### 18", "18", 1.0, "18"),
    ("strict", "#### 18\nNo, #### 17", "18", 0.1, "17"),
    ("strict", "#### 18 #### ", "18", 1.0, "18"),  # the empty last marker is no match at all
    ("strict", "The answer is 18.", "18", 0.0, None),
    ("strict", "", "18", 0.0, None),
    ("strict", "#### 18" + PAD, "18", 1.0, "18"),
    ("strict", "#### 18" + PAD + " ", "18", 0.0, None),
    ("flexible", "The answer is 18", "18", 1.0, "18"),
    ("flexible", "The answer is 18.", "18", 0.1, "18."),
    ("flexible", "I have 5 apples and 18 pears", "18", 1.0, "18"),
    ("flexible", "answer: 18, done", "18", 0.1, "18,"),
    ("flexible", "18 then .", "18", 1.0, "18"),
    ("flexible", "...", "18", 0.1, "..."),
    ("flexible", "Dots . and . only", "18", 0.1, "."),
    ("flexible", "no digits here", "18", 0.0, None),
    ("flexible", "1,234 in all", "1234", 0.1, "1,234"),
    ("flexible", "1,234 in all", "1,234", 1.0, "1,234"),
    ("flexible", "-18 degrees", "-18", 1.0, "-18"),
    ("flexible", "costs $18", "18", 1.0, "18"),
    ("flexible", "\u221218", "-18", 0.1, "18"),
    ("flexible", "#### 18", "18", 1.0, "18"),
    ("flexible", "18" + " x" * 150, "18", 0.0, None),  # 302 characters: the 18 is cut off
]


@pytest.mark.parametrize(("method", "response", "truth", "score", "pred"), VERL_GSM8K_PROBES)
def test_gsm8k_score_is_verls_rule_on_every_probe(method, response, truth, score, pred):
    result = gsm8k_score("openai/gsm8k", response, truth, method=method, format_score=0.1)
    assert (result["score"], result["pred"]) == (score, pred)
    assert result["correct"] == float(score == 1.0)
    assert result["format"] == float(pred is not None)


def test_gsm8k_score_pays_the_given_score_for_a_right_answer():
    assert gsm8k_score("gsm8k", "#### 7", "7", score=2.0)["score"] == 2.0


def test_lenient_gsm8k_ground_truth_may_be_the_full_solution():
    assert gsm8k_lenient_score("gsm8k", "#### 72", "48 + 24 = 72\n#### 72")["score"] == 1.0


def test_gsm8k_rejects_an_unknown_method():
    with pytest.raises(RewardError, match="strict' or 'flexible"):
        gsm8k_score("gsm8k", "#### 1", "1", method="fuzzy")


def test_a_ground_truth_that_is_not_a_number_raises_naming_it():
    with pytest.raises(RewardError, match="'seven'.*not a number"):
        arithmetic_score("arithmetic", "#### 7", "seven")


@pytest.mark.parametrize(
    ("response", "score", "correct", "fmt"),
    [("3 + 4 = 7\n#### 7", 1.0, 1.0, 1.0),
     ("#### 8", 0.1, 0.0, 1.0),
     ("3 + 4 = 7", 0.5, 1.0, 0.0),
     ("3 + 4 = 8", 0.0, 0.0, 0.0),
     ("", 0.0, 0.0, 0.0)],
)
def test_arithmetic_rule_rewards_the_answer_first_and_the_format_a_little(response, score, correct, fmt):
    result = arithmetic_score("arithmetic", response, "7")
    assert (result["score"], result["correct"], result["format"]) == (score, correct, fmt)


# ---- registry ----

def test_every_built_in_data_source_is_registered():
    names = set(known_data_sources())
    assert {"openai/gsm8k", "gsm8k", "math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
            "HuggingFaceH4/MATH-500", "arithmetic"} <= names
    assert get_scorer("gsm8k") is gsm8k_score
    assert get_scorer("openai/gsm8k") is gsm8k_score
    assert get_scorer("HuggingFaceH4/MATH-500") is math_score


def test_an_unknown_data_source_names_itself_the_known_ones_and_the_custom_function_keys():
    with pytest.raises(RewardError) as info:
        get_scorer("my/unknown_set")
    message = str(info.value)
    assert "'my/unknown_set'" in message
    assert "openai/gsm8k" in message and "arithmetic" in message
    assert "custom_reward_function.path" in message and "custom_reward_function.name" in message
    assert isinstance(info.value, ValueError)


def test_register_reward_registers_one_function_under_several_names(scratch_registry):
    @register_reward("mine", "mine_v2")
    def mine(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    assert get_scorer("mine") is mine and get_scorer("mine_v2") is mine
    assert "mine" in known_data_sources()


def test_register_reward_without_a_name_says_how_to_use_it(scratch_registry):
    with pytest.raises(RewardError, match="at least one data_source"):
        @register_reward
        def nameless(data_source, solution_str, ground_truth, extra_info=None):
            return 0.0


# ---- a user's own function ----

GOOD_FILE = """
def helper(x):
    return x

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}

NOT_A_FUNCTION = 3

def two_args(solution_str, ground_truth):
    return 0.0
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(GOOD_FILE)
    return path


def test_a_custom_function_loads_from_an_absolute_file_path(reward_file):
    fn = load_custom_reward(str(reward_file), "compute_score")
    assert fn(data_source="x", solution_str="7", ground_truth="7", extra_info=None)["score"] == 1.0


def test_a_custom_function_loads_from_a_relative_file_path(reward_file, monkeypatch):
    monkeypatch.chdir(reward_file.parent)
    fn = load_custom_reward("my_reward.py", "compute_score")
    assert fn("x", "6", "7")["score"] == 0.0


def test_a_custom_function_loads_from_path_colon_name_shorthand(reward_file):
    assert load_custom_reward(f"{reward_file}:compute_score", "").__name__ == "compute_score"


def test_a_custom_function_loads_from_an_importable_module(tmp_path, monkeypatch):
    package = tmp_path / "userpkg_rewards_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(GOOD_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_custom_reward("userpkg_rewards_test.scoring", "compute_score")
    assert fn("x", "7", "7")["score"] == 1.0


def test_a_missing_custom_file_is_named_in_the_error(tmp_path):
    missing = tmp_path / "nowhere" / "reward.py"
    with pytest.raises(RewardError, match="file not found") as info:
        load_custom_reward(str(missing), "compute_score")
    assert str(missing) in str(info.value)


def test_a_module_name_that_does_not_import_says_it_is_neither_file_nor_module():
    with pytest.raises(RewardError, match="neither an existing .py file nor an importable module"):
        load_custom_reward("no_such_pkg_xyz.rewards", "compute_score")


def test_a_missing_custom_function_is_named_and_the_file_callables_are_listed(reward_file):
    with pytest.raises(RewardError) as info:
        load_custom_reward(str(reward_file), "score_it")
    message = str(info.value)
    assert "'score_it'" in message
    assert "compute_score" in message and "helper" in message and "two_args" in message


def test_a_custom_name_bound_to_a_non_function_is_refused(reward_file):
    with pytest.raises(RewardError, match="NOT_A_FUNCTION.*int, not a function"):
        load_custom_reward(str(reward_file), "NOT_A_FUNCTION")


def test_a_custom_function_with_the_wrong_signature_is_refused_with_the_expected_shape(reward_file):
    with pytest.raises(RewardError) as info:
        load_custom_reward(str(reward_file), "two_args")
    message = str(info.value)
    assert "two_args(solution_str, ground_truth)" in message
    assert "def two_args(data_source, solution_str, ground_truth, extra_info=None)" in message


def test_a_custom_file_that_raises_on_import_reports_the_exception(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import math\nx = 1 / 0\n")
    with pytest.raises(RewardError, match="ZeroDivisionError"):
        load_custom_reward(str(path), "compute_score")


# ---- score_batch ----

def _by_solution(data_source, solution_str, ground_truth, extra_info=None):
    """Behaves as the response tells it to, so one batch can hold every kind of failure."""
    if solution_str == "raise":
        return 1 / 0
    if solution_str == "none":
        return None
    if solution_str == "text":
        return "1.0"
    if solution_str == "nan":
        return float("nan")
    if solution_str == "inf":
        return math.inf
    if solution_str == "dict without score":
        return {"correct": 1.0}
    if solution_str == "dict with text score":
        return {"score": "high"}
    return {"score": float(solution_str), "correct": 1.0, "pred": solution_str}


def test_score_batch_scores_built_in_rows_and_reports_part_means():
    batch = score_batch(
        ["gsm8k", "arithmetic", "math"],
        ["#### 5", "the answer is 7", r"\boxed{2}"],
        ["5", "7", "3"],
    )
    assert batch.scores == [1.0, 0.5, 0.0]
    assert batch.preds == ["5", "7", "2"]
    assert batch.parts[1] == {"correct": 1.0, "format": 0.0}
    assert batch.metrics["reward/correct/mean"] == pytest.approx(2 / 3)
    assert batch.metrics["reward/format/mean"] == pytest.approx(2 / 3)
    assert batch.first_error is None


def test_score_batch_metric_names_are_exactly_the_counters_and_part_means():
    batch = score_batch(["gsm8k", "gsm8k"], ["#### 1", "2"], ["1", "2"])
    assert set(batch.metrics) == {"reward/errors", "reward/timeouts", "reward/invalid",
                                  "reward/correct/mean", "reward/format/mean"}
    counters = [batch.metrics[f"reward/{name}"] for name in ("errors", "timeouts", "invalid")]
    assert counters == [0.0, 0.0, 0.0]


def test_one_raising_row_scores_zero_is_counted_and_named_while_the_rest_are_scored():
    batch = score_batch(["s"] * 4, ["1", "raise", "0.5", "1"], ["g"] * 4, custom_fn=_by_solution)
    assert batch.scores == [1.0, 0.0, 0.5, 1.0]
    assert batch.metrics["reward/errors"] == 1.0
    assert batch.metrics["reward/invalid"] == 0.0
    assert "'_by_solution' raised ZeroDivisionError" in batch.first_error
    assert "(row 1)" in batch.first_error
    assert batch.parts[1] == {} and batch.preds[1] is None


@pytest.mark.parametrize("bad", ["none", "text", "nan", "inf", "dict without score", "dict with text score"])
def test_a_row_returning_something_other_than_a_finite_number_scores_zero_as_invalid(bad):
    batch = score_batch(["s"] * 3, ["1", bad, "0.25"], ["g"] * 3, custom_fn=_by_solution)
    assert batch.scores == [1.0, 0.0, 0.25]
    assert batch.metrics["reward/invalid"] == 1.0
    assert batch.metrics["reward/errors"] == 0.0
    assert "not a finite number (row 1)" in batch.first_error


def test_every_row_raising_gives_all_zero_scores_and_a_full_error_count():
    batch = score_batch(["s"] * 5, ["raise"] * 5, ["g"] * 5, custom_fn=_by_solution)
    assert batch.scores == [0.0] * 5
    assert batch.metrics["reward/errors"] == 5.0
    assert "(row 0)" in batch.first_error


def test_a_hanging_row_times_out_alone_and_the_batch_takes_about_one_timeout():
    release = threading.Event()

    def hangs_on_row_two(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            release.wait(30)
        return 1.0

    try:
        start = time.monotonic()
        batch = score_batch(["s"] * 5, ["a", "b", "hang", "c", "d"], ["g"] * 5,
                            custom_fn=hangs_on_row_two, timeout_s=0.5)
        elapsed = time.monotonic() - start
    finally:
        release.set()
    assert 0.4 < elapsed < 3.0
    assert batch.scores == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert batch.metrics["reward/timeouts"] == 1.0
    assert "timeout_s=0.5 (row 2)" in batch.first_error


def test_several_hanging_rows_cost_one_timeout_together_not_one_each():
    release = threading.Event()

    def hangs_on_odd_rows(data_source, solution_str, ground_truth, extra_info=None):
        if int(solution_str) % 2:
            release.wait(30)
        return 1.0

    try:
        start = time.monotonic()
        batch = score_batch(["s"] * 8, [str(i) for i in range(8)], ["g"] * 8,
                            custom_fn=hangs_on_odd_rows, timeout_s=0.5)
        elapsed = time.monotonic() - start
    finally:
        release.set()
    assert elapsed < 1.5
    assert batch.scores == [1.0, 0.0] * 4
    assert batch.metrics["reward/timeouts"] == 4.0


def test_once_every_worker_has_hung_the_rows_not_started_are_skipped_as_timeouts(monkeypatch):
    monkeypatch.setattr(scoring, "_MAX_WORKERS", 2)
    release = threading.Event()
    calls = []

    def always_hangs(data_source, solution_str, ground_truth, extra_info=None):
        calls.append(solution_str)
        release.wait(30)
        return 1.0

    try:
        start = time.monotonic()
        batch = score_batch(["s"] * 6, list("abcdef"), ["g"] * 6, custom_fn=always_hangs, timeout_s=0.3)
        elapsed = time.monotonic() - start
    finally:
        release.set()
    assert elapsed < 1.5
    # Rows a and b hang. The first to time out gets a replacement worker, which may start row c before b's
    # own timeout is seen (b can start a few ms after a); once two rows have hung, no row starts.
    assert len(calls) <= 3, calls
    assert batch.scores == [0.0] * 6
    assert batch.metrics["reward/timeouts"] == 6.0


def test_a_hung_worker_is_replaced_so_rows_behind_it_still_run_in_parallel(monkeypatch):
    # Two workers: one hangs on row 0; row 2 waits for row 3, which only a replacement worker can reach
    # before row 2's own timeout.
    monkeypatch.setattr(scoring, "_MAX_WORKERS", 2)
    release, row3_ran = threading.Event(), threading.Event()

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            release.wait(30)
        elif solution_str == "slow":
            time.sleep(0.25)
        elif solution_str == "wait for row 3":
            row3_ran.wait(30)
        elif solution_str == "row 3":
            row3_ran.set()
        return 1.0

    try:
        batch = score_batch(["s"] * 4, ["hang", "slow", "wait for row 3", "row 3"], ["g"] * 4,
                            custom_fn=scorer, timeout_s=0.5)
    finally:
        release.set()
        row3_ran.set()
    assert batch.scores == [0.0, 1.0, 1.0, 1.0]
    assert batch.metrics["reward/timeouts"] == 1.0


def test_custom_fn_scores_every_row_even_for_a_registered_data_source():
    seen = []

    def constant(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, extra_info))
        return 0.25

    batch = score_batch(["gsm8k", "unknown/source"], ["#### 1", "x"], ["1", "2"],
                        [{"index": 0}, None], custom_fn=constant)
    assert batch.scores == [0.25, 0.25]
    assert sorted(seen, key=lambda s: s[0]) == [("gsm8k", {"index": 0}), ("unknown/source", None)]


def test_score_batch_scores_gsm8k_rows_with_the_chosen_rule_and_others_with_their_own():
    args = (["openai/gsm8k", "gsm8k", "arithmetic"], ["The sum is 12.", "#### 2.50", "#### 7"], ["12", "2.5", "7"])
    assert score_batch(*args).scores == [0.0, 0.0, 1.0]  # verl's rule by default
    assert score_batch(*args, gsm8k_scorer="verl").scores == [0.0, 0.0, 1.0]
    assert score_batch(*args, gsm8k_scorer="lenient").scores == [0.5, 1.0, 1.0]


def test_score_batch_refuses_an_unknown_gsm8k_rule_naming_the_choices():
    with pytest.raises(RewardError, match="gsm8k_scorer='strict' is not a GSM8K rule; choose one of: verl, lenient"):
        score_batch(["gsm8k"], ["#### 1"], ["1"], gsm8k_scorer="strict")


def test_a_scorer_registered_over_gsm8k_is_kept_whichever_rule_is_chosen(scratch_registry):
    @register_reward("gsm8k")
    def always_half(data_source, solution_str, ground_truth, extra_info=None):
        return 0.5

    assert score_batch(["gsm8k", "openai/gsm8k"], ["#### 1", "1"], ["1", "1"], gsm8k_scorer="lenient").scores \
        == [0.5, 0.5]


def test_gsm8k_scorers_are_verls_rule_then_ours():
    assert list(GSM8K_SCORERS.items()) == [("verl", gsm8k_score), ("lenient", gsm8k_lenient_score)]


def test_an_unknown_data_source_fails_the_batch_before_anything_is_scored():
    with pytest.raises(RewardError, match="'nope'"):
        score_batch(["gsm8k", "nope"], ["#### 1", "#### 2"], ["1", "2"])


def test_lists_of_different_lengths_are_refused_with_their_lengths():
    with pytest.raises(RewardError, match="responses=1.*ground_truths=2"):
        score_batch(["gsm8k", "gsm8k"], ["#### 1"], ["1", "2"])


def test_a_batch_scored_through_a_loaded_file_keeps_its_extra_parts(reward_file):
    fn = load_custom_reward(str(reward_file), "compute_score")
    batch = score_batch(["x", "x"], ["7", "77"], ["7", "7"], custom_fn=fn)
    assert batch.scores == [1.0, 0.0]
    assert batch.metrics["reward/length/mean"] == pytest.approx(1.5)


def test_an_empty_batch_scores_nothing_and_reports_zero_counters():
    batch = score_batch([], [], [])
    assert batch.scores == [] and batch.first_error is None
    assert batch.metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/invalid": 0.0}


def test_chosen_rows_of_scored_batches_keep_every_failure_count_and_average_their_own_parts():
    a = ScoredBatch(scores=[1.0, 0.0], parts=[{"format": 1.0}, {"format": 0.0}], preds=["1", None],
                            metrics={"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/invalid": 0.0},
                            first_error="row 1 raised")
    b = ScoredBatch(scores=[0.5], parts=[{"format": 0.5}], preds=["2"],
                            metrics={"reward/errors": 0.0, "reward/timeouts": 2.0, "reward/invalid": 0.0})
    out = concat_scored([(a, [0]), (b, [0])])
    assert out.scores == [1.0, 0.5] and out.preds == ["1", "2"]
    assert out.metrics == {"reward/errors": 1.0, "reward/timeouts": 2.0, "reward/invalid": 0.0,
                           "reward/format/mean": 0.75}
    assert out.first_error == "row 1 raised"


def test_a_weighted_sum_adds_each_scorer_times_its_weight_and_names_each_part():
    rule = ScoredBatch(scores=[1.0, 0.0], parts=[{"acc": 1.0}, {"acc": 0.0}], preds=["3", None],
                               metrics={"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/invalid": 1.0})
    brevity = from_scores([0.5, -1.0])
    out = weighted_sum([("rule", 2.0, rule), ("brevity", 0.25, brevity)])
    assert out.scores == [2.0 + 0.125, 0.0 - 0.25]
    assert out.parts == [{"acc": 1.0, "brevity": 0.5}, {"acc": 0.0, "brevity": -1.0}]
    assert out.preds == ["3", None]
    assert out.metrics["reward/brevity/mean"] == -0.25 and out.metrics["reward/invalid"] == 1.0
