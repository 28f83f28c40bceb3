"""Comparing models: the statistics with hand-worked numbers, streaming that ends where plain generation
ends, scored comparisons whose numbers agree with their own per-question records, saved evaluations."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from backend.core import data
from backend.core.config import load_config
from backend.engine.trainer import Trainer
from backend.rollout.base import SamplingParams
from backend.services import compare

from .conftest import tiny_overrides

PROMPT = "Tom has 3 apples and buys 4 more. How many apples does he have now?"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, sample_sets) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    cfg = load_config(None, tiny_overrides(sample_sets, **{"trainer.save_freq": 1}))
    Trainer(cfg, run_dir, show_progress=False).train()
    return run_dir


# ---- pass@k ----

def test_pass_at_k_matches_hand_worked_values():
    # n=5 samples, 2 correct, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert compare.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # k=1 is the fraction correct
    assert compare.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert compare.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)


def test_pass_at_k_is_zero_without_a_correct_sample_and_one_when_a_draw_cannot_miss():
    assert compare.pass_at_k(3, 0, 2) == 0.0
    assert compare.pass_at_k(3, 2, 2) == 1.0  # only one wrong sample: any two drawn hold a right one
    assert compare.pass_at_k(4, 1, 4) == 1.0  # k = n: any correct sample counts


def test_pass_at_k_equals_the_fraction_of_k_subsets_holding_a_correct_sample():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert compare.pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)):
        with pytest.raises(ValueError, match="pass_at_k"):
            compare.pass_at_k(n, c, k)


# ---- majority vote ----

def test_majority_vote_picks_the_most_frequent_answer():
    assert compare.majority_vote(["3", "5", "5"]) == 1


def test_majority_vote_breaks_ties_by_the_answer_seen_first():
    assert compare.majority_vote(["7", "3", "3", "7"]) == 0
    assert compare.majority_vote(["3", "7", "7", "3"]) == 0
    assert compare.majority_vote(["1", "2", "3"]) == 0


def test_majority_vote_ignores_samples_without_an_answer():
    assert compare.majority_vote([None, None, "4"]) == 2
    assert compare.majority_vote([None, "4", None, "9", "9"]) == 3
    assert compare.majority_vote([None, None]) is None
    assert compare.majority_vote([]) is None


# ---- paired difference ----

def test_paired_difference_ci_matches_hand_worked_numbers():
    a = [1, 1, 0, 0]
    b = [1, 0, 1, 1]
    # d = b - a = [0, -1, 1, 1]: mean 0.25; squared deviations 0.0625 + 1.5625 + 0.5625 + 0.5625 = 2.75,
    # sd = sqrt(2.75 / 3) = 0.957427; half width = 1.96 * 0.957427 / sqrt(4) = 0.938278
    mean, low, high = compare.paired_difference_ci(a, b)
    assert mean == pytest.approx(0.25)
    assert low == pytest.approx(0.25 - 0.938278, abs=1e-6)
    assert high == pytest.approx(0.25 + 0.938278, abs=1e-6)


def test_paired_difference_ci_is_a_point_when_every_pair_differs_the_same_way():
    assert compare.paired_difference_ci([0, 0, 1], [0, 0, 1]) == (0.0, 0.0, 0.0)
    assert compare.paired_difference_ci([0, 0, 0], [1, 1, 1]) == (1.0, 1.0, 1.0)


def test_paired_difference_ci_has_no_interval_for_a_single_pair_and_refuses_unequal_lists():
    mean, low, high = compare.paired_difference_ci([0], [1])
    assert mean == 1.0 and math.isnan(low) and math.isnan(high)
    with pytest.raises(ValueError, match="equal lengths"):
        compare.paired_difference_ci([0, 1], [1])


# ---- streaming ----

def _grows(texts: list[str]) -> bool:
    return all(later.startswith(earlier) and len(later) > len(earlier) for earlier, later in itertools.pairwise(texts))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-llama", "export"])
def test_a_streamed_greedy_answer_grows_and_ends_as_the_plain_greedy_answer(model, tiny_run):
    model = str(tiny_run / "export") if model == "export" else model
    params = SamplingParams(max_new_tokens=12, greedy=True)
    texts = list(compare.stream_text(model, PROMPT, params))
    assert len(texts) > 1 and _grows(texts)
    [[plain]] = compare.load_cached(model).generate([PROMPT], temperature=0.0, max_new_tokens=12)
    assert texts[-1] == plain
    assert "".join(compare.stream_answer(model, PROMPT, params)) == plain


def test_a_streamed_sampled_answer_is_the_plain_sampled_answer_of_the_same_seed():
    # Random tiny models write stray bytes: this covers tokens that end inside a UTF-8 character.
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    for seed in (0, 1):
        texts = list(compare.stream_text("tiny-llama", PROMPT, params, seed=seed))
        assert _grows(texts)
        [[plain]] = compare.load_cached("tiny-llama").generate([PROMPT], temperature=1.0, max_new_tokens=40, seed=seed)
        assert texts[-1] == plain


def test_stream_answers_gives_both_models_side_by_side(tiny_run):
    export = str(tiny_run / "export")
    params = SamplingParams(max_new_tokens=10, greedy=True)
    pairs = list(compare.stream_answers("tiny-llama", export, PROMPT, params))
    for column in (0, 1):
        texts = [p[column] for p in pairs]
        assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    [[plain_a]] = compare.load_cached("tiny-llama").generate([PROMPT], max_new_tokens=10)
    [[plain_b]] = compare.load_cached(export).generate([PROMPT], max_new_tokens=10)
    assert pairs[-1] == (plain_a, plain_b)


def test_sampling_both_sides_with_the_same_seed_gives_one_model_the_same_answer_twice():
    params = SamplingParams(temperature=1.0, max_new_tokens=20)
    text_a, text_b = list(compare.stream_answers("tiny-llama", "tiny-llama", PROMPT, params, seed=3))[-1]
    assert text_a == text_b and text_a


def test_loaded_models_are_cached_and_a_checkpoint_gets_its_runs_tokenizer(tiny_run):
    ckpt = str(tiny_run / "checkpoints" / "step_2")
    first = compare.load_cached(ckpt)
    assert compare.load_cached(ckpt) is first
    assert len(first.tokenizer) == len(compare.load_cached("tiny-qwen3").tokenizer) > 100


# ---- scored comparison ----

def _check_consistent(result: compare.CompareResult) -> None:
    """Every summary number is what the per-question records say."""
    k, n = result.k, result.n
    for side in ("a", "b"):
        scores = getattr(result, side)
        first = [q[side]["correct"][0] for q in result.questions]
        assert scores.accuracy == pytest.approx(sum(first) / n)
        assert scores.pass_at_k == pytest.approx(sum(any(q[side]["correct"]) for q in result.questions) / n)
        assert scores.mean_at_k == pytest.approx(sum(sum(q[side]["correct"]) / k for q in result.questions) / n)
        for value in (scores.accuracy, scores.pass_at_k, scores.maj_at_k, scores.mean_at_k):
            assert 0.0 <= value <= 1.0
        assert scores.maj_at_k <= scores.pass_at_k and scores.accuracy <= scores.pass_at_k
        for q in result.questions:
            assert len(q[side]["responses"]) == len(q[side]["preds"]) == len(q[side]["correct"]) == k
    assert result.difference == pytest.approx(result.b.accuracy - result.a.accuracy)
    assert result.ci_low <= result.difference <= result.ci_high
    disagree = [q["index"] for q in result.questions if q["a"]["correct"][0] != q["b"]["correct"][0]]
    assert [d["index"] for d in result.disagreements] == disagree
    by_index = {q["index"]: q for q in result.questions}
    for d in result.disagreements:
        q = by_index[d["index"]]
        assert d["correct_a"] != d["correct_b"]
        assert (d["answer_a"], d["answer_b"]) == (q["a"]["responses"][0], q["b"]["responses"][0])


def test_greedy_comparison_of_the_base_model_and_the_runs_export_is_consistent(tiny_run, sample_sets):
    result = compare.compare_on_file("tiny-qwen3", str(tiny_run / "export"), sample_sets["val"], k=1, limit=4,
                                     max_new_tokens=8)
    assert result.n == 4 and result.k == 1 and result.temperature == 0.0
    _check_consistent(result)
    for scores in (result.a, result.b):
        assert scores.pass_at_k == scores.maj_at_k == scores.accuracy  # one greedy sample


def test_sampled_comparison_scores_every_sample_and_reports_the_disagreements(tiny_run, sample_sets, tmp_path):
    export = str(tiny_run / "export")
    settings = dict(k=3, limit=6, temperature=1.0, max_new_tokens=8, seed=0)
    scout = compare.compare_on_file("tiny-llama", export, sample_sets["val"], **settings)
    # Random tiny models never solve arithmetic: make the ground truth of even questions A's first answer
    # and of odd ones B's, so that each is right somewhere. The same seed draws the same samples again.
    rows = data.load_rows(sample_sets["val"])[:6]
    truths = []
    for i, (row, q) in enumerate(zip(rows, scout.questions, strict=True)):
        pred = q["a" if i % 2 == 0 else "b"]["preds"][0]
        row["reward_model"]["ground_truth"] = pred if pred is not None else "999999"
        truths.append(row["reward_model"]["ground_truth"])
    rigged = tmp_path / "rigged.parquet"
    pq.write_table(pa.Table.from_pylist(rows), rigged)

    result = compare.compare_on_file("tiny-llama", export, rigged, **settings)
    _check_consistent(result)
    for side in ("a", "b"):
        assert [q[side]["preds"] for q in result.questions] == [q[side]["preds"] for q in scout.questions]
        expected = [q[side]["preds"][0] == truth for q, truth in zip(result.questions, truths, strict=True)]
        assert [q[side]["correct"][0] for q in result.questions] == expected
    assert result.a.accuracy > 0 and result.b.accuracy > 0
    # Both sides draw the same random numbers (the same seed), so near-uniform tiny models often agree;
    # the disagreements are exactly the questions whose first answers are judged differently.
    expected = [q["index"] for q in result.questions if q["a"]["correct"][0] != q["b"]["correct"][0]]
    assert [d["index"] for d in result.disagreements] == expected
    assert all(d["pred_a"] != d["pred_b"] for d in result.disagreements)


def test_comparison_on_a_file_that_does_not_fit_raises_a_data_error(tmp_path):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["1+1?"]}), bad)
    with pytest.raises(data.DataError, match="prompt"):
        compare.compare_on_file("tiny-qwen3", "tiny-qwen3", bad)


# ---- saved evaluations ----

def test_evaluating_a_checkpoint_saves_metrics_and_records_in_the_run(tiny_run, sample_sets):
    out = compare.evaluate_checkpoint(tiny_run, "step_2", sample_sets["val"], limit=3)
    assert out == tiny_run / "evals" / "step_2__arithmetic_val.json"
    saved = json.loads(out.read_text())
    assert saved["checkpoint"] == "step_2" and saved["step"] == 2 and saved["n"] == 3
    assert saved["max_new_tokens"] == 8  # the run's data.max_response_length
    assert 0.0 <= saved["metrics"]["val/accuracy"] <= 1.0 and len(saved["records"]) == 3
    assert saved["timestamp"] > 0
    [listed] = [e for e in compare.list_evaluations(tiny_run) if e["path"] == str(out)]
    assert "records" not in listed and listed["metrics"] == saved["metrics"]


def test_list_evaluations_skips_unreadable_files_and_is_newest_first(tmp_path):
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "old.json").write_text(json.dumps({"checkpoint": "step_1", "timestamp": 1.0}))
    (evals / "new.json").write_text(json.dumps({"checkpoint": "step_2", "timestamp": 2.0}))
    (evals / "torn.json").write_text("{\"checkpoint\": ")
    assert [e["checkpoint"] for e in compare.list_evaluations(tmp_path)] == ["step_2", "step_1"]
    assert compare.list_evaluations(tmp_path / "missing") == []


def test_an_unknown_checkpoint_names_the_ones_the_run_has(tiny_run, sample_sets):
    with pytest.raises(FileNotFoundError, match="step_1, step_2, export"):
        compare.evaluate_checkpoint(tiny_run, "step_9", sample_sets["val"])


# ---- what the page shows ----

@pytest.mark.parametrize(("text", "words"), [
    ("", "empty"), ("\n" * 12, "12 newlines"), (" ", "1 space"), ("\n\n  \t", "2 newlines, 2 spaces and 1 tab"),
    ("\u00a0\u00a0", "2 other blank characters"), ("\n 7 \n", None)])
def test_blank_answer_names_what_an_answer_that_shows_nothing_is_made_of(text, words):
    assert compare.blank_answer(text) == words


def test_compare_starts_from_the_opened_runs_base_model_and_export_not_the_newest_export(tiny_run, tmp_path):
    from backend.services.model_picker import compare_defaults, model_choices

    root = tmp_path / "runs"
    for name, hours in (("opened", 0), ("newer", 1)):  # "newer": the newest export, of another run (a fork, say)
        copy = root / name
        shutil.copytree(tiny_run / "export", copy / "export")
        for item in ("config.yaml", "status.json"):
            shutil.copy(tiny_run / item, copy / item)
        status = json.loads((copy / "status.json").read_text())
        status["started"] += hours * 3600
        (copy / "status.json").write_text(json.dumps(status))
    choices = model_choices(root)
    assert compare_defaults(choices, root, "opened", "tiny-llama") == ("tiny-qwen3 (shipped)", "run opened · export")
    # no run opened, or the one opened is gone: the model being configured, and the newest run's export
    assert compare_defaults(choices, root, None, "tiny-llama") == ("tiny-llama (shipped)", "run newer · export")
    assert compare_defaults(choices, root, "deleted", "tiny-llama") == ("tiny-llama (shipped)", "run newer · export")
