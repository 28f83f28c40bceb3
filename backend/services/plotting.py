"""Static charts of run metrics for documents: one PNG per metric, one line per run.

The UI draws live charts with plotly; this module draws the same metrics.jsonl into files that a
README or docs/ page can embed (`python -m backend plot`). Matplotlib's Agg backend needs no display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from backend.core.runs import read_metrics


class PlotError(ValueError):
    """A run or metric that cannot be drawn; the message names it and what exists."""


def series(run_dir: str | Path, metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric` in a run's metrics.jsonl, in step order; steps without it are skipped.

    A resumed run may log a step twice; the later line wins, as in the UI's charts."""
    by_step: dict[int, float] = {}
    for line in read_metrics(run_dir):
        value = line.get(metric)
        if isinstance(value, int | float) and not isinstance(value, bool):
            by_step[int(line["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_metric(runs: Sequence[str | Path], metric: str, out: str | Path, *,
                labels: Sequence[str] | None = None, title: str | None = None,
                smooth: int = 1, max_step: int | None = None) -> Path:
    """Draw `metric` against step for each run into `out` (PNG, or SVG by its suffix) and return it.

    `smooth` > 1 draws a trailing mean over that many logged points, with the raw values faint behind;
    `max_step` cuts every run there, so runs of different lengths compare over the same steps.
    Raises PlotError when a run directory has no metrics.jsonl or no run logged the metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels) if labels else [Path(r).name for r in runs]
    if len(labels) != len(runs):
        raise PlotError(f"{len(labels)} labels for {len(runs)} runs; give one label per run")
    if smooth < 1:
        raise PlotError(f"smooth must be at least 1 (1 = raw values), got {smooth}")
    drawn: list[tuple[str, list[int], list[float]]] = []
    for run, label in zip(runs, labels, strict=True):
        if not (Path(run) / "metrics.jsonl").is_file():
            raise PlotError(f"{run} has no metrics.jsonl: point at a run directory (runs/<id>)")
        steps, values = series(run, metric)
        if max_step is not None:
            values = [v for s, v in zip(steps, values, strict=True) if s <= max_step]
            steps = steps[:len(values)]
        if steps:
            drawn.append((label, steps, values))
    if not drawn:
        known = sorted({k for r in runs for line in read_metrics(r) for k in line if k != "step"})
        hint = ", ".join(k for k in known if "/" in k and not k.startswith(("timing_s", "perf"))) or "none"
        upto = f" up to step {max_step}" if max_step is not None else ""
        raise PlotError(f"no run logged {metric!r}{upto}; metrics these runs have: {hint}")

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for label, steps, values in drawn:
        if smooth > 1:
            line, = ax.plot(steps, _smooth(values, smooth), label=label, linewidth=1.8)
            ax.plot(steps, values, color=line.get_color(), alpha=0.25, linewidth=0.8)
        else:
            ax.plot(steps, values, label=label, linewidth=1.8, marker="o" if len(steps) <= 30 else None,
                    markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(metric + (f" (mean of {smooth})" if smooth > 1 else ""))
    ax.set_title(title or metric)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
