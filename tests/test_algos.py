"""Hand-worked checks of backend.algos.

Every expected number below is worked out in the comments next to it. Padded positions hold huge
values (BIG), inf or NaN: if any of them leaked into a result the expected numbers would be far off.
"""

import math
import re

import pytest
import torch

from backend.algos import advantages, losses
from backend.algos.advantages import (
    _ADVANTAGE_ESTIMATORS,
    advantage_estimators,
    compute_advantage,
    get_advantage_fn,
    groups_with_signal,
    overlong_penalty,
    register_advantage,
)
from backend.algos.losses import (
    _POLICY_LOSSES,
    KL_TYPES,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_policy_loss,
    compute_policy_loss_gspo,
    compute_value_loss,
    entropy_from_logits,
    explained_variance,
    get_policy_loss_fn,
    kl_penalty,
    policy_losses,
    register_policy_loss,
)
from backend.algos.masked import masked_mean, masked_var, masked_whiten

BIG = 1e6
NAN = float("nan")
EPS = 1e-6  # compute_advantage's default epsilon
WHITEN_EPS = 1e-8  # masked_whiten's variance epsilon


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def assert_close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


# =====================================================================================================
# ---- masked helpers ----
# =====================================================================================================


def test_masked_mean_ignores_padding_overall_and_per_row():
    values = t([[1.0, 2.0, BIG], [3.0, BIG, BIG]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert_close(masked_mean(values, mask), 2.0)  # (1 + 2 + 3) / 3
    assert_close(masked_mean(values, mask, dim=-1), [1.5, 3.0])


def test_masked_mean_of_an_empty_row_is_zero_not_nan():
    values = t([[1.0, 3.0], [BIG, float("nan")]])
    mask = t([[1, 1], [0, 0]])
    assert_close(masked_mean(values, mask, dim=-1), [2.0, 0.0])
    assert_close(masked_mean(values, torch.zeros_like(mask)), 0.0)


def test_masked_var_is_unbiased_by_default_and_biased_on_request():
    values = t([[2.0, 4.0, BIG], [6.0, BIG, float("inf")]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # mean 4; squared deviations 4, 0, 4 -> unbiased 8/2 = 4, biased 8/3
    assert_close(masked_var(values, mask), 4.0)
    assert_close(masked_var(values, mask, unbiased=False), 8.0 / 3.0)


def test_masked_var_of_a_single_valid_entry_is_zero_not_nan():
    assert_close(masked_var(t([[5.0, BIG]]), t([[1, 0]])), 0.0)


def test_masked_whiten_standardises_valid_entries_and_zeroes_padding():
    values = t([[2.0, 4.0, BIG], [6.0, BIG, BIG]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # mean 4, unbiased std 2 -> (-1, 0, 1)
    s = 1 / math.sqrt(1 + WHITEN_EPS / 4)
    assert_close(masked_whiten(values, mask), [[-s, 0.0, 0.0], [s, 0.0, 0.0]])


def test_masked_whiten_without_mean_shift_only_rescales():
    values = t([[2.0, 4.0, BIG], [6.0, BIG, BIG]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # (v - 4) / 2 + 4 -> 3, 4, 5
    assert_close(masked_whiten(values, mask, shift_mean=False), [[3.0, 4.0, 0.0], [5.0, 0.0, 0.0]])


# =====================================================================================================
# ---- agg_loss ----
# =====================================================================================================

# seq 0 has 3 valid tokens, one after a masked-out position (sum 6, mean 2); seq 1 has 2 (sum 9, mean
# 4.5); T = 4.
AGG_LOSS = [[1.0, BIG, 2.0, 3.0], [4.0, 5.0, BIG, BIG]]
AGG_MASK = [[1, 0, 1, 1], [1, 1, 0, 0]]
AGG_EXPECTED = {
    "token-mean": 15.0 / 5.0,  # 3.0
    "token-sum": 15.0,
    "seq-mean-token-sum": (6.0 + 9.0) / 2.0,  # 7.5
    "seq-mean-token-mean": (2.0 + 4.5) / 2.0,  # 3.25
    "seq-mean-token-sum-norm": (6.0 + 9.0) / 2.0 / 4.0,  # 1.875: the row mean, divided by the width T
}


def test_loss_agg_modes_lists_exactly_the_five_modes():
    assert set(LOSS_AGG_MODES) == set(AGG_EXPECTED)


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_agg_loss_matches_hand_computed_value_on_sequences_of_different_lengths(mode):
    assert_close(agg_loss(t(AGG_LOSS), t(AGG_MASK), mode), AGG_EXPECTED[mode])


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_agg_loss_accepts_a_bool_mask_and_ignores_inf_and_nan_padding(mode):
    loss = t([[1.0, float("inf"), 2.0, 3.0], [4.0, 5.0, float("nan"), -float("inf")]])
    assert_close(agg_loss(loss, torch.tensor(AGG_MASK, dtype=torch.bool), mode), AGG_EXPECTED[mode])


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_agg_loss_skips_a_zero_length_sequence_without_nan(mode):
    loss = t([*AGG_LOSS, [BIG, BIG, BIG, BIG]])
    mask = t([*AGG_MASK, [0, 0, 0, 0]])
    assert_close(agg_loss(loss, mask, mode), AGG_EXPECTED[mode])


@pytest.mark.parametrize("mode", sorted(AGG_EXPECTED))
def test_agg_loss_of_an_all_padding_batch_is_zero_with_finite_gradient(mode):
    loss = t([[BIG, float("inf")], [float("nan"), 1.0]]).requires_grad_()
    out = agg_loss(loss, t([[0, 0], [0, 0]]), mode)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros_like(loss))


def test_agg_loss_token_mean_gradient_is_one_over_valid_token_count_and_zero_at_padding():
    loss = t(AGG_LOSS).requires_grad_()
    agg_loss(loss, t(AGG_MASK), "token-mean").backward()
    assert_close(loss.grad, [[0.2, 0.0, 0.2, 0.2], [0.2, 0.2, 0.0, 0.0]])


def test_seq_mean_token_sum_norm_divides_by_non_empty_rows_and_the_padded_width():
    # Three rows, one empty: (6 + 9) / 2 non-empty rows / width 4, not 15 / 4 (every row's sum over T).
    loss = t([*AGG_LOSS, [BIG, BIG, BIG, BIG]])
    mask = t([*AGG_MASK, [0, 0, 0, 0]])
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), 15.0 / 2 / 4)


def test_seq_mean_token_sum_norm_divides_by_the_loss_scale_factor_when_given():
    out = agg_loss(t(AGG_LOSS), t(AGG_MASK), "seq-mean-token-sum-norm", loss_scale_factor=3.0)
    assert_close(out, 15.0 / 2 / 3)  # 2.5


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_loss_scale_factor_changes_only_seq_mean_token_sum_norm(mode):
    out = agg_loss(t(AGG_LOSS), t(AGG_MASK), mode, loss_scale_factor=3.0)
    assert_close(out, AGG_EXPECTED[mode])


@pytest.mark.parametrize("factor", [0.0, -1.0])
def test_agg_loss_rejects_a_non_positive_loss_scale_factor(factor):
    with pytest.raises(ValueError, match=f"loss_scale_factor={factor} must be > 0"):
        agg_loss(t(AGG_LOSS), t(AGG_MASK), "seq-mean-token-sum-norm", loss_scale_factor=factor)


def test_agg_loss_unknown_mode_raises_and_lists_known_modes():
    known = "token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"
    with pytest.raises(ValueError, match=known):
        agg_loss(t(AGG_LOSS), t(AGG_MASK), "sum")


# A mini-batch of four rows, T = 4:
#   row 0: 3 tokens (1, 2, 3)      sum 6   mean 2
#   row 1: 2 tokens, a gap between sum 10  mean 5
#   row 2: empty
#   row 3: 4 tokens (2, 2, 2, 2)   sum 8   mean 2
# 9 tokens, total 24, 3 non-empty rows. Split into micro-batches rows {0, 1} (5 tokens) and {2, 3}
# (4 tokens), or over two ranks with one row a micro-batch.
MINI_LOSS = [[1.0, 2.0, 3.0, BIG], [4.0, BIG, 6.0, BIG], [BIG, BIG, BIG, BIG], [2.0, 2.0, 2.0, 2.0]]
MINI_MASK = [[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
MINI_EXPECTED = {
    "token-mean": 24.0 / 9.0,
    "token-sum": 24.0,
    "seq-mean-token-sum": 24.0 / 3.0,  # 8
    "seq-mean-token-mean": (2.0 + 5.0 + 2.0) / 3.0,  # 3
    "seq-mean-token-sum-norm": 24.0 / 3.0 / 4.0,  # 2
}
GLOBAL_COUNTS = {"num_tokens": 9, "num_seqs": 3}


@pytest.mark.parametrize("mode", sorted(MINI_EXPECTED))
def test_agg_loss_of_the_whole_mini_batch_matches_the_hand_computed_value(mode):
    assert_close(agg_loss(t(MINI_LOSS), t(MINI_MASK), mode), MINI_EXPECTED[mode])


@pytest.mark.parametrize("mode", sorted(MINI_EXPECTED))
def test_micro_batches_with_global_counts_add_up_to_the_mini_batch_loss(mode):
    loss, mask = t(MINI_LOSS), t(MINI_MASK)
    parts = [agg_loss(loss[rows], mask[rows], mode, **GLOBAL_COUNTS) for rows in (slice(0, 2), slice(2, 4))]
    assert_close(parts[0] + parts[1], MINI_EXPECTED[mode])


@pytest.mark.parametrize("mode", sorted(MINI_EXPECTED))
def test_micro_batches_on_two_ranks_with_global_counts_add_up_to_the_mini_batch_loss(mode):
    # Rank 0 holds rows 0 and 1, rank 1 rows 2 and 3, one row a micro-batch; the engine's all-reduce of the
    # gradients adds the ranks' parts (FSDP averages, so it multiplies by the world size first).
    loss, mask = t(MINI_LOSS), t(MINI_MASK)
    per_rank = [sum(agg_loss(loss[i:i + 1], mask[i:i + 1], mode, **GLOBAL_COUNTS) for i in rows)
                for rows in ((0, 1), (2, 3))]
    assert_close(per_rank[0] + per_rank[1], MINI_EXPECTED[mode])


def test_token_mean_with_global_count_weighs_every_token_alike_and_local_means_do_not():
    loss, mask = t(MINI_LOSS), t(MINI_MASK)
    # Global: 16/9 + 8/9 = 24/9; each token weighs 1/9.
    first = agg_loss(loss[:2], mask[:2], "token-mean", num_tokens=9)
    second = agg_loss(loss[2:], mask[2:], "token-mean", num_tokens=9)
    assert_close(first, 16.0 / 9.0)
    assert_close(second, 8.0 / 9.0)
    # Local token-means weighted by each micro-batch's share of rows: 0.5 * 16/5 + 0.5 * 8/4 = 2.6, so a
    # token of the 4-token micro-batch weighs 1/8 and one of the 5-token micro-batch 1/10.
    by_rows = 0.5 * agg_loss(loss[:2], mask[:2], "token-mean") + 0.5 * agg_loss(loss[2:], mask[2:], "token-mean")
    assert_close(by_rows, 2.6)
    assert abs(by_rows.item() - 24.0 / 9.0) > 0.05


def test_agg_loss_accepts_global_counts_as_tensors():
    loss, mask = t(MINI_LOSS), t(MINI_MASK)
    out = agg_loss(loss[:2], mask[:2], "seq-mean-token-mean", num_seqs=torch.tensor(3))
    assert_close(out, (2.0 + 5.0) / 3.0)


# =====================================================================================================
# ---- kl_penalty ----
# =====================================================================================================

# logp - ref = (0.5, -1.0, 2.0); r = ref - logp = (-0.5, 1.0, -2.0)
KL_LOGP = [[-0.5, -2.0, -1.0]]
KL_REF = [[-1.0, -1.0, -3.0]]
KL_EXPECTED = {
    "k1": [[0.5, -1.0, 2.0]],
    "k2": [[0.125, 0.5, 2.0]],  # 0.5 * d^2
    # exp(r) - r - 1: exp(-0.5) - 0.5 = 0.1065307, e - 2 = 0.7182818, exp(-2) + 1 = 1.1353353
    "k3": [[0.10653066, 0.71828183, 1.13533528]],
    "abs": [[0.5, 1.0, 2.0]],
}
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
# Straight-through: the value of the named base, the gradient of k2 (logp - ref = 0.5, -1.0, 2.0).
KL_STRAIGHT_THROUGH = {"k1+": "k1", "kl+": "k1", "k3+": "k3", "low_var_kl+": "k3"}


def test_kl_types_lists_every_name_alias_and_straight_through_variant():
    assert set(KL_TYPES) == set(KL_EXPECTED) | set(KL_ALIASES) | set(KL_STRAIGHT_THROUGH)


@pytest.mark.parametrize("kl_type", sorted(KL_EXPECTED))
def test_kl_penalty_matches_hand_computed_values(kl_type):
    assert_close(kl_penalty(t(KL_LOGP), t(KL_REF), kl_type), KL_EXPECTED[kl_type])


@pytest.mark.parametrize(("alias", "name"), sorted(KL_ALIASES.items()))
def test_kl_penalty_alias_gives_the_same_values_as_its_name(alias, name):
    assert_close(kl_penalty(t(KL_LOGP), t(KL_REF), alias), KL_EXPECTED[name])


@pytest.mark.parametrize(("kl_type", "base"), sorted(KL_STRAIGHT_THROUGH.items()))
def test_straight_through_kl_has_the_base_value_and_the_gradient_of_k2(kl_type, base):
    logp = t(KL_LOGP).requires_grad_()
    kl = kl_penalty(logp, t(KL_REF), kl_type)
    assert_close(kl.detach(), KL_EXPECTED[base])
    kl.sum().backward()
    assert_close(logp.grad, [[0.5, -1.0, 2.0]])  # d(0.5 (logp - ref)^2) / d logp = logp - ref


def test_k3_plus_keeps_the_clamped_value_and_the_unclamped_k2_gradient():
    # r = ref - logp = -15: k3 = exp(-15) + 14, clamped to 10; k2's gradient is logp - ref = 15.
    logp = t([[0.0]]).requires_grad_()
    kl = kl_penalty(logp, t([[-15.0]]), "k3+")
    kl.sum().backward()
    assert_close(kl.detach(), [[10.0]])
    assert_close(logp.grad, [[15.0]])


@pytest.mark.parametrize("kl_type", ["k2+", "mse+", "abs+"])
def test_kl_penalty_refuses_a_plus_on_k2_mse_and_abs(kl_type):
    with pytest.raises(ValueError, match=re.escape(f"unknown kl_type '{kl_type}'")):
        kl_penalty(t(KL_LOGP), t(KL_REF), kl_type)


def test_k3_kl_is_clamped_to_ten_with_finite_gradient():
    # r = -15 -> exp(-15) + 14 = 14.0000003; r = 15 -> 3.27e6; r = 100 -> overflow: all clamp to 10
    logp = t([[0.0, -15.0, -100.0, 0.0]]).requires_grad_()
    ref = t([[-15.0, 0.0, 0.0, -1.0]])
    kl = kl_penalty(logp, ref, "k3")
    assert_close(kl[0, :3], [10.0, 10.0, 10.0])
    assert_close(kl[0, 3], math.exp(-1) + 1 - 1)  # r = -1: not clamped
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert_close(logp.grad[0, :3], [0.0, 0.0, 0.0])  # no gradient through the clamp


def test_kl_penalty_unknown_type_raises_and_lists_known_types():
    with pytest.raises(ValueError, match=r"k1, kl, k2, mse, k3, low_var_kl, abs, k1\+, kl\+, k3\+, low_var_kl\+"):
        kl_penalty(t(KL_LOGP), t(KL_REF), "k4")


# =====================================================================================================
# ---- apply_kl_penalty and KL controllers ----
# =====================================================================================================


def test_apply_kl_penalty_subtracts_coef_times_kl_on_valid_tokens_only():
    scores = t([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    logp = t([[-1.0, -1.0, -1.0, 50.0], [-2.0, -1.0, 50.0, 50.0]])
    ref = t([[-1.5, -0.5, -1.0, -50.0], [-1.0, -1.0, -50.0, -50.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    # |logp - ref| = (0.5, 0.5, 0) and (1, 0); coef 0.1
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kl_type="abs")
    assert_close(rewards, [[-0.05, -0.05, 1.0, 0.0], [-0.1, 2.0, 0.0, 0.0]])
    # per-sequence mean KL: 1/3 and 1/2 -> (1/3 + 1/2) / 2 = 5/12
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(5.0 / 12.0)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert all(isinstance(v, float) for v in metrics.values())


def test_fixed_kl_controller_never_changes_its_value():
    ctl = FixedKLController(kl_coef=0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05


@pytest.mark.parametrize(
    ("current_kl", "n_steps", "horizon", "expected"),
    [
        (9.0, 256, 10000, 0.1 * (1 + 0.2 * 256 / 10000)),  # error 0.5 clipped to 0.2 -> 0.100512
        (3.0, 256, 10000, 0.1 * (1 - 0.2 * 256 / 10000)),  # error -0.5 clipped to -0.2 -> 0.099488
        (6.6, 100, 1000, 0.1 * 1.01),  # error 0.1 not clipped: 1 + 0.1 * 100 / 1000
        (6.0, 100, 1000, 0.1),  # on target: unchanged
    ],
)
def test_adaptive_kl_controller_follows_ziegler_update(current_kl, n_steps, horizon, expected):
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=horizon)
    ctl.update(current_kl=current_kl, n_steps=n_steps)
    assert ctl.value == pytest.approx(expected)


def test_adaptive_kl_controller_rejects_a_non_positive_target():
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=0.0, horizon=1000)


# =====================================================================================================
# ---- DAPO reward shaping and dynamic sampling ----
# =====================================================================================================


def test_overlong_penalty_is_zero_before_the_buffer_then_ramps_to_minus_the_factor():
    # L = 20, B = 8: no penalty up to 12, then -(len - 12) / 8; 25 is past the limit and stays at -1
    lengths = torch.tensor([5, 12, 14, 16, 20, 25])
    assert_close(overlong_penalty(lengths, 20, 8, 1.0), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert_close(overlong_penalty(lengths, 20, 8, 0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])


def test_overlong_penalty_with_the_buffer_as_long_as_the_limit_penalises_from_the_first_token():
    assert_close(overlong_penalty(torch.tensor([0, 1, 4]), 4, 4, 2.0), [0.0, -0.5, -2.0])


@pytest.mark.parametrize(
    ("max_len", "buffer", "factor", "match"),
    [(20, 0, 1.0, "buffer_length=0"), (20, 21, 1.0, "buffer_length=21"), (20, 8, -1.0, "penalty_factor")],
)
def test_overlong_penalty_rejects_a_bad_buffer_or_factor(max_len, buffer, factor, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(torch.tensor([10]), max_len, buffer, factor)


def test_groups_with_signal_keeps_only_groups_whose_scores_differ():
    # group 7: (1, 0) differ; group 3: (1, 1) equal; group 9: (0.5, 0.5) equal; group 4: one response
    group_ids = torch.tensor([7, 3, 7, 9, 3, 4, 9])
    scores = t([1.0, 1.0, 0.0, 0.5, 1.0, 0.3, 0.5])
    assert groups_with_signal(scores, group_ids).tolist() == [True, False, True, False, False, False, False]


def test_groups_with_signal_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="group_ids"):
        groups_with_signal(t([1.0, 0.0, 1.0]), torch.tensor([1, 1]))


# =====================================================================================================
# ---- advantage estimators ----
# =====================================================================================================

# Five responses, T = 3, group ids unordered and non-contiguous.
#   seq  group  valid  score
#   0    7      2      1.0
#   1    3      3      0.0
#   2    7      3      0.25 - 0.25 + 0 = 0.0
#   3    3      1      1.0
#   4    7      2      0.5
# group 7: scores (1, 0, 0.5): mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
# group 3: scores (0, 1):      mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
REWARDS = [
    [0.0, 1.0, BIG],
    [0.0, 0.0, 0.0],
    [0.25, -0.25, 0.0],
    [1.0, BIG, BIG],
    [0.0, 0.5, BIG],
]
MASK = [[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
GROUP_IDS = [7, 3, 7, 3, 7]
STD3 = math.sqrt(0.5)


def group_batch(group_ids=GROUP_IDS) -> dict:
    return {
        "token_level_rewards": t(REWARDS),
        "response_mask": t(MASK),
        "group_ids": torch.tensor(group_ids, dtype=torch.long),
    }


def test_advantage_estimators_lists_all_seven_builtins():
    assert advantage_estimators() == sorted(
        ["grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae", "remax"]
    )


def test_grpo_advantage_divides_centered_score_by_group_std_on_valid_tokens():
    adv, ret = compute_advantage("grpo", **group_batch())
    a7, a3 = 0.5 / (0.5 + EPS), 0.5 / (STD3 + EPS)
    expected = [[a7, a7, 0.0], [-a3, -a3, -a3], [-a7, -a7, -a7], [a3, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert_close(adv, expected)
    assert_close(ret, expected)


def test_grpo_advantage_without_std_normalisation_is_score_minus_group_mean():
    adv, _ = compute_advantage("grpo", **group_batch(), norm_adv_by_std=False)
    assert_close(adv, [[0.5, 0.5, 0.0], [-0.5] * 3, [-0.5] * 3, [0.5, 0.0, 0.0], [0.0] * 3])


def test_grpo_advantage_does_not_depend_on_the_values_of_group_ids():
    relabelled = [-5, 100, -5, 100, -5]
    original, _ = compute_advantage("grpo", **group_batch())
    renamed, _ = compute_advantage("grpo", **group_batch(relabelled))
    assert torch.equal(original, renamed)


def test_grpo_advantage_is_zero_when_all_group_rewards_are_equal():
    batch = {
        "token_level_rewards": t([[0.0, 1.0], [1.0, BIG], [0.0, 1.0]]),
        "response_mask": t([[1, 1], [1, 0], [1, 1]]),
        "group_ids": torch.tensor([2, 2, 2]),
    }
    adv, _ = compute_advantage("grpo", **batch)
    assert torch.equal(adv, torch.zeros(3, 2))


def test_grpo_advantage_of_a_group_of_one_is_its_score_over_one_plus_eps():
    # group 4 has one response: mean 0, std 1 (as verl) -> 0.7 / (1 + eps); group 9: (1, 0) -> +-0.5/sqrt(0.5)
    batch = {
        "token_level_rewards": t([[0.0, 0.7, BIG], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]),
        "response_mask": t([[1, 1, 0], [1, 1, 1], [1, 1, 1]]),
        "group_ids": torch.tensor([4, 9, 9]),
    }
    adv, _ = compute_advantage("grpo", **batch)
    a = 0.5 / (STD3 + EPS)
    assert_close(adv, [[0.7 / (1 + EPS)] * 2 + [0.0], [a] * 3, [-a] * 3])


def test_grpo_advantage_of_a_zero_length_response_is_zero_without_nan():
    batch = {
        "token_level_rewards": t([[1.0, BIG], [BIG, BIG], [0.0, 0.0]]),
        "response_mask": t([[1, 0], [0, 0], [1, 1]]),
        "group_ids": torch.tensor([1, 1, 1]),
    }
    adv, _ = compute_advantage("grpo", **batch)
    # scores (1, 0, 0): mean 1/3, std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3)
    std = math.sqrt(1.0 / 3.0)
    assert_close(adv, [[(2 / 3) / (std + EPS), 0.0], [0.0, 0.0], [(-1 / 3) / (std + EPS)] * 2])


def test_drgrpo_advantage_is_score_minus_group_mean_even_when_asked_to_normalise():
    adv, ret = compute_advantage("drgrpo", **group_batch(), norm_adv_by_std=True)
    expected = [[0.5, 0.5, 0.0], [-0.5] * 3, [-0.5] * 3, [0.5, 0.0, 0.0], [0.0] * 3]
    assert_close(adv, expected)
    assert_close(ret, expected)


def test_rloo_advantage_is_score_minus_mean_of_the_other_responses():
    adv, ret = compute_advantage("rloo", **group_batch())
    # group 7: 1 - (0 + 0.5)/2 = 0.75, 0 - (1 + 0.5)/2 = -0.75, 0.5 - (1 + 0)/2 = 0; group 3: 0 - 1, 1 - 0
    expected = [[0.75, 0.75, 0.0], [-1.0] * 3, [-0.75] * 3, [1.0, 0.0, 0.0], [0.0] * 3]
    assert_close(adv, expected)
    assert_close(ret, expected)


def test_rloo_advantage_of_a_group_of_one_keeps_its_score_as_verls_default_rloo():
    batch = {
        "token_level_rewards": t([[0.0, 0.7], [0.0, 1.0], [2.0, BIG]]),
        "response_mask": t([[1, 1], [1, 1], [1, 0]]),
        "group_ids": torch.tensor([4, 9, 9]),
    }
    adv, _ = compute_advantage("rloo", **batch)
    # group 4 alone: no other response, baseline 0, A = 0.7; group 9: 1 - 2, 2 - 1
    assert_close(adv, [[0.7, 0.7], [-1.0, -1.0], [1.0, 0.0]])


def test_reinforce_plus_plus_discounts_returns_to_go_then_whitens_over_the_batch():
    batch = {
        "token_level_rewards": t([[0.0, BIG, 0.0, 1.0], [0.0, 2.0, BIG, BIG], [BIG, BIG, BIG, BIG]]),
        "response_mask": t([[1, 0, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]),
        "group_ids": torch.tensor([0, 1, 2]),
    }
    adv, ret = compute_advantage("reinforce_plus_plus", **batch, gamma=0.5)
    # row 0, gamma 0.5 once per valid token: t3 1, t2 0 + 0.5 * 1 = 0.5, t1 masked (return carried, its
    # own 0), t0 0 + 0.5 * 0.5 = 0.25; row 1: (1, 2); row 2 is empty
    assert_close(ret, [[0.25, 0.0, 0.5, 1.0], [1.0, 2.0, 0.0, 0.0], [0.0] * 4])
    # valid returns 0.25 0.5 1 1 2: mean 4.75/5 = 0.95; deviations -0.7 -0.45 0.05 0.05 1.05; sum sq 1.8
    # -> unbiased var 0.45
    s = math.sqrt(0.45 + WHITEN_EPS)
    assert_close(adv, [[-0.7 / s, 0.0, -0.45 / s, 0.05 / s], [0.05 / s, 1.05 / s, 0.0, 0.0], [0.0] * 4])


def test_reinforce_plus_plus_carries_the_return_through_a_masked_position_without_discounting_it():
    batch = {
        "token_level_rewards": t([[0.0, 0.0, 1.0], [1.0, BIG, 1.0]]),
        "response_mask": t([[1, 0, 1], [1, 0, 1]]),
        "group_ids": torch.tensor([0, 1]),
    }
    _, ret = compute_advantage("reinforce_plus_plus", **batch, gamma=0.5)
    # row 0: t2 1, t1 skipped, t0 0 + 0.5 * 1 = 0.5 (discounted once, not twice: not 0.25);
    # row 1: t2 1, t0 1 + 0.5 * 1 = 1.5 (restarting at the gap would give 1)
    assert_close(ret, [[0.5, 0.0, 1.0], [1.5, 0.0, 1.0]])


def test_reinforce_plus_plus_baseline_whitens_group_centered_scores_over_the_batch():
    batch = {
        "token_level_rewards": t([[0.0, 1.0], [2.0, BIG], [0.0, 0.0], [0.0, BIG]]),
        "response_mask": t([[1, 1], [1, 0], [1, 1], [1, 0]]),
        "group_ids": torch.tensor([5, 9, 5, 9]),
    }
    adv, ret = compute_advantage("reinforce_plus_plus_baseline", **batch)
    # group 5: (1, 0) -> +-0.5; group 9: (2, 0) -> +-1. Tokens 0.5 0.5 1 -0.5 -0.5 -1: mean 0,
    # unbiased var (4 * 0.25 + 1 + 1) / 5 = 0.6
    s = math.sqrt(0.6 + WHITEN_EPS)
    expected = [[0.5 / s, 0.5 / s], [1.0 / s, 0.0], [-0.5 / s, -0.5 / s], [-1.0 / s, 0.0]]
    assert_close(adv, expected)
    assert_close(ret, expected)


GAE_REWARDS = [[0.0, 0.0, 1.0, BIG], [0.0, 2.0, BIG, BIG]]
GAE_VALUES = [[0.5, 0.2, -0.3, BIG], [1.0, 0.4, BIG, BIG]]
GAE_MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]


def gae_batch() -> dict:
    return {
        "token_level_rewards": t(GAE_REWARDS),
        "response_mask": t(GAE_MASK),
        "group_ids": torch.tensor([0, 1]),
        "values": t(GAE_VALUES),
    }


def test_gae_with_gamma_and_lambda_one_gives_returns_to_go_and_whitened_returns_minus_values():
    adv, ret = compute_advantage("gae", **gae_batch(), gamma=1.0, lam=1.0)
    # returns-to-go: (1, 1, 1) and (2, 2), whatever the values
    assert_close(ret, [[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    # unwhitened A = G - V: (0.5, 0.8, 1.3), (1.0, 1.6); mean 1.04;
    # deviations -0.54 -0.24 0.26 -0.04 0.56; sum sq 0.732 -> unbiased var 0.183
    s = math.sqrt(0.183 + WHITEN_EPS)
    assert_close(adv, [[-0.54 / s, -0.24 / s, 0.26 / s, 0.0], [-0.04 / s, 0.56 / s, 0.0, 0.0]])


def test_gae_returns_match_hand_recursion_with_gamma_and_lambda_one_half():
    _, ret = compute_advantage("gae", **gae_batch(), gamma=0.5, lam=0.5)
    # seq 0: d2 = 1 + 0.3 = 1.3, A2 = 1.3
    #        d1 = 0.5 * -0.3 - 0.2 = -0.35, A1 = -0.35 + 0.25 * 1.3 = -0.025
    #        d0 = 0.5 * 0.2 - 0.5 = -0.4,   A0 = -0.4 + 0.25 * -0.025 = -0.40625
    # seq 1: d1 = 2 - 0.4 = 1.6, A1 = 1.6; d0 = 0.5 * 0.4 - 1 = -0.8, A0 = -0.8 + 0.25 * 1.6 = -0.4
    # returns = A + V
    assert_close(ret, [[0.09375, 0.175, 1.0, 0.0], [0.6, 2.0, 0.0, 0.0]])


def test_gae_skips_a_masked_position_inside_the_response():
    batch = {
        "token_level_rewards": t([[0.0, BIG, 1.0]]),
        "response_mask": t([[1, 0, 1]]),
        "group_ids": torch.tensor([0]),
        "values": t([[0.5, BIG, 0.2]]),
    }
    _, ret = compute_advantage("gae", **batch, gamma=0.5, lam=1.0)
    # A2 = 1 - 0.2 = 0.8; t=0 bootstraps from V2 one step away: d0 = 0.5 * 0.2 - 0.5 = -0.4,
    # A0 = -0.4 + 0.5 * 0.8 = 0 -> return 0.5 (a padded step counted as a step would give 0.25)
    assert_close(ret, [[0.5, 0.0, 1.0]])


def test_gae_without_values_raises():
    batch = gae_batch()
    del batch["values"]
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", **batch)


def test_remax_advantage_is_return_to_go_minus_the_greedy_baseline():
    batch = {
        "token_level_rewards": t([[0.0, 0.5, 1.0, BIG], [2.0, BIG, float("nan"), BIG], [1.0, -1.0, 0.0, 0.5]]),
        "response_mask": t([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]),
        "group_ids": torch.tensor([0, 1, 2]),
        "reward_baselines": t([0.5, 3.0, 1.0]),
    }
    adv, ret = compute_advantage("remax", **batch)
    # returns-to-go: (1.5, 1.5, 1), (2), (0.5, -0.5, 0.5, 0.5); minus baselines 0.5, 3, 1
    assert_close(ret, [[1.5, 1.5, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.5, -0.5, 0.5, 0.5]])
    assert_close(adv, [[1.0, 1.0, 0.5, 0.0], [-1.0, 0.0, 0.0, 0.0], [-0.5, -1.5, -0.5, -0.5]])


def test_remax_without_reward_baselines_raises():
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", **group_batch())


BUILTIN_ESTIMATORS = [
    "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae", "remax"
]


@pytest.mark.parametrize("name", BUILTIN_ESTIMATORS)
def test_every_estimator_is_finite_and_zero_at_padding_and_detached(name):
    rewards = t([[1.0, float("inf"), BIG], [0.0, 2.0, float("nan")], [0.5, 0.5, 0.5]]).requires_grad_()
    values = t([[0.1, float("nan"), BIG], [0.2, 0.3, float("inf")], [0.0, 0.1, 0.2]])
    mask = t([[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    group_ids = torch.tensor([3, 3, 8])
    adv, ret = compute_advantage(
        name, token_level_rewards=rewards, response_mask=mask, group_ids=group_ids, values=values,
        reward_baselines=t([0.5, 1.0, 0.0]),
    )
    for out in (adv, ret):
        assert torch.isfinite(out).all()
        assert torch.equal(out[mask == 0], torch.zeros(int((mask == 0).sum())))
        assert not out.requires_grad


def test_unknown_advantage_estimator_raises_and_lists_known_names_sorted():
    known = "drgrpo, gae, grpo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo"
    with pytest.raises(ValueError, match=known):
        get_advantage_fn("ppo")
    with pytest.raises(ValueError, match="known"):
        compute_advantage("ppo", **group_batch())


def test_compute_advantage_passes_an_estimator_only_the_parameters_it_declares(monkeypatch):
    monkeypatch.setattr(advantages, "_ADVANTAGE_ESTIMATORS", dict(_ADVANTAGE_ESTIMATORS))
    received = {}

    @register_advantage("scaled")
    def scaled(token_level_rewards, gamma):
        received.update(token_level_rewards=token_level_rewards, gamma=gamma)
        return token_level_rewards * gamma, token_level_rewards

    adv, _ = compute_advantage("scaled", **group_batch(), gamma=2.0, lam=0.3)
    assert set(received) == {"token_level_rewards", "gamma"}
    assert received["gamma"] == 2.0
    assert_close(adv[0], [0.0, 2.0, 0.0])  # padding (BIG * 2) masked by the dispatcher
    assert "scaled" in advantage_estimators()


def test_compute_advantage_passes_everything_to_an_estimator_with_var_keywords(monkeypatch):
    monkeypatch.setattr(advantages, "_ADVANTAGE_ESTIMATORS", dict(_ADVANTAGE_ESTIMATORS))
    received = {}

    @register_advantage("greedy")
    def greedy(**kwargs):
        received.update(kwargs)
        return kwargs["token_level_rewards"], kwargs["token_level_rewards"]

    compute_advantage("greedy", **group_batch())
    assert set(received) == {
        "token_level_rewards",
        "response_mask",
        "group_ids",
        "values",
        "reward_baselines",
        "gamma",
        "lam",
        "epsilon",
        "norm_adv_by_std",
    }


def test_registering_an_advantage_name_twice_raises(monkeypatch):
    monkeypatch.setattr(advantages, "_ADVANTAGE_ESTIMATORS", dict(_ADVANTAGE_ESTIMATORS))
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda token_level_rewards: (token_level_rewards, token_level_rewards))


def test_registering_an_estimator_that_needs_an_unknown_input_raises(monkeypatch):
    monkeypatch.setattr(advantages, "_ADVANTAGE_ESTIMATORS", dict(_ADVANTAGE_ESTIMATORS))
    with pytest.raises(TypeError, match="prompt_lengths"):
        register_advantage("needs_lengths")(lambda token_level_rewards, prompt_lengths: None)


# =====================================================================================================
# ---- policy loss ----
# =====================================================================================================


def policy_batch(ratios, advantages, mask):
    """old log-probs 0, current log-probs log(ratio); padded entries get wild log-probs."""
    mask = t(mask)
    ratios = t(ratios)
    log_probs = torch.where(mask.bool(), ratios.log(), t(50.0))
    old_log_probs = torch.where(mask.bool(), t(0.0), t(-50.0))
    return old_log_probs, log_probs, t(advantages), mask


# seq 0, A = +1: ratio 1.5 -> clipped to 1.2, loss -1.2 (clip active);
#                ratio 0.5 -> -0.5 vs -0.8, keeps -0.5 (no clip)
# seq 1, A = -1: ratio 4.0 -> max(4, 1.2) = 4, dual clip min(4, 3) = 3 (dual clip active);
#                ratio 0.5 -> max(0.5, 0.8) = 0.8 (clip active)
PPO = policy_batch(
    ratios=[[1.5, 0.5, 1.0], [4.0, 0.5, 1.0]],
    advantages=[[1.0, 1.0, BIG], [-1.0, -1.0, -BIG]],
    mask=[[1, 1, 0], [1, 1, 0]],
)


def test_policy_loss_clips_the_ratio_and_dual_clips_negative_advantages():
    loss, metrics = compute_policy_loss(*PPO)
    assert_close(loss, (-1.2 - 0.5 + 3.0 + 0.8) / 4)  # 0.525
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 4)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 4)
    # mean(old - logp) = -(ln 1.5 + ln 0.5 + ln 4 + ln 0.5) / 4 = -ln(1.5) / 4
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(1.5) / 4)
    assert all(v.shape == () and not v.requires_grad for v in metrics.values())


def test_policy_loss_dual_clip_is_inactive_when_clip_ratio_c_exceeds_the_ratio():
    loss, metrics = compute_policy_loss(*PPO, clip_ratio_c=10.0)
    assert_close(loss, (-1.2 - 0.5 + 4.0 + 0.8) / 4)  # 0.775
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_policy_loss_uses_asymmetric_clip_ratios():
    batch = policy_batch(
        ratios=[[1.5, 1.25], [0.8, 0.95]], advantages=[[1.0, 1.0], [-1.0, -1.0]], mask=[[1, 1], [1, 1]]
    )
    # range [0.9, 1.3]: 1.5 -> 1.3 (-1.3); 1.25 kept (-1.25); 0.8 -> max(0.8, 0.9) = 0.9; 0.95 kept (0.95)
    loss, metrics = compute_policy_loss(*batch, clip_ratio_low=0.1, clip_ratio_high=0.3)
    assert_close(loss, (-1.3 - 1.25 + 0.9 + 0.95) / 4)  # -0.175
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 4)


def test_policy_loss_passes_the_aggregation_mode_through():
    loss, _ = compute_policy_loss(*PPO, loss_agg_mode="seq-mean-token-sum")
    assert_close(loss, ((-1.2 - 0.5) + (3.0 + 0.8)) / 2)  # 1.05


def test_policy_loss_passes_the_global_counts_and_the_scale_factor_to_agg_loss():
    # Per-token losses (-1.2, -0.5) and (3.0, 0.8): sum 2.1 over 4 tokens of 2 rows, width T = 3.
    loss, _ = compute_policy_loss(*PPO, num_tokens=7)
    assert_close(loss, 2.1 / 7)
    loss, _ = compute_policy_loss(*PPO, loss_agg_mode="seq-mean-token-sum", num_seqs=5)
    assert_close(loss, 2.1 / 5)
    loss, _ = compute_policy_loss(*PPO, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=2.0)
    assert_close(loss, 2.1 / 2 / 2)  # the default factor would be T = 3: 2.1 / 2 / 3


def test_gspo_loss_passes_the_global_counts_to_agg_loss():
    # The three non-empty rows' token-means (-2 e^0.1, -1.2, e^-0.1) summed, over 6 rows of the mini-batch.
    loss, _ = compute_policy_loss_gspo(*gspo_batch(), **GSPO_CLIP, num_seqs=6)
    assert_close(loss, (-2 * math.exp(0.1) - 1.2 + math.exp(-0.1)) / 6)


def test_on_policy_gradient_is_minus_advantage_over_token_count_and_zero_at_padding():
    mask = t([[1, 1, 0], [1, 0, 0]])
    # padding: a finite ratio against an infinite advantage, and NaN / inf log-probs
    old = t([[-1.0, -2.0, 0.0], [-0.5, float("inf"), 3.0]])
    log_probs = t([[-1.0, -2.0, 0.0], [-0.5, float("nan"), float("nan")]]).requires_grad_()
    advantages = t([[2.0, -1.0, float("inf")], [0.5, BIG, float("nan")]])
    loss, metrics = compute_policy_loss(old, log_probs, advantages, mask)
    loss.backward()
    # ratio 1 everywhere valid: loss = -mean(A) = -(2 - 1 + 0.5) / 3; d loss / d logp = -A / 3
    assert_close(loss, -0.5)
    assert_close(log_probs.grad, [[-2.0 / 3, 1.0 / 3, 0.0], [-0.5 / 3, 0.0, 0.0]])
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/ppo_kl"] == 0.0


def test_policy_loss_rejects_clip_ratio_c_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(*PPO, clip_ratio_c=1.0)


def test_vanilla_policy_loss_is_registered_and_unknown_names_list_the_known_ones():
    assert get_policy_loss_fn("vanilla") is compute_policy_loss
    with pytest.raises(ValueError, match="gspo, vanilla"):
        get_policy_loss_fn("cispo")


def test_a_registered_policy_loss_can_be_looked_up_by_name(monkeypatch):
    monkeypatch.setattr(losses, "_POLICY_LOSSES", dict(_POLICY_LOSSES))

    @register_policy_loss("halved")
    def halved(old_log_probs, log_probs, advantages, response_mask, **kwargs):
        loss, metrics = compute_policy_loss(old_log_probs, log_probs, advantages, response_mask, **kwargs)
        return loss / 2, metrics

    assert policy_losses() == ["gspo", "halved", "vanilla"]
    loss, _ = get_policy_loss_fn("halved")(*PPO)
    assert_close(loss, 0.525 / 2)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("halved")(halved)


def test_registering_a_policy_loss_that_misses_an_actor_option_raises(monkeypatch):
    monkeypatch.setattr(losses, "_POLICY_LOSSES", dict(_POLICY_LOSSES))

    def without_counts(old_log_probs, log_probs, advantages, response_mask, *, clip_ratio_low, clip_ratio_high,
                       clip_ratio_c, loss_agg_mode, rollout_is_weights):
        return compute_policy_loss(old_log_probs, log_probs, advantages, response_mask)

    with pytest.raises(TypeError, match="does not take num_tokens, num_seqs, loss_scale_factor"):
        register_policy_loss("without-counts")(without_counts)
    assert "without-counts" not in policy_losses()


# GSPO: old log-probs vary per token, log_probs = old + delta; clip range [0.8, 1.2].
#   seq  delta             A    s = exp(mean delta)        per-token loss
#   0    (0.3, -0.1)       2    exp(0.1)  = 1.105 kept     -2 exp(0.1)
#   1    (0.6, 0.3, 0.9)   1    exp(0.6)  = 1.822 -> 1.2   -1.2 (clipped)
#   2    (-0.2, 0.0)      -1    exp(-0.1) = 0.905 kept     exp(-0.1) (the clip gives 0.8, smaller)
#   3    no valid tokens
GSPO_MASK = [[1, 1, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]]
GSPO_OLD = [[-1.0, -2.0, float("inf")], [-0.5, -0.5, -0.5], [-1.0, -3.0, 0.0], [0.0, 0.0, 0.0]]
GSPO_NEW = [[-0.7, -2.1, NAN], [0.1, -0.2, 0.4], [-1.2, -3.0, NAN], [NAN, NAN, NAN]]
GSPO_ADV = [[2.0, 2.0, BIG], [1.0, 1.0, 1.0], [-1.0, -1.0, float("inf")], [float("inf"), NAN, BIG]]
GSPO_CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}


def gspo_batch():
    return t(GSPO_OLD), t(GSPO_NEW).requires_grad_(), t(GSPO_ADV), t(GSPO_MASK)


def test_gspo_loss_uses_one_length_normalised_ratio_per_sequence():
    loss, metrics = compute_policy_loss_gspo(*gspo_batch(), **GSPO_CLIP)
    # seq-mean-token-mean over the three non-empty sequences
    assert_close(loss, (-2 * math.exp(0.1) - 1.2 + math.exp(-0.1)) / 3)
    assert_close(metrics["actor/pg_clipfrac"], 3 / 7)  # the three tokens of seq 1
    assert_close(metrics["actor/ppo_kl"], -(0.3 - 0.1 + 0.6 + 0.3 + 0.9 - 0.2 + 0.0) / 7)
    assert_close(metrics["actor/pg_clipfrac_lower"], 0.0)
    assert all(v.shape == () and not v.requires_grad for v in metrics.values())


def test_gspo_loss_with_token_mean_weights_every_valid_token_alike():
    loss, _ = compute_policy_loss_gspo(*gspo_batch(), **GSPO_CLIP, loss_agg_mode="token-mean")
    assert_close(loss, (2 * -2 * math.exp(0.1) + 3 * -1.2 + 2 * math.exp(-0.1)) / 7)


def test_gspo_gradient_is_minus_advantage_times_sequence_ratio_per_token_and_zero_when_clipped():
    old, log_probs, advantages, mask = gspo_batch()
    loss, _ = compute_policy_loss_gspo(old, log_probs, advantages, mask, **GSPO_CLIP)
    loss.backward()
    # d s_it / d logp_it = s_i, so an unclipped token gets -A s_i / (|y_i| * 3 sequences):
    # seq 0: -2 exp(0.1) / 6; seq 1 clipped: 0; seq 2: exp(-0.1) / 6; padding and seq 3: 0
    g0, g2 = -math.exp(0.1) / 3, math.exp(-0.1) / 6
    assert_close(log_probs.grad, [[g0, g0, 0.0], [0.0, 0.0, 0.0], [g2, g2, 0.0], [0.0, 0.0, 0.0]])


def test_gspo_ignores_clip_ratio_c_and_defaults_to_seq_mean_token_mean():
    reference, _ = compute_policy_loss_gspo(*gspo_batch(), **GSPO_CLIP, loss_agg_mode="seq-mean-token-mean")
    loss, _ = compute_policy_loss_gspo(*gspo_batch(), **GSPO_CLIP, clip_ratio_c=1.0)
    assert_close(loss, reference)


def test_gspo_policy_loss_is_registered():
    assert get_policy_loss_fn("gspo") is compute_policy_loss_gspo


# =====================================================================================================
# ---- value loss ----
# =====================================================================================================

# cliprange_value 0.5; per token (V_old, v, R) -> v_clip, (v - R)^2, (v_clip - R)^2, max
#   a (1, 2, 3)       1.5    1     2.25   2.25 (clipped term larger)
#   b (1, 2, 1)       1.5    1     0.25   1
#   c (0, -0.2, 0)    -0.2   0.04  0.04   0.04 (a tie is not clipping)
#   d (0, -1, -2)     -0.5   1     2.25   2.25 (clipped term larger)
VALUE_MASK = [[1, 1, 1], [1, 0, 0]]
VALUE_OLD = [[1.0, 1.0, 0.0], [0.0, BIG, NAN]]
VPREDS = [[2.0, 2.0, -0.2], [-1.0, NAN, BIG]]
VALUE_RETURNS = [[3.0, 1.0, 0.0], [-2.0, float("inf"), NAN]]


def value_batch():
    return t(VPREDS).requires_grad_(), t(VALUE_RETURNS), t(VALUE_OLD), t(VALUE_MASK)


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_squared_errors():
    loss, metrics = compute_value_loss(*value_batch(), cliprange_value=0.5)
    assert_close(loss, 0.5 * (2.25 + 1.0 + 0.04 + 2.25) / 4)  # 0.6925
    assert_close(metrics["critic/vf_loss"], 0.6925)
    assert_close(metrics["critic/vf_clipfrac"], 2 / 4)
    assert_close(metrics["critic/vpred_mean"], (2.0 + 2.0 - 0.2 - 1.0) / 4)  # 0.7
    assert all(v.shape == () and not v.requires_grad for v in metrics.values())


def test_value_loss_gradient_stops_where_the_clipped_term_wins_and_at_padding():
    vpreds, returns, values, mask = value_batch()
    loss, _ = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    loss.backward()
    # 0.5 * 2 (v - R) / 4 where the unclipped term counts: b (2 - 1) / 4 = 0.25, c -0.2 / 4 = -0.05;
    # a and d sit on the clip, whose gradient in v is 0
    assert_close(vpreds.grad, [[0.0, 0.25, -0.05], [0.0, 0.0, 0.0]])


def test_value_loss_passes_the_aggregation_mode_through():
    loss, _ = compute_value_loss(*value_batch(), cliprange_value=0.5, loss_agg_mode="seq-mean-token-mean")
    assert_close(loss, 0.5 * ((2.25 + 1.0 + 0.04) / 3 + 2.25) / 2)  # 0.8366667


def test_value_loss_passes_the_global_counts_and_the_scale_factor_to_agg_loss():
    loss, _ = compute_value_loss(*value_batch(), cliprange_value=0.5, num_tokens=10)
    assert_close(loss, 0.5 * (2.25 + 1.0 + 0.04 + 2.25) / 10)
    loss, _ = compute_value_loss(*value_batch(), cliprange_value=0.5, loss_agg_mode="seq-mean-token-sum-norm",
                                 num_seqs=4, loss_scale_factor=2.0)
    assert_close(loss, 0.5 * (2.25 + 1.0 + 0.04 + 2.25) / 4 / 2)


def test_value_loss_rejects_a_negative_cliprange():
    with pytest.raises(ValueError, match="cliprange_value"):
        compute_value_loss(*value_batch(), cliprange_value=-0.1)


def test_explained_variance_is_one_minus_residual_variance_over_return_variance():
    returns = t([[1.0, 2.0, BIG], [3.0, NAN, NAN]])
    values = t([[0.5, 2.0, NAN], [3.5, BIG, float("inf")]]).requires_grad_()
    mask = t([[1, 1, 0], [1, 0, 0]])
    # returns (1, 2, 3): var 2/3; residuals (0.5, 0, -0.5): var 1/6 -> 1 - 1/4
    ev = explained_variance(values, returns, mask)
    assert_close(ev, 0.75)
    assert ev.shape == () and not ev.requires_grad
    assert_close(explained_variance(returns, returns, mask), 1.0)
    assert_close(explained_variance(torch.zeros(2, 3), returns, mask), 0.0)


def test_explained_variance_of_constant_returns_is_zero_not_nan():
    returns = t([[2.0, 2.0, BIG], [2.0, NAN, 0.0]])
    values = t([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    assert_close(explained_variance(values, returns, t([[1, 1, 0], [1, 0, 0]])), 0.0)
    assert_close(explained_variance(t([[0.0]]), t([[3.0]]), t([[1]])), 0.0)  # one valid token


# =====================================================================================================
# ---- entropy ----
# =====================================================================================================


def test_entropy_of_uniform_logits_is_log_vocab_size():
    assert_close(entropy_from_logits(torch.zeros(2, 3, 4)), torch.full((2, 3), math.log(4)))


def test_entropy_matches_hand_computed_two_token_distribution():
    # logits (0, ln 3) -> probs (0.25, 0.75): -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351
    logits = t([[0.0, math.log(3.0)], [5.0, 5.0 + math.log(3.0)]])
    assert_close(entropy_from_logits(logits), [0.5623351, 0.5623351])


def test_entropy_is_stable_for_huge_logits():
    assert_close(entropy_from_logits(t([[1000.0, 1000.0], [1000.0, -1000.0]])), [math.log(2), 0.0])


# ---- multi-turn responses: observation tokens inside a response carry mask 0 ----

# Two responses of one group; the first holds an observation (positions 2-3) between two sampled runs.
INTERIOR_MASK = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)


@pytest.mark.parametrize("name", advantages.advantage_estimators())
def test_every_estimator_gives_no_advantage_to_observation_tokens_inside_a_response(name):
    rewards = torch.zeros(2, 6)
    rewards[0, 5], rewards[1, 2] = 1.0, 0.0
    adv, returns = advantages.compute_advantage(
        name, token_level_rewards=rewards, response_mask=INTERIOR_MASK, group_ids=torch.tensor([0, 0]),
        values=torch.full((2, 6), 0.25), reward_baselines=torch.tensor([0.5, 0.5]))
    assert (adv[INTERIOR_MASK == 0] == 0).all() and (returns[INTERIOR_MASK == 0] == 0).all()
    assert adv[0, :2].ne(0).all()  # the policy's tokens before the observation are credited


def test_gae_skips_observation_tokens_as_if_they_were_not_there():
    # The same response with and without two observation tokens inside it: the sampled tokens' GAE is equal,
    # whatever values the critic gave the observation positions.
    rewards_full = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, 1.0]])
    values_full = torch.tensor([[0.1, 0.2, 9.0, -9.0, 0.3, 0.4]])
    mask_full = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.5, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    _, returns_full = advantages.gae_advantage(rewards_full, mask_full, values_full, gamma=0.9, lam=0.8)
    _, returns = advantages.gae_advantage(rewards, torch.ones(1, 4), values, gamma=0.9, lam=0.8)
    kept = mask_full[0].bool()
    assert torch.allclose(returns_full[0, kept], returns[0])
    # By hand at the last sampled token: delta = 1.0 - 0.4, so its return is 1.0.
    assert returns[0, 3].item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_loss_aggregation_counts_only_the_sampled_tokens_of_a_response_with_observations(mode):
    loss_mat = torch.tensor([[1.0, 2.0, 100.0, float("inf"), 3.0, 4.0], [5.0, 6.0, 7.0, 0.0, 0.0, 0.0]])
    got = losses.agg_loss(loss_mat, INTERIOR_MASK, mode)
    # Worked by hand over the sampled tokens only: row sums 10 and 18, token counts 4 and 3, width 6.
    expected = {"token-mean": 28 / 7, "token-sum": 28.0, "seq-mean-token-sum": (10 + 18) / 2,
                "seq-mean-token-mean": (10 / 4 + 18 / 3) / 2, "seq-mean-token-sum-norm": (10 + 18) / 2 / 6}[mode]
    assert got.item() == pytest.approx(expected)
