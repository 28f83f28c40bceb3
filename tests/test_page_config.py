"""The Config page, driven the way a browser drives it (streamlit.testing AppTest): fields and YAML stay in
step, the engine's own messages appear next to their field, bad input never crashes the page."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from backend.core import config as C
from backend.services import planner, presets

from .conftest import REPO

PAGE = str(REPO / "pages/config.py")
N = "cfg_actor_rollout_ref__rollout__n"
MINI = "cfg_actor_rollout_ref__actor__ppo_mini_batch_size"
ESTIMATOR = "cfg_algorithm__adv_estimator"


@pytest.fixture
def page(tmp_path, monkeypatch) -> AppTest:
    """The page, run once, in a workspace of its own (saved configs and runs under tmp_path)."""
    monkeypatch.setenv("GRPO_WB_HOME", str(tmp_path))
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception
    return at


def metric(at: AppTest, label: str) -> str:
    [m] = [m for m in at.metric if m.label == label]
    return m.value


def errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def test_page_renders_the_default_preset_without_exceptions(page):
    default_text = presets.preset_yaml_text(presets.DEFAULT_PRESET)
    assert page.session_state[presets.SESSION_KEY] == default_text
    assert page.text_area(key="config_yaml").value == default_text
    assert errors(page) == []
    assert page.number_input(key=N).value == 4
    assert page.text_area(key="cfg_data__train_files").value == "sample_data/arithmetic_train.parquet"
    assert metric(page, "responses per step") == "16"
    assert "python -m backend train configs/saved/config.yaml" in [c.value for c in page.code]


def test_every_common_field_shows_the_schema_help(page):
    specs = C.field_specs()
    widgets = [*page.number_input, *page.text_input, *page.text_area, *page.selectbox, *page.checkbox]
    fields = {w.key: w for w in widgets if w.key and w.key.startswith("cfg_")}
    assert len(fields) == 26
    for key, widget in fields.items():
        dotted = key.removeprefix("cfg_").replace("__", ".")
        assert widget.help.startswith(specs[dotted][1]["help"]), key


def test_changing_rollout_n_updates_the_yaml_and_responses_per_step(page):
    page.number_input(key=N).set_value(8).run()
    text = page.session_state[presets.SESSION_KEY]
    assert C.config_from_yaml_text(text)[0].actor_rollout_ref.rollout.n == 8
    assert page.text_area(key="config_yaml").value == text
    assert text.startswith("# Quick try: the whole flow")  # the header comment survives
    assert metric(page, "responses per step") == "32"
    assert metric(page, "responses per mini-batch") == "32"


def test_a_mini_batch_that_does_not_divide_the_batch_shows_the_engines_message(page):
    page.number_input(key=MINI).set_value(3).run()
    assert not page.exception
    _, problems = C.config_from_yaml_text(page.session_state[presets.SESSION_KEY])
    [message] = [p for p in problems if "is not divisible by" in p]
    assert message.startswith("data.train_batch_size=4 is not divisible by "
                              "actor_rollout_ref.actor.ppo_mini_batch_size=3")
    assert message in errors(page)
    assert metric(page, "optimizer steps per training step") == "1.33333"
    assert page.button(key="config_check_files").disabled


def test_malformed_yaml_shows_an_error_and_the_page_still_renders(page):
    page.text_area(key="config_yaml").input("data: [1\n  oops: {\n").run()
    assert not page.exception
    assert any("not valid YAML" in e for e in errors(page))
    assert page.number_input(key=N).disabled
    assert page.button(key="config_save").value is False  # still drawn
    page.text_area(key="config_yaml").input("actor_rollout_ref:\n  rollout:\n    n: 6\n").run()
    assert not page.exception and errors(page) == []
    assert page.number_input(key=N).value == 6 and not page.number_input(key=N).disabled


def test_a_value_the_schema_refuses_is_shown_in_its_field_with_the_message(page):
    page.text_area(key="config_yaml").input("algorithm:\n  adv_estimator: ppo\n").run()
    assert not page.exception
    assert page.selectbox(key=ESTIMATOR).value == "ppo"
    assert any(e.startswith("algorithm.adv_estimator='ppo' is not allowed") for e in errors(page))


def test_loading_the_drgrpo_preset_sets_the_algorithm_field(page):
    page.selectbox(key="config_start").select("preset · Dr.GRPO").run()
    assert page.selectbox(key=ESTIMATOR).value == "grpo"  # choosing alone changes nothing
    page.button(key="config_load").click().run()
    assert page.selectbox(key=ESTIMATOR).value == "drgrpo"
    assert page.selectbox(key="cfg_actor_rollout_ref__actor__loss_agg_mode").value == "seq-mean-token-sum-norm"
    assert page.session_state[presets.SESSION_KEY] == presets.preset_yaml_text("Dr.GRPO")


def test_saving_with_a_shell_character_in_the_name_is_refused(page, tmp_path):
    page.text_input(key="config_save_name").input("a;b").run()
    page.button(key="config_save").click().run()
    assert any("'a;b' is not allowed" in e for e in errors(page))
    assert not (tmp_path / "configs/saved").exists()


def test_a_saved_config_is_offered_as_a_start_and_not_overwritten(page, tmp_path):
    page.number_input(key=N).set_value(8).run()
    page.text_input(key="config_save_name").input("n8").run()
    page.button(key="config_save").click().run()
    saved = tmp_path / "configs/saved/n8.yaml"
    assert saved.read_text() == page.session_state[presets.SESSION_KEY]
    assert "python -m backend train configs/saved/n8.yaml" in [c.value for c in page.code]
    page.button(key="config_save").click().run()
    assert any("exists" in e for e in errors(page))

    page.selectbox(key="config_start").select("preset · blank").run()
    page.button(key="config_load").click().run()
    assert page.number_input(key=N).value == 4
    page.selectbox(key="config_start").select("saved · n8").run()
    page.button(key="config_load").click().run()
    assert page.number_input(key=N).value == 8


def test_a_config_text_set_by_another_page_fills_the_fields(page):
    page.session_state[presets.SESSION_KEY] = presets.preset_yaml_text("GSM8K GRPO")
    page.run()
    assert page.number_input(key=N).value == 8
    assert page.text_area(key="cfg_data__train_files").value == "data/gsm8k_train.parquet"
    assert page.text_area(key="config_yaml").value == presets.preset_yaml_text("GSM8K GRPO")


def test_editing_train_files_writes_a_list(page):
    page.text_area(key="cfg_data__train_files").input("a.parquet\n\n b.parquet \n").run()
    cfg, _ = C.config_from_yaml_text(page.session_state[presets.SESSION_KEY])
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]


def test_checking_files_reports_a_missing_data_file(page):
    page.text_area(key="config_yaml").input(
        "data:\n  train_files: [no/such/train.parquet]\n  val_files: []\n"
        "actor_rollout_ref:\n  model:\n    path: tiny-qwen3\n").run()
    assert errors(page) == []
    page.button(key="config_check_files").click().run()
    assert not page.exception
    assert "data.train_files: no/such/train.parquet does not exist" in errors(page)


def test_fields_come_back_from_the_yaml_text_after_visiting_another_page(tmp_path, monkeypatch):
    # Streamlit forgets a page's widget values when another page runs; the YAML text is what persists
    monkeypatch.setenv("GRPO_WB_HOME", str(tmp_path))
    (tmp_path / "other.py").write_text("import streamlit as st\nst.write('another page')\n")
    (tmp_path / "main.py").write_text(
        "import streamlit as st\n"
        f"st.navigation([st.Page({PAGE!r}, default=True), st.Page({str(tmp_path / 'other.py')!r})]).run()\n")
    at = AppTest.from_file(str(tmp_path / "main.py"), default_timeout=60).run()
    at.number_input(key=N).set_value(6).run()
    at.switch_page("other.py").run()
    assert not at.exception and N not in at.session_state
    at.switch_page(PAGE).run()
    assert not at.exception
    assert at.number_input(key=N).value == 6


def warning_texts(at: AppTest) -> list[str]:
    return [w.value for w in at.warning]


def test_a_custom_reward_file_is_named_as_code_that_launching_runs(page):
    # the default preset uses a built-in reward: nothing of the user's runs, so no notice to get used to ignoring
    assert not any("runs your code" in w for w in warning_texts(page))

    page.text_area(key="config_yaml").input(
        "custom_reward_function:\n  path: rewards/my_score.py\n  name: score_it\n").run()
    assert not page.exception
    [notice] = [w for w in warning_texts(page) if "runs your code" in w]
    assert "`rewards/my_score.py`" in notice and "`score_it`" in notice
    assert "training process" in notice and "permissions" in notice

    page.text_input(key="cfg_custom_reward_function__path").input("").run()
    assert not any("runs your code" in w for w in warning_texts(page))

    page.text_area(key="config_yaml").input("reward:\n  functions: [extra.py:brevity, pkg.rewards:fmt]\n").run()
    [notice] = [w for w in warning_texts(page) if "runs your code" in w]
    assert "`extra.py:brevity`" in notice and "`pkg.rewards:fmt`" in notice and " are imported" in notice


# ---- the plan panel ----

PLAN_OPEN = "config_plan_open"


def open_plan(at: AppTest, yaml_text: str) -> AppTest:
    at.text_area(key="config_yaml").input(yaml_text).run()
    at.session_state[PLAN_OPEN] = True  # what clicking the expander does
    return at.run()


def plan_verdicts(at: AppTest) -> list[str]:
    return [m.value for m in [*at.success, *at.error] if m.value.startswith(("fits", "does not fit"))]


TINY = presets.preset_yaml_text(presets.DEFAULT_PRESET).replace("smollm2-135m-instruct", "tiny-qwen3")


def test_the_plan_panel_plans_only_while_open(page):
    assert "Will it fit? Memory and time plan" in [e.label for e in page.expander]
    assert len(page.dataframe) == 0 and plan_verdicts(page) == []


def test_the_plan_panel_shows_each_phase_and_that_the_default_config_with_tiny_qwen3_fits(page):
    open_plan(page, TINY)
    assert not page.exception
    [table] = page.dataframe
    assert list(table.value["phase"]) == ["generation", "old log-prob", "reference log-prob", "update"]
    [verdict] = plan_verdicts(page)
    assert page.selectbox(key="config_plan_gpu").value == "this machine"
    if planner.visible_gpu() is None:  # planned for this machine's CPU and memory, not for a GPU it does not have
        assert verdict.startswith("fits") and verdict.endswith("GiB on this machine") and "h200" not in verdict
    else:
        assert verdict.startswith("fits") and planner.visible_gpu().name in verdict
    assert page.number_input(key="config_plan_gpus").value == 1  # trainer.n_gpus_per_node
    assert any(c.value.startswith("step time:") for c in page.caption)

    page.number_input(key="config_plan_gpus").set_value(2).run()
    [table2] = page.dataframe
    assert table2.value["allocated GiB"].iloc[3] < table.value["allocated GiB"].iloc[3]  # the update, sharded over 2
    assert C.config_from_yaml_text(page.session_state[presets.SESSION_KEY])[0].trainer.n_gpus_per_node == 1  # as it was

    # a GPU count set in the config becomes the panel's
    page.text_area(key="config_yaml").input(C.set_yaml_value(TINY, "trainer.n_gpus_per_node", 2)).run()
    assert page.number_input(key="config_plan_gpus").value == 2


def test_the_plan_panel_says_a_huge_config_does_not_fit_and_what_to_change(page):
    huge = TINY
    for key, value in (("data.train_batch_size", 64), ("actor_rollout_ref.rollout.n", 16),
                       ("actor_rollout_ref.actor.ppo_mini_batch_size", 64),
                       ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 256),
                       ("data.max_prompt_length", 4096), ("data.max_response_length", 28672)):
        huge = C.set_yaml_value(huge, key, value)
    open_plan(page, huge)
    page.selectbox(key="config_plan_gpu").select("l4").run()
    assert not page.exception
    [verdict] = plan_verdicts(page)
    assert verdict.startswith("does not fit") and "l4" in verdict
    assert any("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=" in m.value for m in page.markdown)


def test_the_plan_panel_shows_nothing_for_an_invalid_config(page):
    open_plan(page, TINY.replace("train_batch_size: 4", "train_batch_size: 6"))
    assert not page.exception
    assert any("is not divisible by" in e for e in errors(page))  # the page's own message, once
    assert len(page.dataframe) == 0 and plan_verdicts(page) == []
