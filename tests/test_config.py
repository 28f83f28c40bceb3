"""The config: verl's key paths, dotted overrides, and messages that name the key, value and fix."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from backend.algos.losses import KL_TYPES, LOSS_AGG_MODES
from backend.core.config import ConfigError, batch_plan, field_specs, load_config, to_yaml
from backend.rewards.rules import GSM8K_SCORERS
from backend.rewards.scoring import score_batch

REPO = Path(__file__).resolve().parents[1]


def problems_of(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/default.yaml", list(overrides))
    return e.value.problems


def test_default_config_file_loads_and_validates():
    cfg = load_config(REPO / "configs/default.yaml")
    assert cfg.actor_rollout_ref.model.path == "smollm2-135m-instruct"
    assert cfg.algorithm.adv_estimator == "grpo"


def test_dotted_overrides_are_parsed_as_yaml_values():
    cfg = load_config(REPO / "configs/default.yaml",
                      ["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.optim.lr=3e-6",
                       "data.train_files=[a.parquet, b.parquet]", "actor_rollout_ref.actor.use_kl_loss=false"])
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-6
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False


def test_unknown_key_names_the_closest_known_key():
    [msg] = problems_of("actor_rollout_ref.rollout.temprature=0.7")
    assert "unknown key 'actor_rollout_ref.rollout.temprature'" in msg
    assert "did you mean 'actor_rollout_ref.rollout.temperature'" in msg


def test_a_known_leaf_under_the_wrong_section_points_to_its_real_place():
    [msg] = problems_of("actor_rollout_ref.actor.n=8")
    assert "did you mean 'actor_rollout_ref.rollout.n'" in msg


def test_wrong_type_names_key_value_and_expected_type():
    [msg] = problems_of("data.train_batch_size=four")
    assert "data.train_batch_size='four' must be an integer" in msg


def test_booleans_are_not_accepted_as_numbers():
    [msg] = problems_of("actor_rollout_ref.rollout.n=true")
    assert "actor_rollout_ref.rollout.n=True must be an integer" in msg


def test_value_outside_choices_lists_allowed_values():
    [msg] = problems_of("algorithm.adv_estimator=grpoo")
    assert "algorithm.adv_estimator='grpoo' is not allowed" in msg
    assert "rloo" in msg


def test_an_fp8_kv_cache_with_hugging_face_generate_is_refused_naming_the_engines_that_have_one():
    [msg] = problems_of("actor_rollout_ref.rollout.kv_cache_dtype=fp8", "actor_rollout_ref.rollout.name=hf")
    assert "actor_rollout_ref.rollout.kv_cache_dtype=fp8" in msg and "workbench" in msg and "vllm" in msg
    assert problems_of("actor_rollout_ref.rollout.kv_cache_dtype=fp16")[0].startswith(
        "actor_rollout_ref.rollout.kv_cache_dtype='fp16' is not allowed")


def test_zero_and_negative_sizes_are_rejected():
    problems = problems_of("data.train_batch_size=0", "actor_rollout_ref.actor.optim.lr=-1")
    assert any("data.train_batch_size=0 must be >= 1" in p for p in problems)
    assert any("actor_rollout_ref.actor.optim.lr=-1.0 must be > 0" in p for p in problems)


def test_an_activation_memory_budget_outside_0_to_1_is_refused_with_its_range():
    [msg] = problems_of("actor_rollout_ref.actor.activation_memory_budget=1.5")
    assert msg == ("actor_rollout_ref.actor.activation_memory_budget=1.5 must be in (0, 1]: the share of "
                   "activations kept (1 keeps them all)")
    [msg] = problems_of("actor_rollout_ref.actor.activation_memory_budget=0")
    assert msg == "actor_rollout_ref.actor.activation_memory_budget=0.0 must be > 0"


def test_batch_size_not_divisible_by_mini_batch_suggests_divisors():
    problems = problems_of("data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    assert ("data.train_batch_size=6 is not divisible by actor_rollout_ref.actor.ppo_mini_batch_size=4: "
            "choose a mini-batch that divides it (1, 2, 3 or 6)") in problems[0]


def test_micro_batch_that_does_not_split_the_mini_batch_is_rejected():
    [msg] = problems_of("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    assert "does not split into micro-batches" in msg and "16" in msg


def test_group_estimators_need_more_than_one_sample_per_prompt():
    [msg] = problems_of("actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    assert "rollout.n must be >= 2" in msg


def test_every_problem_is_reported_at_once():
    assert len(problems_of("data.train_batch_size=x", "trainer.bogus=1", "algorithm.adv_estimator=nope")) == 3


def test_malformed_yaml_and_missing_file_are_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_override_without_equals_sign_is_explained():
    assert "must look like key.path=value" in problems_of("actor_rollout_ref.rollout.n")[0]


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(REPO / "configs/default.yaml", ["actor_rollout_ref.rollout.n=8"])
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_batch_plan_counts_prompts_responses_and_optimizer_steps():
    cfg = load_config(None, ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                             "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_epochs=2",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
    plan = batch_plan(cfg)
    assert (plan.prompts_per_step, plan.responses_per_step, plan.responses_per_mini_batch) == (8, 32, 8)
    assert plan.optimizer_steps_per_step == 8
    assert plan.micro_batches_per_mini_batch == 2


def test_every_field_has_help_text():
    assert all(meta["help"] for _, meta in field_specs().values())


def test_zero_or_negative_worker_counts_are_refused_without_crashing():
    problems = problems_of("trainer.n_gpus_per_node=0", "trainer.nnodes=-3")
    assert any("trainer.n_gpus_per_node=0 must be >= 1" in p for p in problems)
    assert any("trainer.nnodes=-3 must be >= 1" in p for p in problems)


# ---- the choices the algorithms and scorers define ----

def test_loss_agg_mode_choices_are_exactly_the_modes_agg_loss_knows():
    specs = field_specs()
    assert specs["actor_rollout_ref.actor.loss_agg_mode"][1]["choices"] == LOSS_AGG_MODES
    assert specs["critic.loss_agg_mode"][1]["choices"] == LOSS_AGG_MODES


def test_kl_loss_types_are_every_kl_estimator_and_the_penalty_in_reward_leaves_out_the_straight_through_ones():
    specs = field_specs()
    assert set(specs["actor_rollout_ref.actor.kl_loss_type"][1]["choices"]) == set(KL_TYPES)
    assert set(specs["algorithm.kl_penalty"][1]["choices"]) == {k for k in KL_TYPES if not k.endswith("+")}


def test_gsm8k_scorer_choices_are_the_rules_and_the_default_is_what_score_batch_uses_without_a_config():
    assert field_specs()["reward.gsm8k_scorer"][1]["choices"] == tuple(GSM8K_SCORERS)
    default = load_config(None).reward.gsm8k_scorer
    assert default == "verl" == inspect.signature(score_batch).parameters["gsm8k_scorer"].default


def test_a_straight_through_kl_type_is_a_valid_kl_loss_and_refused_as_an_in_reward_penalty():
    cfg = load_config(REPO / "configs/default.yaml", ["actor_rollout_ref.actor.kl_loss_type=k3+"])
    assert cfg.actor_rollout_ref.actor.kl_loss_type == "k3+"
    [msg] = problems_of("algorithm.kl_penalty=k3+")
    assert msg == "algorithm.kl_penalty='k3+' is not allowed; choose one of: kl, k1, mse, k2, low_var_kl, k3, abs"


def test_token_sum_and_a_loss_scale_factor_are_accepted_and_a_non_positive_factor_is_refused():
    cfg = load_config(REPO / "configs/default.yaml", ["actor_rollout_ref.actor.loss_agg_mode=token-sum",
                                                      "actor_rollout_ref.actor.loss_scale_factor=512",
                                                      "critic.loss_scale_factor=256"])
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "token-sum"
    assert (cfg.actor_rollout_ref.actor.loss_scale_factor, cfg.critic.loss_scale_factor) == (512.0, 256.0)
    assert load_config(None).actor_rollout_ref.actor.loss_scale_factor is None
    problems = problems_of("actor_rollout_ref.actor.loss_scale_factor=0", "critic.loss_scale_factor=-1")
    assert problems == ["actor_rollout_ref.actor.loss_scale_factor=0.0 must be > 0",
                        "critic.loss_scale_factor=-1.0 must be > 0"]


def test_an_unknown_gsm8k_scorer_names_the_key_the_value_and_the_rules():
    [msg] = problems_of("reward.gsm8k_scorer=strict")
    assert msg == "reward.gsm8k_scorer='strict' is not allowed; choose one of: verl, lenient"


@pytest.mark.parametrize(("path", "scorer"), [("configs/gsm8k_grpo.yaml", "lenient"),
                                              ("configs/recipes/gsm8k.yaml", "lenient"),
                                              ("configs/default.yaml", "verl")])
def test_the_gsm8k_preset_and_recipe_keep_the_partial_credit_they_were_tuned_with(path, scorer):
    assert load_config(REPO / path, validate=False).reward.gsm8k_scorer == scorer


def test_multi_turn_with_dynamic_sampling_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match="filter_groups .* does not run with actor_rollout_ref.rollout.multi_turn"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.enable=true", "algorithm.filter_groups.enable=true"])


def test_a_multi_turn_run_may_leave_the_whole_reward_to_its_environment():
    cfg = load_config(None, ["actor_rollout_ref.rollout.multi_turn.enable=true", "reward.rule_weight=0"])
    assert cfg.reward.rule_weight == 0
    with pytest.raises(ConfigError, match="leaves nothing to score"):
        load_config(None, ["reward.rule_weight=0"])


@pytest.mark.parametrize("overrides", [
    ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100"],
    ["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=100"],
    ["algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=100"],
])
def test_a_token_budget_below_the_longest_row_is_refused_naming_its_key(overrides):
    key = overrides[-1].split("=")[0]
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}=100 is less than the longest row") as error:
        load_config(None, ["data.max_prompt_length=64", "data.max_response_length=64", *overrides])
    assert str(error.value).count("is less than the longest row") == 1  # one message for the one mistake
    load_config(None, ["data.max_prompt_length=50", "data.max_response_length=50", *overrides])  # 100 holds one row


def test_a_gpu_share_is_a_part_of_one_gpu_for_a_run_of_one_worker_only():
    assert load_config(None, ["trainer.gpu_share=0.25"]).trainer.gpu_share == 0.25
    assert problems_of("trainer.gpu_share=0") == ["trainer.gpu_share=0.0 must be > 0"]
    assert problems_of("trainer.gpu_share=1.5") == [
        "trainer.gpu_share=1.5 must be in (0, 1]: a worker takes one GPU at most"]
    for second in ("trainer.n_gpus_per_node=2", "trainer.rollout_mode=async"):
        [msg] = problems_of("trainer.gpu_share=0.5", second)
        assert msg.startswith("trainer.gpu_share=0.5 shares a GPU between runs of one worker")
