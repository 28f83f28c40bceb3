"""The Rollouts page (pages/rollouts.py) in Streamlit's AppTest: it shows groups, filters them, follows a
prompt across steps, draws a logged response's tokens, shows a multi-turn run's episodes turn by turn, and
answers a missing, torn or deleted run with a message instead of an exception."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.core.config import load_config
from backend.engine.trainer import Trainer
from backend.services import rollouts as ir

from .conftest import REPO, tiny_overrides
from .test_inspect_rollouts import (
    DIVIDE_ERROR,
    PROMPT_A,
    episode_step,
    response,
    step_one,
    token_record,
    write_step,
    write_tokens,
)

PAGE = str(REPO / "pages" / "rollouts.py")
RUN = "20260101-000000-hand"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GRPO_WB_HOME", str(tmp_path))
    return tmp_path


def make_run(home: Path, name: str = RUN) -> Path:
    run = home / "runs" / name
    (run / "logs").mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"state": "succeeded", "step": 0, "total_steps": 3}))
    return run


@pytest.fixture
def hand_run(home) -> Path:
    """Step 1: two groups (index 10 with rewards 1, 0, 0.5, 0.5; index 11 all 0, one truncated), rows 0
    and 1 token-logged. Step 2: index 10 again, and index 12 with a negative reward. Step 3: a torn file."""
    run = make_run(home)
    write_step(run, 1, step_one())
    write_tokens(run, 1, [token_record(0, ["2", " +", " <b>3</b>", "\n"], 1.41), token_record(1, ["I"], -1.41)])
    write_step(run, 2, [response(2, 0, 10, PROMPT_A, "5", 1.0), response(2, 0, 10, PROMPT_A, "4", 0.0),
                        response(2, 1, 12, "Say nothing.", "no", -1.0)])
    ir.step_file(run, 3).write_bytes(b"PAR1 torn mid-write")
    return run


@pytest.fixture
def episode_run(home) -> Path:
    """One step of a multi-turn run (tests.test_inspect_rollouts.episode_step): group 0 holds the call that
    failed and the episode the turn limit ended, group 1 a clean call and an answer without one, group 2
    the environment's failure. Row 0's tokens are logged: its call, the tool's output (not sampled), its
    answer."""
    run = make_run(home, "20260101-000000-tools")
    write_step(run, 1, episode_step())
    write_tokens(run, 1, [token_record(0, ["<tool_call>", "5 / 0", "Zero", "Division", "It is 5"], 1.0,
                                       sampled=[True, True, False, False, True])])
    return run


def page() -> AppTest:
    return AppTest.from_file(PAGE, default_timeout=60)


def group_labels(at: AppTest) -> list[str]:
    return [e.label for e in at.expander if e.label.startswith("group ")]


def texts(elements) -> list[str]:
    return [str(e.value) for e in elements]


def in_groups(at: AppTest, kind: str) -> list[str]:
    """Values of the `kind` elements (text, markdown, code, caption, error) inside the group expanders, not
    the same prompt's history below them."""
    return [str(e.value) for x in at.expander if x.label.startswith("group ") for e in getattr(x, kind)]


def assert_fine(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def open_step(at: AppTest, step: int) -> AppTest:
    at.select_slider(key="rollouts_step").set_value(step)
    return at.run()


# ---- messages instead of exceptions ----


def test_with_no_runs_the_page_says_so(home):
    at = page().run()
    assert_fine(at)
    assert any("No runs yet" in t for t in texts(at.info))


def test_a_run_without_rollouts_gets_a_message(home):
    make_run(home, "20260101-000000-fresh")
    at = page().run()
    assert_fine(at)
    assert any("has no rollouts yet" in t for t in texts(at.info))


def test_a_torn_step_file_is_reported_and_another_step_still_opens(hand_run):
    at = page().run()
    assert_fine(at)
    assert at.select_slider(key="rollouts_step").value == 3  # the newest step opens first
    assert any("torn or not a parquet file" in t for t in texts(at.error))
    at = open_step(at, 1)
    assert_fine(at)
    assert not at.error and len(group_labels(at)) == 2


def test_a_run_deleted_while_open_gets_a_message(hand_run, home):
    at = open_step(page().run(), 1)
    shutil.rmtree(hand_run)
    at.run()
    assert_fine(at)
    assert any("No runs yet" in t for t in texts(at.info))


# ---- groups and filters ----


def test_groups_show_their_mean_spread_and_best_and_worst(hand_run):
    at = open_step(page().run(), 1)
    assert_fine(at)
    labels = group_labels(at)
    assert len(labels) == 2
    assert "mean 0.500 ± 0.354" in labels[0] and "n=4" in labels[0]
    assert "zero spread" in labels[1]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Responses"] == "6" and metrics["Zero-spread groups"] == "1" and metrics["Truncated"] == "1"
    lines = texts(at.markdown)
    assert any(t.startswith(":green-badge[best]") and "reward **1.000**" in t for t in lines)
    assert any(t.startswith(":red-badge[worst]") and "reward **0.000**" in t for t in lines)


def test_filters_change_which_groups_and_responses_are_shown(hand_run):
    at = open_step(page().run(), 1)
    at.checkbox(key="rollouts_truncated").check().run()
    assert_fine(at)
    labels = group_labels(at)
    assert len(labels) == 1 and "index 11" in labels[0]
    assert "Let me count the apples one by one" in texts(at.text)
    assert "4 - 1 = 3 so" not in texts(at.text)

    at.checkbox(key="rollouts_truncated").uncheck()
    at.text_input(key="rollouts_search").input("I THINK").run()
    assert_fine(at)
    assert len(group_labels(at)) == 1 and "I think it is 6 #### 6" in texts(at.text)

    at.text_input(key="rollouts_search").input("")
    at.checkbox(key="rollouts_zero_spread").check().run()
    assert [("index 11" in label) for label in group_labels(at)] == [True]

    at.checkbox(key="rollouts_zero_spread").uncheck()
    at.multiselect(key="rollouts_sources").set_value(["arithmetic"]).run()
    assert [("index 10" in label) for label in group_labels(at)] == [True]

    at.multiselect(key="rollouts_sources").set_value([])
    at.slider(key="rollouts_reward_range").set_value((0.75, 1.0)).run()
    assert_fine(at)
    assert len(group_labels(at)) == 1
    assert any("1 of the 4 responses pass the filters" in t for t in texts(at.caption))

    at.slider(key="rollouts_reward_range").set_value((0.2, 0.3)).run()
    assert_fine(at)
    assert group_labels(at) == [] and any("No response passes the filters" in t for t in texts(at.info))


def test_the_whole_reward_range_stays_whole_on_a_step_with_other_rewards(hand_run):
    at = open_step(page().run(), 1)
    assert at.slider(key="rollouts_reward_range").value == (0.0, 1.0)
    at = open_step(at, 2)
    assert_fine(at)
    assert at.slider(key="rollouts_reward_range").value == (-1.0, 1.0) and len(group_labels(at)) == 2


def test_the_same_prompt_is_followed_across_steps(hand_run):
    at = open_step(page().run(), 1)
    assert at.selectbox(key="rollouts_prompt").value == 10
    assert at.get("plotly_chart")
    step_labels = [e.label for e in at.expander if e.label.startswith("step ")]
    assert step_labels[0].startswith("step 2 · group 0 · 2 responses") and step_labels[1].startswith("step 1 ·")
    at.selectbox(key="rollouts_prompt").set_value(11).run()
    assert_fine(at)
    assert any("only at step 1" in t for t in texts(at.caption))


# ---- token view ----


def test_a_logged_response_is_drawn_as_coloured_tokens_and_another_says_not_logged(hand_run):
    at = open_step(page().run(), 1)
    assert_fine(at)
    assert at.selectbox(key="rollouts_token_row").value == 0
    assert at.radio(key="rollouts_quantity").value == "advantage"
    bodies = [h.value for h in at.html]
    tokens = next(b for b in bodies if "<span title=" in b)
    assert "&lt;b&gt;3&lt;/b&gt;" in tokens and "<b>" not in tokens and "⏎" in tokens
    assert any("linear-gradient" in b for b in bodies)  # the legend

    at.radio(key="rollouts_quantity").set_value("entropy").run()
    assert_fine(at)
    assert any("Entropy = 1.5 · token 3" in h.value for h in at.html)

    at.selectbox(key="rollouts_token_row").set_value(4).run()
    assert_fine(at)
    assert any("not logged" in t for t in texts(at.info))
    assert not any("<span title=" in h.value for h in at.html)


def test_a_step_without_a_token_log_says_so(hand_run):
    at = open_step(page().run(), 2)
    assert_fine(at)
    assert any("No response of step 2 has a token record" in t for t in texts(at.info))


# ---- multi-turn runs ----


def test_an_episode_is_shown_turn_by_turn_with_its_tool_calls_and_why_it_ended(episode_run):
    at = page().run()
    assert_fine(at)
    assert len(group_labels(at)) == 3
    lines = in_groups(at, "markdown")
    assert any(t.startswith("↳ tool call **calculator**") for t in lines)
    assert '{\n  "expression": "5 / 0"\n}' in in_groups(at, "code")  # the arguments, pretty-printed
    assert any(t.startswith(":red-badge[tool error] **errors**") for t in lines)
    shown = in_groups(at, "text")
    assert shown.count(DIVIDE_ERROR) == 2  # the call's output and the tool's turn after it
    assert shown[:4] == [PROMPT_A, "Let me divide.", DIVIDE_ERROR, DIVIDE_ERROR]  # in turn order
    assert "Check again." in shown and "42" in shown
    captions = in_groups(at, "caption")
    assert any(t == "turns 4 · tool calls 2, failed 0 · ended: turn limit reached" for t in captions)
    assert any("environment failed" in t for t in captions)
    assert any("the sandbox died" in t for t in in_groups(at, "error"))
    assert any("environment 1.00" in t for t in lines)  # the reward parts, the environment's among them


def test_ticking_tool_error_leaves_only_the_groups_with_a_failure(episode_run):
    at = page().run()
    at.checkbox(key="rollouts_tool_error").check().run()
    assert_fine(at)
    labels = group_labels(at)
    assert [("index 10" in label, "index 12" in label) for label in labels] == [(True, False), (False, True)]
    assert "It is 5. #### 5" in in_groups(at, "text") and "Check again." not in in_groups(at, "text")

    at.checkbox(key="rollouts_tool_error").uncheck()
    at.checkbox(key="rollouts_no_tool_call").check().run()
    assert_fine(at)
    assert ["index 11" in label for label in group_labels(at)] == [True]
    assert "#### 3" in in_groups(at, "text") and "So #### 3" not in in_groups(at, "text")

    at.checkbox(key="rollouts_max_turns").check().run()
    assert group_labels(at) == []


def test_the_tool_output_tokens_are_greyed_and_the_caption_says_why(episode_run):
    at = page().run()
    assert_fine(at)
    tokens = next(h.value for h in at.html if "<span title=" in h.value)
    greyed = [title for title, style in re_spans(tokens) if "background:#bdbdbd" in style]
    assert len(greyed) == 2 and all(t.startswith("not sampled by the policy (tool or environment output)")
                                    for t in greyed)
    captions = texts(at.caption)
    assert any(t.startswith("5 tokens, 3 sampled by the policy") for t in captions)
    assert any(t.startswith("Grey tokens are tool or environment output") for t in captions)


def test_a_single_turn_run_shows_no_episode_checkboxes_or_turns(hand_run):
    at = open_step(page().run(), 1)
    assert_fine(at)
    keys = {c.key for c in at.checkbox}
    assert "rollouts_truncated" in keys
    assert not keys & {"rollouts_tool_error", "rollouts_max_turns", "rollouts_no_tool_call"}
    assert not at.code and not any("tool call" in t for t in texts(at.markdown))
    assert not any("Grey tokens" in t for t in texts(at.caption))


def re_spans(html_text: str) -> list[tuple[str, str]]:
    return re.findall(r'<span title="([^"]*)" style="([^"]*)">', html_text)


# ---- a real run ----


@pytest.mark.slow
def test_a_real_tiny_model_run_is_inspected_end_to_end(home, sample_sets):
    cfg = load_config(None, tiny_overrides(sample_sets))
    run = home / "runs" / "20260101-000000-tiny"
    Trainer(cfg, run, show_progress=False).train()
    at = page().run()
    assert_fine(at)
    assert at.selectbox(key="rollouts_run").value == run.name
    assert at.select_slider(key="rollouts_step").value == 2
    # data.train_batch_size=2 prompts x rollout.n=4 samples
    labels = group_labels(at)
    assert len(labels) == 2 and all("n=4" in label for label in labels)
    assert any("<span title=" in h.value for h in at.html)
    at = open_step(at, 1)
    assert_fine(at)
    assert not at.error, texts(at.error)
    assert len(group_labels(at)) == 2 and any("<span title=" in h.value for h in at.html)


def test_the_page_renders_as_a_page_of_a_navigation_app(hand_run, tmp_path):
    # as app/main.py runs it: the entry point owns st.set_page_config, the page only draws
    app = tmp_path / "nav_app.py"
    app.write_text("import streamlit as st\n"
                   "st.set_page_config(page_title='nav', layout='wide')\n"
                   f"st.navigation([st.Page({PAGE!r}, title='Rollouts')]).run()\n")
    at = AppTest.from_file(str(app), default_timeout=60).run()
    assert_fine(at)
    assert at.title[0].value == "Rollouts" and at.select_slider(key="rollouts_step").value == 3
