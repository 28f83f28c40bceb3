"""The Sweeps page's logic, through Streamlit's AppTest: it refuses a bad sweep with the key named, shows a
sweep's trials, puts the best trial's config on the Config page, and deletes a sweep only once confirmed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from streamlit.testing.v1 import AppTest

from backend.core.config import load_config, to_yaml
from backend.services import presets, sweeps

from .conftest import REPO, finished_trials, tiny_overrides

PAGE = str(REPO / "pages/sweeps.py")
LR = "actor_rollout_ref.actor.optim.lr"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GRPO_WB_HOME", str(tmp_path))
    return tmp_path


def page(home: Path, config_text: str | None = None) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    if config_text is not None:
        at.session_state[presets.SESSION_KEY] = config_text
    return at


def test_with_no_sweeps_the_page_says_so_and_offers_the_form(home):
    at = page(home).run()
    assert not at.exception
    assert any("No sweeps yet" in i.value for i in at.info)
    assert at.button(key="sweep_start")


def test_a_sweep_over_an_unknown_key_is_refused_naming_it_and_nothing_starts(home, sample_sets):
    at = page(home, to_yaml(load_config(None, tiny_overrides(sample_sets)))).run()
    at.text_area(key="sweep_keys").set_value("actor.optim.lr=1e-6,1e-5")
    at.button(key="sweep_start").click().run()
    assert not at.exception
    assert any(f"actor.optim.lr is not a config key; did you mean {LR}" in e.value for e in at.error)
    assert sweeps.list_sweeps(home / "runs") == []


def test_a_sweeps_trials_are_listed_and_the_best_goes_to_the_config_page(home, sample_sets):
    base = load_config(None, tiny_overrides(sample_sets))
    spec = sweeps.SweepSpec(params=[sweeps.SweepParam(LR, values=[1e-3, 1e-6])], metric="actor/lr", steps=3)
    folder = sweeps.create_sweep(base, spec, name="lr", runs_root=home / "runs")
    # The two trials as the sweep records them, through Optuna, without training: the page reads the journal.
    study = sweeps._study(folder, spec)
    for _ in range(2):
        trial = study.ask()
        lr = trial.suggest_categorical(LR, [1e-3, 1e-6])
        for step in (1, 2, 3):
            trial.report(lr, step)
        study.tell(trial, lr)
    at = page(home).run()
    assert not at.exception
    table = at.dataframe[0].value
    assert list(table["trial"]) == [0, 1] and list(table["state"]) == ["complete", "complete"]
    assert list(table["best so far"]) == [1e-3, 1e-3]
    assert any("best so far #0" in m.value for m in at.markdown)
    at.button(key="sweep_promote").click().run()
    at.run()  # what the two-second refresh does: the notice stays
    assert any("The Config page now holds trial #0's config" in m.value for m in at.success)
    promoted = yaml.safe_load(at.session_state[presets.SESSION_KEY])
    assert promoted["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-3
    assert promoted["trainer"]["total_training_steps"] == 3


def test_a_sweep_is_deleted_only_once_confirmed_and_with_its_runs_when_asked(home, sample_sets):
    base = load_config(None, tiny_overrides(sample_sets))
    spec = sweeps.SweepSpec(params=[sweeps.SweepParam(LR, values=[1e-3, 1e-6])])
    folder = sweeps.create_sweep(base, spec, name="lr", runs_root=home / "runs")
    runs = finished_trials(folder, spec, home / "runs")
    at = page(home).run()
    assert at.button(key="sweep_delete").disabled
    at.checkbox(key="sweep_delete_confirm").check().run()
    at.checkbox(key="sweep_delete_runs").check().run()
    at.button(key="sweep_delete").click().run()
    assert not at.exception
    assert any("Deleted sweep lr and its trials' runs" in m.value for m in at.success)
    assert any("No sweeps yet" in i.value for i in at.info)
    assert not folder.exists() and not any(r.exists() for r in runs)


def test_the_clone_form_offers_a_trials_config_at_its_latest_checkpoint_and_says_why_it_cannot_start(home,
                                                                                                    sample_sets):
    base = load_config(None, tiny_overrides(sample_sets))
    spec = sweeps.SweepSpec(params=[sweeps.SweepParam(LR, values=[1e-3, 1e-6])])
    folder = sweeps.create_sweep(base, spec, name="lr", runs_root=home / "runs")
    run = finished_trials(folder, spec, home / "runs")[1]
    (run / "config.yaml").write_text(to_yaml(load_config(None, tiny_overrides(sample_sets, **{LR: 1e-6}))))
    for step in (1, 2):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
    at = page(home).run()
    assert at.selectbox(key="sweep_clone_trial").value == 1
    (editor,) = [t for t in at.text_area if t.label == "Config of the clone (from step_2)"]
    assert yaml.safe_load(editor.value)["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-6
    at.button(key="sweep_clone").click().run()
    assert not at.exception
    assert any("sweep lr is not running: a clone joins a running sweep" in e.value for e in at.error)
    assert len(sweeps.read_sweep(folder)["trials"]) == 2
