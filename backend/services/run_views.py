"""Views over several runs for the Runs page: metric series smoothed as TensorBoard smooths them, and
the settings that differ between runs' configs."""

from __future__ import annotations

import math
from typing import Any


def smooth(values: list[float | None], weight: float) -> list[float | None]:
    """Exponential moving average as TensorBoard draws it, debiased so the start is not pulled to 0:

        last = weight * last + (1 - weight) * v;   smoothed = last / (1 - weight ** n_seen)

    None (a step without the metric) and non-finite values pass through and do not count.
    `weight` is in [0, 1); 0 returns the values unchanged."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight {weight} must be at least 0 and below 1")
    out: list[float | None] = []
    last, seen = 0.0, 0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(v)
            continue
        last = weight * last + (1.0 - weight) * v
        seen += 1
        out.append(last / (1.0 - weight ** seen))
    return out


def config_diff(configs: dict[str, dict | None]) -> dict[str, dict[str, object]]:
    """The settings that differ between runs: {dotted key: {run name: value}}, keys sorted. A key that
    a run's config lacks reads as None for that run; lists compare as whole values."""
    flat = {run: _flatten(cfg or {}) for run, cfg in configs.items()}
    missing = object()
    keys = sorted({k for f in flat.values() for k in f})
    out: dict[str, dict[str, object]] = {}
    for key in keys:
        values = {run: f.get(key, missing) for run, f in flat.items()}
        first = next(iter(values.values()))
        if any(v is not first and v != first for v in values.values()):
            out[key] = {run: None if v is missing else v for run, v in values.items()}
    return out


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
