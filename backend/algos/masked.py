"""Masked tensor helpers every RL formula here uses.

A mask marks real response tokens with 1 (or True) and padding with 0 (or False). Padded positions are
selected away with ``torch.where`` rather than multiplied by zero, so even inf or NaN left in the padding
cannot reach a result or a gradient.
"""

import torch
from torch import Tensor


def bool_mask(mask: Tensor) -> Tensor:
    """The mask as bool, whatever dtype it came in."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of the masked-in entries (mask already bool); ``dim=None`` reduces everything."""
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
    mask = bool_mask(mask)
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp_min(1).to(total.dtype)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all masked-in entries: mean((values - mean)^2), times n/(n-1) when ``unbiased``.

    Args:
        values: any shape, e.g. (batch, response_len).
        mask: same shape as ``values``.

    Returns a scalar. With fewer than two valid entries the variance is 0 (no Bessel correction, no NaN).
    """
    mask = bool_mask(mask)
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
    mask = bool_mask(mask)
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0)


