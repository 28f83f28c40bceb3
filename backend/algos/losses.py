"""Losses: aggregation of per-token losses, KL estimators and controllers, the PPO policy losses,
rollout correction weights, the value loss and entropy.

Pure torch functions on (batch, response_len) tensors: no I/O, no config objects. Policy losses sit in a
small registry so the trainer picks one by name; an unknown name fails with the list of known ones.
"""

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from backend.algos.masked import bool_mask, masked_mean, masked_sum, masked_var

# ---- loss aggregation ----

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar, as verl 0.9.1's ``agg_loss`` does.

    With N = num_tokens (default sum_{i,t} m_it), S = num_seqs (default: rows with a valid token) and
    F = loss_scale_factor (default T = loss_mat.shape[-1], the padded width):

    token-mean:              sum_{i,t} L_it m_it / N
    token-sum:               sum_{i,t} L_it m_it
    seq-mean-token-sum:      sum_i (sum_t L_it m_it) / S
    seq-mean-token-mean:     sum_i (sum_t L_it m_it / sum_t m_it) / S
    seq-mean-token-sum-norm: sum_i (sum_t L_it m_it) / S / F (Dr.GRPO: Liu et al. 2025, "Understanding
                             R1-Zero-Like Training", a constant in place of each response's length)

    The sums over i run over rows with at least one valid token, so an empty row neither adds a term nor
    counts in S. Passing the mini-batch's global N and S (every micro-batch, every rank) makes the sum of
    the micro-batches' results the loss of the whole mini-batch, each token or row weighing the same
    whichever micro-batch it falls in; without them the counts are this batch's own. Averaging gradients
    over ranks is the caller's business.

    Args:
        loss_mat: (batch, response_len) per-token loss.
        loss_mask: (batch, response_len), 1 for real response tokens, 0 for padding.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        num_tokens: N for token-mean, a number or a 0-dim tensor; None counts this batch's valid tokens.
        num_seqs: S for the seq-mean modes; None counts this batch's non-empty rows.
        loss_scale_factor: F for seq-mean-token-sum-norm (> 0); None is the padded width T.

    A count of 0 (an all-empty batch) divides by 1, so the result is 0, never NaN.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known modes: {', '.join(LOSS_AGG_MODES)}")
    if loss_scale_factor is not None and loss_scale_factor <= 0:
        raise ValueError(f"loss_scale_factor={loss_scale_factor} must be > 0: the seq-mean-token-sum-norm loss is "
                         "divided by it (None: the padded response length)")
    mask = bool_mask(loss_mask)
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask)
    if loss_agg_mode == "token-mean":
        return masked_sum(loss_mat, mask) / _count(mask.sum() if num_tokens is None else num_tokens, loss_mat)
    non_empty = mask.any(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked_mean(loss_mat, mask, dim=-1)
    else:
        seq_losses = masked_sum(loss_mat, mask, dim=-1)
    loss = masked_sum(seq_losses, non_empty) / _count(non_empty.sum() if num_seqs is None else num_seqs, loss_mat)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _count(count: float | Tensor, like: Tensor) -> Tensor:
    """A divisor as a tensor of ``like``'s dtype and device, at least 1."""
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp_min(1)


# ---- KL penalty ----

KL_TYPES: tuple[str, ...] = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "k1+", "kl+", "k3+", "low_var_kl+")


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kl_type: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman 2020, "Approximating
    KL Divergence").

    k1 / kl:          logp - ref
    k2 / mse:         0.5 * (logp - ref)^2
    k3 / low_var_kl:  exp(r) - r - 1 with r = ref - logp, clamped to [-10, 10]
    abs:              |logp - ref|
    k1+, k3+ (kl+, low_var_kl+): straight-through, as verl 0.9.1: the value of k1 or k3 (with its clamps),
                      the gradient of k2: k2 - sg(k2) + sg(base). d k2 / d logp = logp - ref, which for
                      tokens sampled from pi averages to the gradient of KL(pi || pi_ref) itself (Tang and
                      Munos 2025, "On a Few Pitfalls in KL Divergence Gradient Estimation for RL").

    This differs from verl: verl strips a trailing "+" from any type, so it also takes "k2+", "mse+" (the
    same as k2) and "abs+", which are refused here.

    Args:
        log_probs: (batch, response_len) log-probs of the sampled tokens under the policy.
        ref_log_probs: (batch, response_len) the same under the reference model.
        kl_type: one of ``KL_TYPES``.

    Returns (batch, response_len); padding is not masked here, callers mask it.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl_type {kl_type!r}; known types: {', '.join(KL_TYPES)}")
    base = _kl_value(log_probs, ref_log_probs, kl_type.removesuffix("+"))
    if not kl_type.endswith("+"):
        return base
    k2 = 0.5 * (log_probs - ref_log_probs).square()
    return k2 - k2.detach() + base.detach()


def _kl_value(log_probs: Tensor, ref_log_probs: Tensor, kl_type: str) -> Tensor:
    """One of the plain estimators of ``kl_penalty``, by a name without "+"."""
    if kl_type in ("k1", "kl"):
        return log_probs - ref_log_probs
    if kl_type in ("k2", "mse"):
        return 0.5 * (log_probs - ref_log_probs).square()
    if kl_type in ("k3", "low_var_kl"):
        # Clamping r to [-20, 20] changes no value (|r| >= 20 lands on the 10 clamp anyway), but keeps
        # exp(r) finite so the backward pass never multiplies the clamp's zero gradient by inf.
        r = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
        return (torch.exp(r) - r - 1).clamp(-10.0, 10.0)
    return (log_probs - ref_log_probs).abs()


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
    mask = bool_mask(response_mask)
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

# ---- policy losses ----

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}
# The keyword options the actor passes to every policy loss.
POLICY_LOSS_OPTIONS: tuple[str, ...] = (
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "loss_agg_mode",
    "rollout_is_weights",
    "num_tokens",
    "num_seqs",
    "loss_scale_factor",
)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator that registers a policy loss under ``name``.

    The function is called as fn(old_log_probs, log_probs, advantages, response_mask, **options) and
    returns (scalar loss, metrics dict of detached 0-dim tensors), like ``compute_policy_loss``. Among
    the options, ``rollout_is_weights`` ((batch, response_len) or None, see ``rollout_is_weights``)
    multiplies the per-token loss before aggregation, and ``num_tokens``, ``num_seqs`` and
    ``loss_scale_factor`` go to ``agg_loss``. A function that does not take every option in
    ``POLICY_LOSS_OPTIONS`` (by name, or through ``**options``) is refused here, not at its first call.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        params = inspect.signature(fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            missing = [option for option in POLICY_LOSS_OPTIONS if option not in params]
            if missing:
                raise TypeError(f"policy loss {name!r} does not take {', '.join(missing)}, which the actor "
                                f"passes to every policy loss; take them as keywords or through **options")
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
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
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
        num_tokens, num_seqs, loss_scale_factor: the mini-batch's counts and the norm constant, passed to
            ``agg_loss`` (None: this batch's own counts, the padded width).

    Returns (loss, metrics): "actor/pg_clipfrac" (share of valid tokens the ratio clip bound),
    "actor/ppo_kl" (mean of old - logp), "actor/pg_clipfrac_lower" (share where the dual clip bound), as
    detached 0-dim tensors: reading one waits for the device, so callers read them once per optimizer step.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1: it bounds the loss at -A * clip_ratio_c")
    mask = bool_mask(response_mask)
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

    loss = agg_loss(pg_losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    loss_scale_factor=loss_scale_factor)
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
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
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
        num_tokens, num_seqs, loss_scale_factor: passed to ``agg_loss``, as in ``compute_policy_loss``.

    Returns (loss, metrics): "actor/pg_clipfrac" (share of valid tokens the clip bound), "actor/ppo_kl"
    (mean of old - logp over valid tokens), "actor/pg_clipfrac_lower" (always 0: no dual clip), as
    detached 0-dim tensors. A row without valid tokens has s = 1 and adds nothing.
    """
    mask = bool_mask(response_mask)
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

    loss = agg_loss(pg_losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        clipfrac = masked_mean((pg_losses2 > pg_losses1).float(), mask)
        metrics = {
            "actor/pg_clipfrac": clipfrac,
            "actor/ppo_kl": masked_mean(-log_ratio, mask),
            "actor/pg_clipfrac_lower": torch.zeros_like(clipfrac),
        }
    return loss, metrics


# ---- rollout correction: the sampling engine against the trainer ----


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
    mask = bool_mask(response_mask)
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


# ---- value loss ----


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
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
        num_tokens, num_seqs, loss_scale_factor: the mini-batch's counts and the norm constant, passed to
            ``agg_loss`` (None: this batch's own counts, the padded width).

    Returns (loss, metrics): "critic/vf_loss" (the loss), "critic/vf_clipfrac" (share of valid tokens where
    the clipped term is the larger), "critic/vpred_mean" (mean of vpreds over valid tokens), as detached
    0-dim tensors.
    """
    if cliprange_value < 0:
        raise ValueError(
            f"cliprange_value={cliprange_value} must be >= 0: it is how far a value prediction may move "
            "from the rollout's value; set it large to turn value clipping off"
        )
    mask = bool_mask(response_mask)
    # As in compute_policy_loss: padding leaves the graph before any garbage can meet a zero gradient.
    vpreds = torch.where(mask, vpreds, 0)
    returns = torch.where(mask, returns, 0)
    values = torch.where(mask, values, 0)

    vpred_clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpred_clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), mask, loss_agg_mode, num_tokens=num_tokens,
                          num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
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
    mask = bool_mask(mask)
    with torch.no_grad():
        var_returns = masked_var(returns, mask, unbiased=False)
        var_residual = masked_var(returns - values, mask, unbiased=False)
        has_variance = var_returns > 0
        ratio = var_residual / torch.where(has_variance, var_returns, 1)
        return torch.where(has_variance, 1 - ratio, 0)


# ---- entropy ----


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

