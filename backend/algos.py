"""Core RL algorithms: loss aggregation, KL penalties, advantage estimators and policy losses.

Everything here is a pure torch function on (batch, response_len) tensors: no I/O, no config objects.
A mask marks real response tokens with 1 (or True) and padding with 0 (or False). Padded positions are
selected away with ``torch.where`` rather than multiplied by zero, so even inf or NaN left in the padding
cannot reach a result or a gradient.

Advantage estimators and policy losses sit in small registries so the trainer picks them by name; an
unknown name fails with the list of known ones.
"""

import inspect
from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import Tensor

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
# ---- advantage estimators ----
# =====================================================================================================

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]

# Everything compute_advantage can hand an estimator; each estimator declares the subset it uses.
_ADVANTAGE_INPUTS = (
    "token_level_rewards",
    "response_mask",
    "group_ids",
    "values",
    "gamma",
    "lam",
    "epsilon",
    "norm_adv_by_std",
)
_ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator that registers an advantage estimator under ``name``.

    The function takes keyword arguments named from token_level_rewards, response_mask, group_ids,
    values, gamma, lam, epsilon, norm_adv_by_std (only those it declares are passed) and returns
    (advantages, returns), both (batch, response_len).
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


# =====================================================================================================
# ---- policy losses ----
# =====================================================================================================

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, float]]]
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator that registers a policy loss under ``name``.

    The function is called as fn(old_log_probs, log_probs, advantages, response_mask, **options) and
    returns (scalar loss, metrics dict of python floats), like ``compute_policy_loss``.
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
) -> tuple[Tensor, dict[str, float]]:
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

    Returns (loss, metrics): "actor/pg_clipfrac" (share of valid tokens the ratio clip bound),
    "actor/ppo_kl" (mean of old - logp), "actor/pg_clipfrac_lower" (share where the dual clip bound).
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

    loss = agg_loss(pg_losses, mask, loss_agg_mode)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((pg_losses2 > pg_losses1).float(), mask).item(),
            "actor/ppo_kl": masked_mean(-log_ratio, mask).item(),
            "actor/pg_clipfrac_lower": masked_mean((negative & (clipped_losses > pg_losses3)).float(), mask).item(),
        }
    return loss, metrics


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

LOG_PROB_CHUNK_TOKENS = 2048  # response positions whose fp32 log-softmax is computed at once


def _chunk_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[target]: (rows, R, V) logits, (rows, R) targets -> (rows, R)."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, entropy_grad: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of `targets` (b, R) under (b, R, V) logits in any dtype.

    The fp32 log-softmax of a whole micro-batch is the largest tensor of a step (b x R x 151,936 x 4
    bytes for Qwen3): this works a few rows at a time, and under autograd recomputes each chunk in
    backward instead of keeping its fp32 copies, so only the logits themselves stay alive.
    """
    rows = max(1, LOG_PROB_CHUNK_TOKENS // max(targets.shape[1], 1))
    lps, ents = [], []
    for start in range(0, targets.shape[0], rows):
        lg, tg = logits[start:start + rows], targets[start:start + rows]
        if torch.is_grad_enabled():
            lps.append(torch.utils.checkpoint.checkpoint(_chunk_log_probs, lg, tg, temperature, use_reentrant=False))
        else:
            lps.append(_chunk_log_probs(lg, tg, temperature))
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ents.append(entropy_from_logits(lg.float() / temperature))
    return torch.cat(lps), torch.cat(ents) if with_entropy else None
