"""Advantage estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++, GAE, ReMax) in a registry, and DAPO's
reward shaping and dynamic-sampling test.

Pure torch functions on (batch, response_len) tensors: no I/O, no config objects. The trainer picks an
estimator by name; an unknown name fails with the list of known ones.
"""

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from backend.algos.masked import bool_mask, masked_sum, masked_whiten

# ---- DAPO reward shaping and dynamic sampling ----


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


# ---- advantage estimators ----

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
    mask = bool_mask(response_mask)
    return torch.where(mask, advantages, 0), torch.where(mask, returns, 0)


def _sequence_scores(token_level_rewards: Tensor, mask: Tensor) -> Tensor:
    """(batch,) sum of the token rewards over valid tokens."""
    return masked_sum(token_level_rewards, mask, dim=-1)


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
    mask = bool_mask(response_mask)
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
    """RLOO: A_i = s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean_g(s)) (Ahmadian et al. 2024, "Back to
    Basics: Revisiting REINFORCE Style Optimization").

    A group of one has no other response to make a baseline of, so its baseline is 0 and A = s, as verl
    0.9.1's default "rloo" does (its "rloo_vectorized" gives such a group 0 instead).

    Args:
        token_level_rewards: (batch, response_len).
        response_mask: (batch, response_len).
        group_ids: (batch,) prompt id of each response.

    Returns (advantages, returns), both (batch, response_len); returns are the advantages.
    """
    mask = bool_mask(response_mask)
    scores = _sequence_scores(token_level_rewards, mask)
    mean, _, counts = _group_stats(scores, group_ids)
    n = counts.to(scores.dtype)
    # _group_stats gives a group of one mean 0, so the same formula keeps its score: 1/1 * (s - 0).
    scores = (scores - mean) * n / (n - 1).clamp_min(1)
    advantages = _broadcast(scores, mask)
    return advantages, advantages


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: G_t = r_t + gamma * G_{t'} over valid tokens, t' the next valid token after t (0 past
    the last), then A = whiten(G) over every valid token of the batch (Hu 2025, "REINFORCE++").

    As verl 0.9.1 does, a masked-out position inside a response (a multi-turn episode's observation
    tokens) is stepped over: it adds no reward and no discount, and the return flows through it to the
    tokens before it. Its own return and advantage are 0.

    Args:
        token_level_rewards: (batch, response_len).
        response_mask: (batch, response_len), 1 for the tokens the policy generated.
        gamma: discount, applied once per valid token.

    Returns (advantages, returns): whitened and raw returns-to-go, both (batch, response_len).
    """
    mask = bool_mask(response_mask)
    running = torch.zeros_like(token_level_rewards[:, 0])
    returns_reversed = []
    for t in reversed(range(token_level_rewards.shape[1])):
        running = torch.where(mask[:, t], token_level_rewards[:, t] + gamma * running, running)
        returns_reversed.append(torch.where(mask[:, t], running, 0))
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
    mask = bool_mask(response_mask)
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
    mask = bool_mask(response_mask)
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
    mask = bool_mask(response_mask)
    rewards = torch.where(mask, token_level_rewards, 0)
    returns = torch.where(mask, rewards.flip(-1).cumsum(-1).flip(-1), 0)
    advantages = torch.where(mask, returns - reward_baselines.unsqueeze(-1), 0)
    return advantages, returns


