"""Successive halving that judges a rung once every running trial has reached it.

Rungs sit at `min_steps x 4^k` steps. Of a sweep of N trials, the best N/4 at the first rung go on, the best
N/16 at the second, and so on (at least one): synchronous successive halving's quota (Jamieson and Talwalkar
2016; Hyperband's brackets). A trial is judged against the values logged at its rung so far, and goes on while
it is among the best of the quota there; so a trial within the quota of the whole rung is never stopped, however
the trials arrive. Trials that reach a rung while other running trials are still on their way wait for them,
training on, and are ranked together: with all of a sweep's trials at once that is exactly the synchronous rule,
and with trials queued it spares the steps of trials that would go on only for having arrived first.

Optuna's `SuccessiveHalvingPruner` takes the quota from the values so far instead (asynchronous successive
halving, Li et al. 2020): the first of eight trials at a rung goes on as the best so far, and one arriving sixth
must beat all five before it, so arrival order decides which settings survive when trials run at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REDUCTION_FACTOR = 4


@dataclass(frozen=True)
class RungTrial:
    """What the rule knows of one trial: its metric by step (`curve`), the values it was judged on at the rungs
    it passed (`judged`, rung 0 first), whether it still runs, and whether its later values may count
    (`counts`: not for a failed trial, nor one stopped at a rung, whose later steps are not a rung's result)."""

    number: int
    curve: dict[int, float]
    judged: list[float] = field(default_factory=list)
    running: bool = False
    counts: bool = True


@dataclass(frozen=True)
class Verdict:
    """Trial `number`, judged at `rung` (step `rung_step`) on `value`: it goes on, or stops, being outside the
    best `kept` (the rung's quota) of the `of` values logged at that rung so far."""

    number: int
    rung: int
    rung_step: int
    value: float
    goes_on: bool
    kept: int
    of: int


def rung_step(rung: int, min_steps: int) -> int:
    return min_steps * REDUCTION_FACTOR ** rung


def value_at(curve: dict[int, float], step: int) -> float | None:
    """The first value logged at `step` or after (a trial cloned from a checkpoint starts beyond early rungs)."""
    later = [s for s in curve if s >= step]
    return curve[min(later)] if later else None


def quota(total: int, rung: int) -> int:
    """How many of a sweep of `total` trials go on from `rung`: total / 4^(rung + 1), at least one."""
    return max(1, total // REDUCTION_FACTOR ** (rung + 1))


def judge(trials: list[RungTrial], min_steps: int, maximize: bool, total: int) -> list[Verdict]:
    """The verdicts due now in a sweep of `total` trials, lowest rung first. A rung is due once every running
    trial has reached it (or passed it); the running trials waiting there are ranked with every value already
    counted at that rung (the values trials were judged on, and those of trials that ended, completed or
    stopped by hand, without a verdict), and those among the rung's quota of best values go on."""
    judged = {t.number: list(t.judged) for t in trials}
    alive = [t for t in trials if t.running]
    verdicts: list[Verdict] = []
    rung = 0
    # Every trial still running has passed the rungs below `rung`.
    while alive:
        step = rung_step(rung, min_steps)
        here = [t for t in alive if len(judged[t.number]) == rung]
        if any(value_at(t.curve, step) is None for t in here):
            return verdicts  # one is still on its way: this rung, and every rung above it, waits
        if here:
            waiting = {t.number for t in here}
            values = [v for t in trials if t.number not in waiting
                      and (v := _counted(t, judged[t.number], rung, step)) is not None]
            values += [value_at(t.curve, step) for t in here]
            kept = quota(total, rung)
            bar = sorted(values, reverse=maximize)[min(kept, len(values)) - 1]
            for t in here:
                value = value_at(t.curve, step)
                goes_on = value >= bar if maximize else value <= bar
                verdicts.append(Verdict(t.number, rung, step, value, goes_on, kept, len(values)))
                judged[t.number].append(value)
                if not goes_on:
                    alive.remove(t)
        rung += 1
    return verdicts


def _counted(t: RungTrial, judged: list[float], rung: int, step: int) -> float | None:
    if rung < len(judged):
        return judged[rung]
    if t.running or not t.counts:
        return None
    return value_at(t.curve, step)
