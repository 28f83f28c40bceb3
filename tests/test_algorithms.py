"""Each algorithm a config can select trains end to end: two steps of the tiny model on the CPU, with the
metrics that say it did what its name promises."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import torch

from backend.core.config import ConfigError, load_config
from backend.core.runs import latest_checkpoint, list_dumps, read_metrics
from backend.engine.trainer import Trainer
from backend.rewards.scoring import score_batch

from .conftest import tiny_overrides

# Every test here starts a run, Ray, a worker, a server or a subprocess: make test-fast leaves them out.
pytestmark = pytest.mark.slow

ESTIMATORS = {
    "drgrpo": {"algorithm.adv_estimator": "drgrpo", "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm"},
    "reinforce_plus_plus": {"algorithm.adv_estimator": "reinforce_plus_plus",
                            "actor_rollout_ref.actor.use_kl_loss": False, "algorithm.use_kl_in_reward": True},
    "reinforce_plus_plus_baseline": {"algorithm.adv_estimator": "reinforce_plus_plus_baseline"},
    "gspo": {"actor_rollout_ref.actor.policy_loss.loss_mode": "gspo", "actor_rollout_ref.actor.clip_ratio_low": 3e-4,
             "actor_rollout_ref.actor.clip_ratio_high": 4e-4,
             "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"},
    "dapo": {"actor_rollout_ref.actor.clip_ratio_low": 0.2, "actor_rollout_ref.actor.clip_ratio_high": 0.28,
             "actor_rollout_ref.actor.use_kl_loss": False, "reward.overlong_buffer.enable": True,
             "reward.overlong_buffer.len": 4, "reward.overlong_buffer.penalty_factor": 1.0},
}


def train(run_dir, sample_sets, **extra) -> list[dict]:
    cfg = load_config(None, tiny_overrides(sample_sets, **{"data.val_files": "[]", **extra}))
    Trainer(cfg, run_dir, show_progress=False).train()
    return read_metrics(run_dir)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_each_group_algorithm_trains_two_steps_with_finite_metrics(tmp_path, sample_sets, name):
    lines = train(tmp_path / name, sample_sets, **ESTIMATORS[name])
    assert len(lines) == 2
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean"):
        assert math.isfinite(lines[-1][key]), key


def test_dapo_overlong_shaping_penalises_responses_in_the_last_tokens(tmp_path, sample_sets):
    # Every response of the tiny model runs to the 8-token limit: all of them are in the 4-token buffer.
    lines = train(tmp_path / "dapo", sample_sets, **ESTIMATORS["dapo"],
                  **{"actor_rollout_ref.rollout.ignore_eos": True})
    assert lines[-1]["reward/overlong_penalty/mean"] == pytest.approx(-1.0)
    assert lines[-1]["reward/overlong_penalty/frac"] == 1.0
    assert lines[-1]["critic/score/mean"] <= 0.0


def test_remax_scores_a_greedy_response_per_prompt_as_the_baseline(tmp_path, sample_sets):
    lines = train(tmp_path / "remax", sample_sets, **{"algorithm.adv_estimator": "remax"})
    assert len(lines) == 2 and "timing_s/gen_baseline" in lines[-1]
    assert 0.0 <= lines[-1]["reward/greedy_baseline/mean"] <= 1.0


def test_ppo_with_a_critic_warms_the_critic_up_then_trains_both_and_resumes_it(tmp_path, sample_sets):
    ppo = {"algorithm.adv_estimator": "gae", "algorithm.lam": 0.95, "trainer.critic_warmup": 1,
           "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
           "actor_rollout_ref.actor.use_kl_loss": False, "critic.optim.lr": 1e-3,
           "critic.ppo_micro_batch_size_per_gpu": 4, "trainer.save_freq": 1}
    (tmp_path / "ppo").mkdir()
    (tmp_path / "ppo" / "dump_next").touch()  # asked before step 1, which has no actor update to dump
    lines = train(tmp_path / "ppo", sample_sets, **ppo)
    first, second = lines
    assert "actor/pg_loss" not in first and "actor/pg_loss" in second  # step 1 is the critic's warm-up
    assert [d.name for d in list_dumps(tmp_path / "ppo")] == ["step_2"]
    for line in lines:
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm",
                    "critic/explained_variance", "critic/returns/mean", "critic/values/mean",
                    "actor/reward_kl_penalty"):
            assert math.isfinite(line[key]), key
    ckpt = latest_checkpoint(tmp_path / "ppo")
    assert (ckpt / "critic").is_dir()
    # Resuming restores the critic: one more step from step 2's checkpoint continues where it left off.
    cfg = load_config(None, tiny_overrides(sample_sets, **{
        "data.val_files": "[]", **ppo, "trainer.total_training_steps": 3, "trainer.resume_mode": "auto"}))
    Trainer(cfg, tmp_path / "ppo", show_progress=False).train()
    assert [m["step"] for m in read_metrics(tmp_path / "ppo")] == [1, 2, 3]


def test_a_critic_micro_batch_that_does_not_divide_the_mini_batch_is_refused(sample_sets):
    with pytest.raises(ConfigError, match="critic.ppo_micro_batch_size_per_gpu=3"):
        load_config(None, tiny_overrides(sample_sets, **{"algorithm.adv_estimator": "gae",
                                                         "critic.ppo_micro_batch_size_per_gpu": 3}))



SPREAD_ONLY_FOR_EVEN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Prompts with an odd answer score 0 for every response: their groups carry no signal.
    if int(float(ground_truth)) % 2:
        return 0.0
    return float(len(solution_str) % 2)
'''


def test_dapo_dynamic_sampling_keeps_only_groups_whose_scores_differ(tmp_path, sample_sets):
    reward = tmp_path / "spread.py"
    reward.write_text(SPREAD_ONLY_FOR_EVEN)
    lines = train(tmp_path / "dyn", sample_sets, **{
        "algorithm.filter_groups.enable": True, "algorithm.filter_groups.max_num_gen_batches": 6,
        "custom_reward_function.path": str(reward), "trainer.rollout_log_max": 64})
    for line in lines:
        assert 1 <= line["batch/dynamic_sampling_rounds"] <= 6
        assert 1 <= line["batch/kept_groups"] <= 2
        table = pq.read_table(tmp_path / "dyn" / "rollouts" / f"step_{line['step']:06d}.parquet").to_pandas()
        assert table["group"].nunique() == line["batch/kept_groups"]
        for _, group in table.groupby("group"):
            assert group["reward"].nunique() > 1  # every kept group can teach something
            assert all(int(float(g)) % 2 == 0 for g in group["ground_truth"])


REWARD_FUNCTIONS = '''
def brevity(data_source, solution_str, ground_truth, extra_info=None):
    return -len(solution_str) / 100


def has_digit(data_source, solution_str, ground_truth, extra_info=None):
    return float(any(c.isdigit() for c in solution_str))
'''


def test_several_reward_functions_are_summed_with_their_weights_and_each_is_logged(tmp_path, sample_sets):
    (tmp_path / "extra.py").write_text(REWARD_FUNCTIONS)
    lines = train(tmp_path / "multi", sample_sets, **{
        "reward.rule_weight": 0.5, "reward.functions": f"[{tmp_path}/extra.py:brevity, {tmp_path}/extra.py:has_digit]",
        "reward.weights": "[2.0, 0.25]", "trainer.total_training_steps": 1})
    assert "reward/brevity/mean" in lines[0] and "reward/has_digit/mean" in lines[0]
    table = pq.read_table(tmp_path / "multi" / "rollouts" / "step_000001.parquet").to_pandas()
    rule = score_batch(list(table["data_source"]), list(table["response"]), list(table["ground_truth"]))
    for (_, row), rule_score in zip(table.iterrows(), rule.scores, strict=True):
        brevity = -len(row["response"]) / 100
        digit = float(any(c.isdigit() for c in row["response"]))
        assert row["reward_brevity"] == pytest.approx(brevity) and row["reward_has_digit"] == digit
        assert row["reward"] == pytest.approx(0.5 * rule_score + 2.0 * brevity + 0.25 * digit)


def test_a_reward_model_alone_scores_each_response_as_the_model_does(tmp_path, sample_sets):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from backend.core.data import load_rows
    from backend.core.models import resolve_model
    from backend.engine.reward_model import load_reward_model, pair_texts

    rm_dir = tmp_path / "tiny-rm"
    source = resolve_model("tiny-qwen3")
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(source, num_labels=1).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(source).save_pretrained(rm_dir)
    lines = train(tmp_path / "rm", sample_sets, **{
        "reward_model.enable": True, "reward_model.model.path": str(rm_dir), "reward_model.weight": 2.0,
        "reward.rule_weight": 0, "trainer.total_training_steps": 1, "trainer.rollout_log_max": 64})
    assert math.isfinite(lines[0]["reward/reward_model/mean"])
    table = pq.read_table(tmp_path / "rm" / "rollouts" / "step_000001.parquet").to_pandas()
    model, tokenizer = load_reward_model(str(rm_dir), torch.device("cpu"), torch.float32)
    rows = load_rows(sample_sets["train"])  # the rollouts' index is the row's position in the train file
    texts = pair_texts(tokenizer, [list(rows[int(i)]["prompt"]) for i in table["index"]], list(table["response"]))
    with torch.no_grad():
        expected = [model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                    for t in texts]
    assert table["reward_reward_model"].tolist() == pytest.approx(expected, abs=1e-4)
    assert table["reward"].tolist() == pytest.approx([2 * e for e in expected], abs=2e-4)


def test_a_batch_smaller_than_a_mini_batch_is_one_smaller_optimizer_step_split_evenly_over_ranks():
    # DAPO's dynamic sampling may end its last round with fewer kept groups than a mini-batch holds; a
    # dry run of bench/learning_gpu.sh crashed on the empty update this used to make.
    from backend.engine.worker_group import update_shards

    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0], [1, 1], [1, 0]])
    batch = {"responses": torch.arange(12).view(6, 2), "response_mask": mask, "advantages": torch.arange(6.0)}
    shards = update_shards(batch, mini_rows=16, epochs=1, shuffle=False, world_size=2)
    assert [local for _, local, _ in shards] == [3, 3]
    assert shards[0][0]["advantages"].tolist() == [0, 1, 2] and shards[1][0]["advantages"].tolist() == [3, 4, 5]
    # what every rank's losses divide by: the whole step's valid tokens and non-empty responses
    assert shards[0][2] == shards[1][2] == [(8.0, 5.0)]
    full = update_shards(batch, mini_rows=2, epochs=2, shuffle=False, world_size=2)
    assert full[0][0]["advantages"].tolist() == [0, 2, 4, 0, 2, 4] and [lr for _, lr, _ in full] == [1, 1]
    # mini-batches {0, 1}, {2, 3}, {4, 5}, twice: 3, 2 and 3 tokens in 2, 1 and 2 responses
    assert full[1][2] == [(3.0, 2.0), (2.0, 1.0), (3.0, 2.0)] * 2
