"""Core RL algorithms: loss aggregation, KL penalties, reward shaping, advantage estimators, policy and
value losses.

Everything here is a pure torch function on (batch, response_len) tensors: no I/O, no config objects.
A mask marks real response tokens with 1 (or True) and padding with 0 (or False). Padded positions are
selected away with ``torch.where`` rather than multiplied by zero, so even inf or NaN left in the padding
cannot reach a result or a gradient.

Advantage estimators and policy losses sit in small registries so the trainer picks them by name; an
unknown name fails with the list of known ones.
"""

import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from backend import vocab_stats

# =====================================================================================================
# ---- masked helpers ----
# =====================================================================================================


def _bool_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    kept = torch.where(mask, values, 0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over the masked-in entries: sum(values * mask) / sum(mask).

    Args:
        values: any shape, e.g. (batch, response_len).
        mask: same shape as ``values``; 1 marks an entry to average, 0 one to ignore.
        dim: dimension to reduce; ``None`` reduces everything to a scalar.

    An empty mask (along ``dim``) gives 0 rather than NaN.
    """
    mask = _bool_mask(mask)
    total = _masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp_min(1).to(total.dtype)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all masked-in entries: mean((values - mean)^2), times n/(n-1) when ``unbiased``.

    Args:
        values: any shape, e.g. (batch, response_len).
        mask: same shape as ``values``.

    Returns a scalar. With fewer than two valid entries the variance is 0 (no Bessel correction, no NaN).
    """
    mask = _bool_mask(mask)
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean).square(), mask)
    if unbiased:
        n = mask.sum()
        var = var * (n / (n - 1).clamp_min(1))
    return var


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Standardise over all masked-in entries: (values - mean) / sqrt(var + 1e-8), var unbiased.

    Args:
        values: any shape, e.g. (batch, response_len).
        mask: same shape as ``values``.
        shift_mean: if False the mean is added back, so only the scale changes.

    Padded positions come back as 0.
    """
    mask = _bool_mask(mask)
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0)


# =====================================================================================================
# ---- loss aggregation ----
# =====================================================================================================

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
    """Reduce a per-token loss to a scalar.

    token-mean:              sum_{i,t} L_it m_it / sum_{i,t} m_it
    seq-mean-token-sum:      mean_i sum_t L_it m_it
    seq-mean-token-mean:     mean_i (sum_t L_it m_it / sum_t m_it)
    seq-mean-token-sum-norm: sum_{i,t} L_it m_it / T, T = loss_mat.shape[-1] (Dr.GRPO: Liu et al. 2025,
                             "Understanding R1-Zero-Like Training", removes the length bias)

    Args:
        loss_mat: (batch, response_len) per-token loss.
        loss_mask: (batch, response_len), 1 for real response tokens, 0 for padding.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.

    The seq-mean modes average over sequences that have at least one valid token, so an empty
    sequence neither adds a term nor dilutes the mean; an all-empty batch gives 0, never NaN.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known modes: {', '.join(LOSS_AGG_MODES)}")
    mask = _bool_mask(loss_mask)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return _masked_sum(loss_mat, mask) / loss_mat.shape[-1]
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = _masked_sum(loss_mat, mask, dim=-1)
    else:  # seq-mean-token-mean
        seq_losses = masked_mean(loss_mat, mask, dim=-1)
    return masked_mean(seq_losses, mask.any(dim=-1))


# =====================================================================================================
# ---- KL penalty ----
# =====================================================================================================

KL_TYPES: tuple[str, ...] = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kl_type: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman 2020, "Approximating
    KL Divergence").

    k1 / kl:          logp - ref
    k2 / mse:         0.5 * (logp - ref)^2
    k3 / low_var_kl:  exp(r) - r - 1 with r = ref - logp, clamped to [-10, 10]
    abs:              |logp - ref|

    Args:
        log_probs: (batch, response_len) log-probs of the sampled tokens under the policy.
        ref_log_probs: (batch, response_len) the same under the reference model.
        kl_type: one of ``KL_TYPES``.

    Returns (batch, response_len); padding is not masked here, callers mask it.
    """
    if kl_type in ("k1", "kl"):
        return log_probs - ref_log_probs
    if kl_type in ("k2", "mse"):
        return 0.5 * (log_probs - ref_log_probs).square()
    if kl_type in ("k3", "low_var_kl"):
        # Clamping r to [-20, 20] changes no value (|r| >= 20 lands on the 10 clamp anyway), but keeps
        # exp(r) finite so the backward pass never multiplies the clamp's zero gradient by inf.
        r = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
        return (torch.exp(r) - r - 1).clamp(-10.0, 10.0)
    if kl_type == "abs":
        return (log_probs - ref_log_probs).abs()
    raise ValueError(f"unknown kl_type {kl_type!r}; known types: {', '.join(KL_TYPES)}")


def apply_kl_penalty(
    token_level_scores: Tensor,
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    kl_type: str,
) -> tuple[Tensor, dict[str, float]]:
    """Fold a KL penalty into the reward: rewards = scores - kl_coef * kl * mask (Ziegler et al. 2019,
    "Fine-Tuning Language Models from Human Preferences"; Ouyang et al. 2022).

    Args:
        token_level_scores: (batch, response_len) task reward, usually the score at the last valid token.
        log_probs: (batch, response_len) sampled-token log-probs under the policy that generated them.
        ref_log_probs: (batch, response_len) the same under the reference model.
        response_mask: (batch, response_len), 1 for real response tokens.
        kl_coef: penalty coefficient (the controller's ``.value``).
        kl_type: one of ``KL_TYPES``.

    Returns (token_level_rewards (batch, response_len), metrics) where "actor/reward_kl_penalty" is the
    per-sequence token-mean KL averaged over sequences; feed it to the KL controller's ``update``.
    """
    mask = _bool_mask(response_mask)
    kld = torch.where(mask, kl_penalty(log_probs, ref_log_probs, kl_type), 0)
    token_level_rewards = token_level_scores - kl_coef * kld
    current_kl = agg_loss(kld, mask, "seq-mean-token-mean")
    metrics = {
        "actor/reward_kl_penalty": current_kl.item(),
        "actor/reward_kl_penalty_coeff": float(kl_coef),
    }
    return token_level_rewards, metrics


class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing (it exists so both controllers look alike)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays ``kl_coef``."""


class AdaptiveKLController:
    """Steer the KL coefficient towards a target KL (Ziegler et al. 2019, "Fine-Tuning Language Models
    from Human Preferences", section 2.2).

    e = clip(current_kl / target_kl - 1, -0.2, 0.2);  value *= 1 + e * n_steps / horizon
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl={target_kl} must be > 0: it is the KL the controller steers towards")
        if horizon <= 0:
            raise ValueError(f"horizon={horizon} must be > 0: it is the number of samples to adapt over")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt ``value`` after ``n_steps`` samples whose observed KL was ``current_kl``."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


# =====================================================================================================
# ---- DAPO reward shaping and dynamic sampling ----
# =====================================================================================================


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, buffer_length: int, penalty_factor: float
) -> Tensor:
    """DAPO's soft overlong punishment, added to each response's score. With L = max_response_length and
    B = buffer_length: 0 for len <= L - B, -(len - (L - B)) / B * penalty_factor inside the buffer,
    clamped at -penalty_factor (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
    at Scale", section 3.4; the paper uses L = 20480, B = 4096, factor 1).

    Args:
        response_lengths: (batch,) number of valid tokens in each response.
        max_response_length: L, the generation limit.
        buffer_length: B, the last B tokens before L over which the penalty ramps up; 0 < B <= L.
        penalty_factor: the penalty at length L; >= 0.

    Returns (batch,) penalties in [-penalty_factor, 0], floating point.
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length={buffer_length} must be > 0 and <= max_response_length={max_response_length}: "
            "it is how many tokens before the limit the penalty ramps up over (DAPO: 4096 of 20480)"
        )
    if penalty_factor < 0:
        raise ValueError(
            f"penalty_factor={penalty_factor} must be >= 0: it is the penalty subtracted at the length limit"
        )
    lengths = response_lengths if response_lengths.is_floating_point() else response_lengths.float()
    exceed = (lengths - (max_response_length - buffer_length)).clamp(0, buffer_length)
    return -exceed / buffer_length * penalty_factor


def groups_with_signal(scores: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO's dynamic sampling test: True for each row whose group's scores are not all equal (Yu et al.
    2025, "DAPO", section 3.2). A group of equal scores, all right or all wrong, gets a group-relative
    advantage of 0 everywhere and so no gradient; the sampler drops it and draws more prompts. A group
    of one has nothing to compare with and is dropped too.

    Args:
        scores: (batch,) score of each response.
        group_ids: (batch,) integer id of the prompt each response was sampled from; any integers.

    Returns (batch,) bool.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be (batch,): "
            "one score and one prompt id per response"
        )
    unique_ids, group_index = torch.unique(group_ids, return_inverse=True)
    per_group = scores.new_zeros(len(unique_ids))
    group_max = per_group.scatter_reduce(0, group_index, scores, "amax", include_self=False)
    group_min = per_group.scatter_reduce(0, group_index, scores, "amin", include_self=False)
    return (group_max > group_min)[group_index]


# =====================================================================================================
# ---- advantage estimators ----
# =====================================================================================================

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]

# Everything compute_advantage can hand an estimator; each estimator declares the subset it uses.
_ADVANTAGE_INPUTS = (
    "token_level_rewards",
    "response_mask",
    "group_ids",
    "values",
    "reward_baselines",
    "gamma",
    "lam",
    "epsilon",
    "norm_adv_by_std",
)
_ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator that registers an advantage estimator under ``name``.

    The function takes keyword arguments named from token_level_rewards, response_mask, group_ids,
    values, reward_baselines, gamma, lam, epsilon, norm_adv_by_std (only those it declares are passed)
    and returns (advantages, returns), both (batch, response_len).
    """

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in _ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        unknown = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.name not in _ADVANTAGE_INPUTS
            and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if unknown:
            raise TypeError(
                f"advantage estimator {name!r} requires {', '.join(unknown)}, which compute_advantage "
                f"never passes; it can declare any of: {', '.join(_ADVANTAGE_INPUTS)}"
            )
        _ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator registered under ``name``; an unknown name raises ValueError listing the known ones."""
    if name not in _ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(advantage_estimators())}")
    return _ADVANTAGE_ESTIMATORS[name]


def advantage_estimators() -> list[str]:
    """Sorted names of the registered advantage estimators."""
    return sorted(_ADVANTAGE_ESTIMATORS)


def compute_advantage(
    name: str,
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """Run the estimator registered as ``name``, passing only the keyword arguments it declares.

    Args:
        token_level_rewards: (batch, response_len), the scalar score at the last valid token (plus any
            per-token terms such as a KL penalty).
        response_mask: (batch, response_len), 1 for real response tokens.
        group_ids: (batch,) integer id of the prompt each response was sampled from; any integers, in
            any order.
        values: (batch, response_len) critic values, for "gae".
        reward_baselines: (batch,) score of the greedy response to the same prompt, for "remax".
        gamma, lam: discount and GAE lambda.
        epsilon: added to the group std before dividing.
        norm_adv_by_std: GRPO's division by the group std.

    Returns (advantages, returns), both (batch, response_len), detached and 0 at padding.
    """
    fn = get_advantage_fn(name)
    available = {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask,
        "group_ids": group_ids,
        "values": values,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "epsilon": epsilon,
        "norm_adv_by_std": norm_adv_by_std,
    }
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        available = {k: v for k, v in available.items() if k in params}
    with torch.no_grad():
        advantages, returns = fn(**available)
    mask = _bool_mask(response_mask)
    return torch.where(mask, advantages, 0), torch.where(mask, returns, 0)


def _sequence_scores(token_level_rewards: Tensor, mask: Tensor) -> Tensor:
    """(batch,) sum of the token rewards over valid tokens."""
    return _masked_sum(token_level_rewards, mask, dim=-1)


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence (group mean, unbiased group std, group size), each (batch,).

    A group of one gets mean 0 and std 1, so GRPO leaves its score as it is (as verl does).
    """
    _, group_index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.to(scores.dtype)
    mean = torch.zeros_like(n).index_add_(0, group_index, scores) / n
    sq_dev = (scores - mean[group_index]).square()
    var = torch.zeros_like(n).index_add_(0, group_index, sq_dev) / (n - 1).clamp_min(1)
    singleton = counts == 1
    mean = torch.where(singleton, 0, mean)
    std = torch.where(singleton, 1, var.sqrt())
    return mean[group_index], std[group_index], counts[group_index]


def _broadcast(per_seq: Tensor, mask: Tensor) -> Tensor:
    """(batch,) -> (batch, response_len), copied onto valid tokens, 0 at padding."""
    return torch.where(mask, per_seq.unsqueeze(-1), 0)


@register_advantage("grpo")
def grpo_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """GRPO: A_i = (s_i - mean_g(s)) / (std_g(s) + eps), s_i = sum_t r_it, the same for every token
    (Shao et al. 2024, "DeepSeekMath"). std is unbiased; a group of one has mean 0, std 1.

    Args:
        token_level_rewards: (batch, response_len).
        response_mask: (batch, response_len).
        group_ids: (batch,) prompt id of each response.
        epsilon: added to the std. norm_adv_by_std: False drops the division (Dr.GRPO).

    Returns (advantages, returns), both (batch, response_len); returns are the advantages.
    """
    mask = _bool_mask(response_mask)
    scores = _sequence_scores(token_level_rewards, mask)
    mean, std, _ = _group_stats(scores, group_ids)
    scores = scores - mean
    if norm_adv_by_std:
        scores = scores / (std + epsilon)
    advantages = _broadcast(scores, mask)
    return advantages, advantages


@register_advantage("drgrpo")
def drgrpo_advantage(token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Dr.GRPO: A_i = s_i - mean_g(s), never divided by the group std (Liu et al. 2025,
    "Understanding R1-Zero-Like Training: A Critical Perspective").

    Args:
        token_level_rewards: (batch, response_len).
        response_mask: (batch, response_len).
        group_ids: (batch,) prompt id of each response.

    Returns (advantages, returns), both (batch, response_len); returns are the advantages.
    """
    return grpo_advantage(token_level_rewards, response_mask, group_ids, norm_adv_by_std=False)


@register_advantage("rloo")
def rloo_advantage(token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """RLOO: A_i = s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean_g(s)); a group of one gets 0
    (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization").

    Args:
        token_level_rewards: (batch, response_len).
        response_mask: (batch, response_len).
        group_ids: (batch,) prompt id of each response.

    Returns (advantages, returns), both (batch, response_len); returns are the advantages.
    """
    mask = _bool_mask(response_mask)
    scores = _sequence_scores(token_level_rewards, mask)
    mean, _, counts = _group_stats(scores, group_ids)
    n = counts.to(scores.dtype)
    # A lone sample has no leave-one-out baseline at all, so it carries no signal.
    scores = torch.where(counts > 1, (scores - mean) * n / (n - 1).clamp_min(1), 0)
    advantages = _broadcast(scores, mask)
    return advantages, advantages


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: G_t = r_t + gamma * G_{t+1} over valid tokens, then A = whiten(G) over every valid
    token of the batch (Hu 2025, "REINFORCE++"). A padded position has G = 0 and restarts the sum.

    Args:
        token_level_rewards: (batch, response_len).
        response_mask: (batch, response_len).
        gamma: discount.

    Returns (advantages, returns): whitened and raw returns-to-go, both (batch, response_len).
    """
    mask = _bool_mask(response_mask)
    running = torch.zeros_like(token_level_rewards[:, 0])
    returns_reversed = []
    for t in reversed(range(token_level_rewards.shape[1])):
        running = torch.where(mask[:, t], token_level_rewards[:, t] + gamma * running, 0)
        returns_reversed.append(running)
    returns = torch.stack(returns_reversed[::-1], dim=1)
    return masked_whiten(returns, mask), returns


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline: A = whiten(s_i - mean_g(s)) over every valid token of the
    batch (Hu 2025, "REINFORCE++"). A group of one has mean 0.

    Args:
        token_level_rewards: (batch, response_len).
        response_mask: (batch, response_len).
        group_ids: (batch,) prompt id of each response.

    Returns (advantages, returns), both (batch, response_len); returns are the advantages.
    """
    mask = _bool_mask(response_mask)
    scores = _sequence_scores(token_level_rewards, mask)
    mean, _, _ = _group_stats(scores, group_ids)
    advantages = masked_whiten(_broadcast(scores - mean, mask), mask)
    return advantages, advantages


@register_advantage("gae")
def gae_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """GAE: delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V,
    then A is whitened over valid tokens (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation").

    Args:
        token_level_rewards: (batch, response_len).
        response_mask: (batch, response_len); a padded position is skipped: it neither receives an
            advantage nor breaks the recursion between the valid tokens around it.
        values: (batch, response_len) critic values; required.
        gamma, lam: discount and GAE lambda.

    Returns (advantages, returns), both (batch, response_len).
    """
    if values is None:
        raise ValueError(
            "the 'gae' advantage estimator needs critic values of shape (batch, response_len): "
            "pass values=..., or pick a critic-free estimator such as 'grpo'"
        )
    mask = _bool_mask(response_mask)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(token_level_rewards.shape[1])):
        valid = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(valid, values[:, t], next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
        advantages_reversed.append(torch.where(valid, advantage, 0))
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = torch.where(mask, advantages + values, 0)
    return masked_whiten(advantages, mask), returns


@register_advantage("remax")
def remax_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, reward_baselines: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """ReMax: G_t = sum_{t' >= t} r_t' over valid tokens, A_t = G_t - b, where b is the score of the
    greedy response to the same prompt (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient
    Reinforcement Learning Method for Aligning Large Language Models").

    Args:
        token_level_rewards: (batch, response_len).
        response_mask: (batch, response_len); padding adds nothing to any sum.
        reward_baselines: (batch,) greedy-response score of each row's prompt; required.

    Returns (advantages, returns), both (batch, response_len), 0 at padding.
    """
    if reward_baselines is None:
        raise ValueError(
            "the 'remax' advantage estimator needs reward_baselines of shape (batch,), the score of the "
            "greedy response to each row's prompt: pass reward_baselines=..., or pick an estimator "
            "without a baseline rollout such as 'grpo'"
        )
    mask = _bool_mask(response_mask)
    rewards = torch.where(mask, token_level_rewards, 0)
    returns = torch.where(mask, rewards.flip(-1).cumsum(-1).flip(-1), 0)
    advantages = torch.where(mask, returns - reward_baselines.unsqueeze(-1), 0)
    return advantages, returns


# =====================================================================================================
# ---- policy losses ----
# =====================================================================================================

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator that registers a policy loss under ``name``.

    The function is called as fn(old_log_probs, log_probs, advantages, response_mask, **options) and
    returns (scalar loss, metrics dict of detached 0-dim tensors), like ``compute_policy_loss``. Among
    the options, ``rollout_is_weights`` ((batch, response_len) or None, see ``rollout_is_weights``)
    multiplies the per-token loss before aggregation.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``; an unknown name raises ValueError listing the known ones."""
    if name not in _POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; known: {', '.join(policy_losses())}")
    return _POLICY_LOSSES[name]


def policy_losses() -> list[str]:
    """Sorted names of the registered policy losses."""
    return sorted(_POLICY_LOSSES)


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with dual clip: rho = exp(logp - old),
    L = max(-A rho, -A clip(rho, 1 - low, 1 + high)), and for A < 0, L = min(L, -A c).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; dual clip from Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"; asymmetric ratios
    ("clip-higher") from Yu et al. 2025, "DAPO".

    Args:
        old_log_probs: (batch, response_len) sampled-token log-probs under the policy that generated them.
        log_probs: (batch, response_len) the same under the current policy (carries the gradient).
        advantages: (batch, response_len).
        response_mask: (batch, response_len), 1 for real response tokens.
        clip_ratio_low, clip_ratio_high: the ratio is clipped to [1 - low, 1 + high].
        clip_ratio_c: dual-clip bound for negative advantages; must be > 1.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        rollout_is_weights: (batch, response_len) detached weights multiplying each token's loss (the
            rollout engine's importance-sampling correction, ``rollout_is_weights``), or None.

    Returns (loss, metrics): "actor/pg_clipfrac" (share of valid tokens the ratio clip bound),
    "actor/ppo_kl" (mean of old - logp), "actor/pg_clipfrac_lower" (share where the dual clip bound), as
    detached 0-dim tensors: reading one waits for the device, so callers read them once per optimizer step.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1: it bounds the loss at -A * clip_ratio_c")
    mask = _bool_mask(response_mask)
    # Cut padding out of the graph here, not only in agg_loss: there garbage advantages would meet the
    # zero upstream gradient as 0 * inf = NaN on the way back to log_probs.
    log_ratio = torch.where(mask, log_probs - old_log_probs, 0)

    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clipped_losses, pg_losses3), clipped_losses)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    loss = agg_loss(pg_losses, mask, loss_agg_mode)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((pg_losses2 > pg_losses1).float(), mask),
            "actor/ppo_kl": masked_mean(-log_ratio, mask),
            "actor/pg_clipfrac_lower": masked_mean((negative & (clipped_losses > pg_losses3)).float(), mask),
        }
    return loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO's clip on the length-normalised sequence ratio s_i = exp(mean_t(logp_it - old_it)), in
    its token form s_it = exp(sg[log s_i] + logp_it - sg[logp_it]): s_it equals s_i in value, while
    d s_it / d logp_it = s_i sends each token its own gradient.
    L_it = max(-A_it s_it, -A_it clip(s_it, 1 - low, 1 + high)).

    Zheng et al. 2025, "Group Sequence Policy Optimization" (GSPO-token); the paper clips to
    [1 - 3e-4, 1 + 4e-4] (the defaults here) and averages with "seq-mean-token-mean".

    Args:
        old_log_probs: (batch, response_len) sampled-token log-probs under the policy that generated them.
        log_probs: (batch, response_len) the same under the current policy (carries the gradient).
        advantages: (batch, response_len), normally one sequence-level value per row (e.g. GRPO's).
        response_mask: (batch, response_len), 1 for real response tokens.
        clip_ratio_low, clip_ratio_high: s_it is clipped to [1 - low, 1 + high].
        clip_ratio_c: accepted so every policy loss takes the same keywords, and unused: GSPO has no
            dual clip.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        rollout_is_weights: (batch, response_len) detached per-token weights of the loss, or None (as in
            ``compute_policy_loss``).

    Returns (loss, metrics): "actor/pg_clipfrac" (share of valid tokens the clip bound), "actor/ppo_kl"
    (mean of old - logp over valid tokens), "actor/pg_clipfrac_lower" (always 0: no dual clip), as
    detached 0-dim tensors. A row without valid tokens has s = 1 and adds nothing.
    """
    mask = _bool_mask(response_mask)
    # Padding leaves the graph here, as in compute_policy_loss, so garbage there cannot become NaN on
    # the way back to log_probs.
    log_ratio = torch.where(mask, log_probs - old_log_probs, 0)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).detach()  # (batch,)
    logp = torch.where(mask, log_probs, 0)
    # Clamping the detached sequence term bounds the value without cutting any token's gradient.
    log_seq_ratio = seq_log_ratio.clamp(-20.0, 20.0).unsqueeze(-1) + logp - logp.detach()
    seq_ratio = torch.exp(log_seq_ratio)  # (batch, response_len), each row constant in value

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * seq_ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    loss = agg_loss(pg_losses, mask, loss_agg_mode)
    with torch.no_grad():
        clipfrac = masked_mean((pg_losses2 > pg_losses1).float(), mask)
        metrics = {
            "actor/pg_clipfrac": clipfrac,
            "actor/ppo_kl": masked_mean(-log_ratio, mask),
            "actor/pg_clipfrac_lower": torch.zeros_like(clipfrac),
        }
    return loss, metrics


# =====================================================================================================
# ---- rollout correction: the sampling engine against the trainer ----
# =====================================================================================================


def rollout_is_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    threshold: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance-sampling weight between the engine that sampled the tokens and the policy the
    trainer computes: w_t = min(exp(old_t - rollout_t), threshold), detached, 0 at padding. The policy
    loss of each token is multiplied by it (``rollout_is_weights`` of the policy losses).

    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS); verl's
    rollout correction (rollout_is=token), TRL's vllm_importance_sampling_correction.

    Args:
        old_log_probs: (batch, response_len) the trainer's log-probs of the sampled tokens under the policy
            that generated them (on-policy: the detached current ones).
        rollout_log_probs: (batch, response_len) the rollout engine's log-probs of the same tokens.
        response_mask: (batch, response_len), 1 for real response tokens.
        threshold: the cap of the weight (> 0).

    Returns (weights (batch, response_len), metrics over valid tokens as detached 0-dim tensors):
    "rollout/log_prob_diff_mean" (mean |rollout - old|), "rollout/is_weight_mean",
    "rollout/is_weight_max" (of the capped weights), "rollout/is_clipfrac" (share the cap bound).
    """
    mask = _bool_mask(response_mask)
    with torch.no_grad():
        log_ratio = torch.where(mask, old_log_probs.detach() - rollout_log_probs, 0)
        raw = torch.exp(log_ratio.clamp(-20.0, 20.0))
        weights = torch.where(mask, raw.clamp(max=threshold), 0)
        metrics = {
            "rollout/log_prob_diff_mean": masked_mean(log_ratio.abs(), mask),
            "rollout/is_weight_mean": masked_mean(weights, mask),
            "rollout/is_weight_max": weights.masked_fill(~mask, float("-inf")).max().clamp(min=0),
            "rollout/is_clipfrac": masked_mean((raw > threshold).float(), mask),
        }
    return weights, metrics


# =====================================================================================================
# ---- value loss ----
# =====================================================================================================


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: v_clip = V_old + clip(v - V_old, -c, c),
    L = 0.5 * agg(max((v - R)^2, (v_clip - R)^2)).

    From OpenAI Baselines' PPO2, as studied in Engstrom et al. 2020, "Implementation Matters in Deep
    Policy Gradients: A Case Study on PPO and TRPO".

    Args:
        vpreds: (batch, response_len) values predicted by the critic being trained (carries the gradient).
        returns: (batch, response_len) regression targets, e.g. GAE's returns.
        values: (batch, response_len) the critic's values at rollout time, V_old.
        response_mask: (batch, response_len), 1 for real response tokens.
        cliprange_value: c >= 0, how far a prediction may move from V_old before its gradient stops.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.

    Returns (loss, metrics): "critic/vf_loss" (the loss), "critic/vf_clipfrac" (share of valid tokens where
    the clipped term is the larger), "critic/vpred_mean" (mean of vpreds over valid tokens), as detached
    0-dim tensors.
    """
    if cliprange_value < 0:
        raise ValueError(
            f"cliprange_value={cliprange_value} must be >= 0: it is how far a value prediction may move "
            "from the rollout's value; set it large to turn value clipping off"
        )
    mask = _bool_mask(response_mask)
    # As in compute_policy_loss: padding leaves the graph before any garbage can meet a zero gradient.
    vpreds = torch.where(mask, vpreds, 0)
    returns = torch.where(mask, returns, 0)
    values = torch.where(mask, values, 0)

    vpred_clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpred_clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), mask, loss_agg_mode)
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": loss.detach(),
            "critic/vf_clipfrac": masked_mean((vf_losses2 > vf_losses1).float(), mask),
            "critic/vpred_mean": masked_mean(vpreds, mask),
        }
    return loss, metrics


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """How much of the returns' variance the values explain: 1 - Var(R - V) / Var(R) over valid tokens.

    1 is a perfect critic, 0 one no better than a constant, below 0 one worse than a constant.

    Args:
        values: (batch, response_len) critic values.
        returns: (batch, response_len) the returns they predict.
        mask: (batch, response_len), 1 for real response tokens.

    Returns a detached 0-dim tensor. When Var(R) is 0 (constant returns, fewer than two valid tokens)
    nothing is there to explain and the result is 0, not NaN or inf.
    """
    mask = _bool_mask(mask)
    with torch.no_grad():
        var_returns = masked_var(returns, mask, unbiased=False)
        var_residual = masked_var(returns - values, mask, unbiased=False)
        has_variance = var_returns > 0
        ratio = var_residual / torch.where(has_variance, var_returns, 1)
        return torch.where(has_variance, 1 - ratio, 0)


# =====================================================================================================
# ---- entropy ----
# =====================================================================================================


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits): H = logsumexp(z) - sum_v softmax(z)_v z_v.

    Args:
        logits: (..., vocab), finite.

    Returns (...), e.g. (batch, response_len).
    """
    # H is shift-invariant; subtracting the max first avoids the float cancellation of two large terms.
    logits = logits - logits.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


# =====================================================================================================
# ---- log-probs ----
# =====================================================================================================

LOG_PROB_CHUNK_TOKENS = 2048  # response positions whose fp32 vocabulary pass is computed at once


def _vocab_forward(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool
                   ) -> tuple[Tensor, Tensor | None, Tensor]:
    """One pass over the vocabulary: with z = logits / T and a = log softmax(z),
    log_prob = a[target], entropy = -sum_v exp(a_v) a_v, lse = logsumexp(z).

    logits (rows, R, V) in any dtype, targets (rows, R); returns three (rows, R) fp32 tensors
    (entropy None unless asked for).
    """
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    a = z - lse
    log_prob = a.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(a.exp() * a).sum(-1) if with_entropy else None
    return log_prob, entropy, lse.squeeze(-1)


def _vocab_backward(logits: Tensor, targets: Tensor, temperature: float, lse: Tensor, entropy: Tensor | None,
                    grad_log_prob: Tensor, grad_entropy: Tensor | None) -> Tensor:
    """d/d logits of sum(grad_log_prob * log_prob + grad_entropy * entropy), from what the forward kept:
    (1/T) [g_lp (onehot(target) - p) - g_H p (a + H)], with a = z - lse = log p (so a + H = z - E_p[z]).

    logits (rows, R, V); targets, lse, entropy and the two upstream gradients (rows, R); returns the
    gradient in the logits' dtype (rows, R, V).
    """
    a = logits.float() / temperature - lse.unsqueeze(-1)
    p = a.exp()
    is_target = torch.arange(logits.shape[-1], device=logits.device) == targets.unsqueeze(-1)
    grad = grad_log_prob.unsqueeze(-1) * (is_target.float() - p)
    if grad_entropy is not None:
        grad = grad - grad_entropy.unsqueeze(-1) * p * (a + entropy.unsqueeze(-1))
    return (grad / temperature).to(logits.dtype)


@functools.cache
def _compiled_vocab_pass() -> tuple[Callable, Callable]:
    # Compiled, each direction is one or two fused kernels that read the bf16 logits without writing
    # an fp32 copy; eager, every step above is its own pass over a (rows, R, V) tensor. On a GPU the
    # forward is vocab_stats' kernel, which reads the logits once where the compiled one read them
    # about three times.
    compiled_forward = _over_positions(torch.compile(_vocab_forward))

    def forward(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool
                ) -> tuple[Tensor, Tensor | None, Tensor]:
        if vocab_stats.available(logits.device):
            return vocab_stats.vocab_stats(logits, targets, temperature, with_entropy)
        return compiled_forward(logits, targets, temperature, with_entropy)

    return forward, _over_positions(torch.compile(_vocab_backward))


def _over_positions(fn: Callable) -> Callable:
    """fn applied to its tensors flattened to (positions, ...), with the number of positions dynamic and
    the vocabulary static: one compilation serves every chunk, and the kernels index the vocabulary by a
    constant (all dimensions dynamic made the backward's per-element index arithmetic its cost: 1.8 ms a
    2,048 x 151,936 chunk on an H200, about six times what reading and writing it takes)."""
    def flat(*args):
        shape = args[1].shape  # the targets' (rows, R)
        flat_args = [a.flatten(0, 1) if isinstance(a, Tensor) else a for a in args]
        for a in flat_args:
            if isinstance(a, Tensor):
                torch._dynamo.maybe_mark_dynamic(a, 0)
        out = fn(*flat_args)
        if isinstance(out, Tensor):  # the backward: the logits' gradient
            return out.view(*shape, out.shape[-1])
        return tuple(o.view(shape) if o is not None else None for o in out)
    return flat


def _row_chunks(n_rows: int, response_len: int) -> list[slice]:
    rows = max(1, LOG_PROB_CHUNK_TOKENS // max(response_len, 1))
    return [slice(start, start + rows) for start in range(0, n_rows, rows)]


def _chunked_forward(chunk_logits: Callable[[slice], Tensor], targets: Tensor, temperature: float,
                     with_entropy: bool, forward_fn: Callable) -> tuple[Tensor, Tensor | None, Tensor]:
    """forward_fn over the rows of targets (b, R) a chunk at a time, chunk_logits(rows) giving that chunk's
    logits; the chunks' (b, R) log-probs, entropies (None unless with_entropy) and log-normalisers."""
    parts = [forward_fn(chunk_logits(c), targets[c], temperature, with_entropy)
             for c in _row_chunks(targets.shape[0], targets.shape[1])]
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]) if with_entropy else None,
            torch.cat([p[2] for p in parts]))


class _VocabPass(torch.autograd.Function):
    """Log-probs and entropies by chunks of rows, keeping only the logits and two (rows, R) vectors for
    backward, which recomputes the softmax chunk by chunk into the logits' gradient."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, fns):
        forward_fn, backward_fn = fns
        log_prob, entropy, lse = _chunked_forward(logits.__getitem__, targets, temperature, with_entropy, forward_fn)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.backward_fn = temperature, backward_fn
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        if grad_log_prob is None:
            grad_log_prob = torch.zeros_like(lse)
        grad = torch.empty_like(logits)
        for c in _row_chunks(logits.shape[0], logits.shape[1]):
            grad[c] = ctx.backward_fn(logits[c], targets[c], ctx.temperature, lse[c],
                                      None if grad_entropy is None else entropy[c], grad_log_prob[c],
                                      None if grad_entropy is None else grad_entropy[c])
        return grad, None, None, None, None


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, entropy_grad: bool = False, compiled: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of `targets` (b, R) under softmax((b, R, V) logits / temperature),
    as fp32 (b, R) tensors; logits in any dtype.

    The fp32 log-softmax of a whole micro-batch would be the largest tensor of a step (b x R x 151,936 x 4
    bytes for Qwen3): this works LOG_PROB_CHUNK_TOKENS positions at a time and, under autograd, keeps
    nothing of a chunk but its log-normaliser, recomputing the softmax in backward. The entropy carries a
    gradient only with entropy_grad (an entropy bonus). `compiled` fuses each chunk's pass (GPUs).
    """
    fns = _compiled_vocab_pass() if compiled else (_vocab_forward, _vocab_backward)
    if torch.is_grad_enabled() and logits.requires_grad:
        log_prob, entropy = _VocabPass.apply(logits, targets, temperature, with_entropy, fns)
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()
        return log_prob, entropy
    return _chunked_forward(logits.__getitem__, targets, temperature, with_entropy, fns[0])[:2]


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b for an fp32 acc (m, n) and a (m, k), b (k, n) in the model's dtype.

    On a GPU with bf16 or fp16 factors the matmul writes fp32 into acc directly (cuBLAS adds into its
    output), so the product is never rounded to 16 bits and no cast and add run after it (timed by
    `bench/vocab_pass_check.py`). PyTorch has that form only on CUDA.
    """
    if acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += (a @ b).float()


class _HeadVocabPass(torch.autograd.Function):
    """The output head's matmul fused with the vocabulary pass, a chunk of rows at a time: neither the
    logits nor their gradient ever exist for the whole micro-batch, only for one chunk. Backward
    recomputes a chunk's logits (one more matmul) and turns their gradient into the hidden states' and
    the head weight's at once."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, fns):
        forward_fn, backward_fn = fns
        log_prob, entropy, lse = _chunked_forward(lambda c: hidden[c] @ weight.T, targets, temperature, with_entropy,
                                                  forward_fn)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.backward_fn = temperature, backward_fn
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        if grad_log_prob is None:
            grad_log_prob = torch.zeros_like(lse)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # The weight's gradient sums over every chunk: kept in fp32 so the chunks' products add up as one
        # matmul's would.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for c in _row_chunks(hidden.shape[0], hidden.shape[1]):
            grad_logits = ctx.backward_fn(hidden[c] @ weight.T, targets[c], ctx.temperature, lse[c],
                                          None if grad_entropy is None else entropy[c], grad_log_prob[c],
                                          None if grad_entropy is None else grad_entropy[c])
            if grad_hidden is not None:
                grad_hidden[c] = grad_logits @ weight
            if grad_weight is not None:
                _add_product(grad_weight, grad_logits.flatten(0, 1).T, hidden[c].flatten(0, 1))
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None)


def head_token_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                         with_entropy: bool = False, entropy_grad: bool = False, compiled: bool = False
                         ) -> tuple[Tensor, Tensor | None]:
    """token_log_probs(hidden @ weight.T, ...) without the whole (b, R, V) logits or their gradient:
    the head's matmul runs a chunk of rows at a time inside the vocabulary pass.

    hidden (b, R, H) the states that predict `targets` (b, R); weight (V, H) a bias-free output head.
    Returns fp32 (b, R) log-probs and entropies (None unless with_entropy); gradients reach both hidden
    and weight.
    """
    fns = _compiled_vocab_pass() if compiled else (_vocab_forward, _vocab_backward)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        log_prob, entropy = _HeadVocabPass.apply(hidden, weight, targets, temperature, with_entropy, fns)
        if entropy is not None and not entropy_grad:
            entropy = entropy.detach()
        return log_prob, entropy
    return _chunked_forward(lambda c: hidden[c] @ weight.T, targets, temperature, with_entropy, fns[0])[:2]
