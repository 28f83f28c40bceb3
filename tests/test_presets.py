"""Where a config starts from (presets, earlier runs, saved configs) and the config helpers the Config
page is built on: YAML text in, config and per-field messages out, batch arithmetic, the command line."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
import yaml

from backend.core import config as C
from backend.core import workspace
from backend.core.config import Config, ConfigError, load_config
from backend.core.models import resolve_model
from backend.services import presets

from .conftest import REPO


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A workspace root of its own, so saved configs land in tmp_path."""
    monkeypatch.setenv("GRPO_WB_HOME", str(tmp_path))
    return tmp_path


# ---- presets ----

def test_every_preset_loads_and_validates():
    # data files that do not exist (GSM8K's) are not the schema's business: only preflight checks them
    names = list(presets.list_presets())
    assert names == ["Quick try (tiny random model)", "GRPO on the arithmetic sample", "GSM8K GRPO", "Dr.GRPO",
                     "Recipe: arithmetic, one GPU", "Recipe: arithmetic, CPU (about 15 min)", "Recipe: GSM8K, one GPU",
                     "blank"]
    for name, path in presets.list_presets().items():
        cfg, problems = C.config_from_yaml_text(presets.preset_yaml_text(name))
        assert problems == [], name
        assert isinstance(presets.load_preset(name), dict)
        if path is not None:
            assert path.is_file()
            assert load_config(path) == cfg


def test_the_arithmetic_preset_is_the_default_config_file():
    assert presets.list_presets()["GRPO on the arithmetic sample"] == REPO / "configs/default.yaml"


def test_the_workbench_opens_on_the_quick_try_of_a_tiny_model_on_the_sample():
    assert presets.DEFAULT_PRESET == "Quick try (tiny random model)"
    cfg = load_config(presets.list_presets()[presets.DEFAULT_PRESET])
    assert cfg.actor_rollout_ref.model.path == "tiny-qwen3"
    assert cfg.data.train_files == ["sample_data/arithmetic_train.parquet"]


def test_a_time_estimate_names_the_model_the_steps_and_their_time_here(monkeypatch):
    from backend.services import planner

    # the 2-core CPU's speeds: about 200 GFLOP/s in fp32, 894 in bf16
    monkeypatch.setattr(planner, "cpu_flops", lambda dtype: 894e9 if dtype == torch.bfloat16 else 200e9)
    monkeypatch.setattr(planner, "visible_gpu", lambda: None)
    for model in ("smollm2-135m-instruct", "tiny-qwen3"):  # an estimate waits for its model to be made
        resolve_model(model)
    step_s = planner.plan(load_config(presets.list_presets()["GRPO on the arithmetic sample"])).step_seconds
    assert 5 < step_s < 60  # measured there: 12-13 s in bf16 (with bf16 instructions), 29-34 s in fp32
    assert presets.time_estimate("GRPO on the arithmetic sample") == \
        f"smollm2-135m-instruct, 20 steps: about {round(20 * step_s / 60)} min here"
    assert re.fullmatch(r"tiny-qwen3, 30 steps: about \d+ s here", presets.time_estimate(presets.DEFAULT_PRESET))


def test_a_time_estimate_names_a_shipped_model_not_made_yet_instead_of_making_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_WB_CACHE", str(tmp_path))
    estimate = presets.time_estimate("Dr.GRPO")
    assert estimate == "smollm2-135m-instruct; the time is estimated once the model is made (on its first use)"
    assert not any(tmp_path.iterdir())  # nothing converted


def test_blank_preset_is_the_schema_defaults():
    assert presets.list_presets()["blank"] is None
    assert presets.load_preset("blank") == C.to_dict(Config())
    cfg, problems = C.config_from_yaml_text(presets.preset_yaml_text("blank"))
    assert problems == [] and cfg == Config()


def test_drgrpo_preset_switches_estimator_and_loss_aggregation_on_the_sample():
    cfg = load_config(presets.list_presets()["Dr.GRPO"])
    assert cfg.algorithm.adv_estimator == "drgrpo"
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.data.train_files == ["sample_data/arithmetic_train.parquet"]


def test_gsm8k_preset_has_gsm8k_sizes_and_says_how_to_make_its_data():
    path = presets.list_presets()["GSM8K GRPO"]
    cfg = load_config(path)
    assert cfg.data.train_files == ["data/gsm8k_train.parquet"]
    assert cfg.data.val_files == ["data/gsm8k_val.parquet"]
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (256, 256)
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert "python -m backend data gsm8k" in path.read_text()


def test_an_unknown_preset_name_lists_the_presets():
    with pytest.raises(KeyError, match="Dr.GRPO"):
        presets.load_preset("PPO")


# ---- earlier runs and saved configs ----

def test_run_configs_lists_only_run_directories_that_hold_a_config(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a/config.yaml").write_text("data: {}\n")
    (tmp_path / "b").mkdir()  # a run without a config (still being created)
    (tmp_path / "notes.txt").write_text("x")
    assert presets.run_configs(tmp_path) == {"a": tmp_path / "a/config.yaml"}
    assert presets.run_configs(tmp_path / "missing") == {}


@pytest.mark.parametrize("name", ["a;b", "../x", "", ".hidden", "a b", "x" * 65, "$(rm)"])
def test_save_config_refuses_names_that_are_not_plain(home, name):
    with pytest.raises(workspace.PathError, match="not allowed"):
        presets.save_config(name, "data: {}\n")
    assert not workspace.saved_configs_dir().exists() or not any(workspace.saved_configs_dir().iterdir())


def test_save_config_writes_lists_and_refuses_to_overwrite(home):
    text = presets.preset_yaml_text("Dr.GRPO")
    path = presets.save_config("my-drgrpo", text)
    assert path == home / "configs/saved/my-drgrpo.yaml"
    assert path.read_text() == text
    assert presets.list_saved_configs() == {"my-drgrpo": path}
    with pytest.raises(FileExistsError, match="my-drgrpo"):
        presets.save_config("my-drgrpo", "data: {}\n")
    assert path.read_text() == text
    presets.save_config("my-drgrpo.yaml", "data: {}\n", overwrite=True)
    assert path.read_text() == "data: {}\n"


def test_save_config_refuses_text_that_is_not_yaml(home):
    with pytest.raises(ConfigError, match="not valid"):
        presets.save_config("broken", "data: [1\n")
    with pytest.raises(ConfigError, match="mapping"):
        presets.save_config("a-list", "- 1\n")


# ---- messages next to their field ----

def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/default.yaml", list(overrides))
    return e.value.problems


def test_problems_by_key_puts_each_engine_message_next_to_the_key_it_names():
    problems = _problems("actor_rollout_ref.rollout.temprature=0.5", "data.max_prompt_length=abc",
                         "data.train_batch_size=6", "actor_rollout_ref.actor.clip_ratio_low=1.5")
    by_key = C.problems_by_key(problems)
    assert by_key["actor_rollout_ref.rollout.temperature"] == [
        f"{REPO / 'configs/default.yaml'}: unknown key 'actor_rollout_ref.rollout.temprature'; did you mean "
        "'actor_rollout_ref.rollout.temperature'?"]
    assert by_key["data.max_prompt_length"][0].endswith("data.max_prompt_length='abc' must be an integer")
    assert by_key["data.train_batch_size"][0].startswith("data.train_batch_size=6 is not divisible by")
    # a whole key, not the shorter key it starts with (clip_ratio)
    assert by_key["actor_rollout_ref.actor.clip_ratio_low"] == [
        "actor_rollout_ref.actor.clip_ratio_low=1.5 must be between 0 and 1"]
    assert sum(len(v) for v in by_key.values()) == len(problems)


def test_problems_by_key_skips_partial_keys_and_files_and_keeps_general_messages_under_empty_key():
    [micro] = _problems("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    assert "rollout.n=4" in micro  # a partial key comes first in the message
    assert C.problems_by_key([micro]) == {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": [micro]}
    general = "config file configs/none.yaml does not exist"
    assert C.problems_by_key([general]) == {"": [general]}


# ---- YAML text in, config out ----

def test_config_from_yaml_text_returns_the_config_of_valid_text():
    text = (REPO / "configs/default.yaml").read_text()
    cfg, problems = C.config_from_yaml_text(text)
    assert problems == [] and cfg == load_config(REPO / "configs/default.yaml")
    cfg, problems = C.config_from_yaml_text(text, ["actor_rollout_ref.rollout.n=8"])
    assert problems == [] and cfg.actor_rollout_ref.rollout.n == 8
    assert C.config_from_yaml_text("") == (Config(), [])


@pytest.mark.parametrize("text, expected", [
    ("data: [1\n", "not valid YAML"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("data:\n  train_batch_size: 6\n", "not divisible"),
    ("trainer:\n  seedd: 1\n", "did you mean 'trainer.seed'"),
    ("data: {train_batch_size: x}\nalgorithm: {adv_estimator: ppo}\n", "must be an integer"),
])
def test_config_from_yaml_text_never_raises_and_explains(text, expected):
    cfg, problems = C.config_from_yaml_text(text)
    assert cfg is None
    assert any(expected in p for p in problems), problems


def test_config_from_yaml_text_reports_bad_overrides_and_null_sections():
    assert C.config_from_yaml_text("", ["rollout.n"])[1] == ["override 'rollout.n' must look like key.path=value"]
    cfg, problems = C.config_from_yaml_text("algorithm:\n", ["algorithm.adv_estimator=rloo"])
    assert cfg is None and len(problems) == 1


def test_draft_config_keeps_what_it_can_read():
    draft = C.draft_config("data:\n  train_batch_size: 6\n  max_prompt_length: abc\n")
    assert draft.data.train_batch_size == 6
    assert draft.data.max_prompt_length == Config().data.max_prompt_length
    assert C.draft_config("data: [1") is None


def test_set_yaml_value_changes_one_key_and_keeps_the_header_comment():
    text = (REPO / "configs/drgrpo.yaml").read_text()
    new = C.set_yaml_value(text, "actor_rollout_ref.rollout.n", 8)
    assert new.startswith(text.split("\ndata:")[0] + "\ndata:")
    assert "train_files: [sample_data/arithmetic_train.parquet]" in new
    expected = load_config(REPO / "configs/drgrpo.yaml", ["actor_rollout_ref.rollout.n=8"])
    assert C.config_from_yaml_text(new) == (expected, [])
    added = C.set_yaml_value("data:\n", "custom_reward_function.path", "my_reward.py")
    assert yaml.safe_load(added) == {"data": None, "custom_reward_function": {"path": "my_reward.py"}}
    with pytest.raises(ConfigError):
        C.set_yaml_value("data: [1", "data.seed", 1)
    with pytest.raises(ConfigError, match="did you mean"):
        C.set_yaml_value("", "data.sed", 1)


# ---- batch arithmetic ----

def test_derived_numbers_count_one_step_by_hand():
    cfg = load_config(None, ["data.train_batch_size=6", "actor_rollout_ref.rollout.n=4",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                             "actor_rollout_ref.actor.ppo_epochs=2"])
    assert C.derived_numbers(cfg) == {
        "prompts per step": 6,
        "responses per step": 24,                       # 6 prompts x 4 responses
        "responses per mini-batch": 8,                  # 2 prompts x 4 responses
        "optimizer steps per training step": 6,         # 6 / 2 mini-batches x 2 epochs
        "micro-batches per mini-batch per device": 2,   # 8 responses / 4 per pass
    }


def test_derived_numbers_say_when_a_count_is_not_whole():
    cfg = load_config(None, ["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6"], validate=False)
    numbers = C.derived_numbers(cfg)
    assert numbers["optimizer steps per training step"] == "1.5 (6 / 4 is not whole)"
    assert numbers["micro-batches per mini-batch per device"] == "2.66667 (16 / 6 is not whole)"


def test_derived_numbers_with_micro_batches_by_tokens_give_the_budget_not_a_count_of_rows():
    cfg = load_config(None, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"])
    assert C.derived_numbers(cfg)["micro-batches per mini-batch per device"] == "by tokens, up to 4096 positions each"


# ---- the command line ----

def test_overrides_from_defaults_reproduce_the_config():
    cfg = load_config(REPO / "configs/gsm8k_grpo.yaml", [
        "trainer.experiment_name='yes'",                    # YAML 1.1 reads a bare yes as true
        "custom_reward_function.path=my rewards/r.py",      # a space: quoted on the command line
        "actor_rollout_ref.actor.clip_ratio_low=0.1",       # None by default
        "actor_rollout_ref.actor.use_kl_loss=false",
        "data.val_files=[]",
        "actor_rollout_ref.actor.optim.lr=3e-7",
    ])
    overrides = C.overrides_from_defaults(cfg)
    assert "actor_rollout_ref.rollout.n=8" in overrides
    assert not any(o.startswith("trainer.seed=") for o in overrides)  # unchanged keys stay out
    assert load_config(None, overrides) == cfg
    command = C.cli_overrides_command(cfg)
    argv = shlex.split(command)
    assert argv[:5] == ["python", "-m", "backend", "train", "defaults"]
    assert load_config(None, argv[5:]) == cfg
    assert C.overrides_from_defaults(Config()) == []
    assert C.cli_command("configs/saved/my run.yaml") == "python -m backend train 'configs/saved/my run.yaml'"


def test_cli_reads_defaults_as_the_schema_defaults_and_validates_overrides():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "backend", "train", "defaults", "actor_rollout_ref.rollout.n=1"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "actor_rollout_ref.rollout.n must be >= 2 (got 1)" in result.stderr
    assert "does not exist" not in result.stderr
