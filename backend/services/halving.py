"""Successive halving that judges a rung once every running trial has reached it.

Rungs sit at `min_steps x 4^k` steps. At each, the best quarter of the values logged there goes on (at least
the best one) and the rest stop: Optuna's rule (`SuccessiveHalvingPruner`, reduction factor 4). Optuna applies
it the moment a trial reports a rung, against the trials that reported it earlier (asynchronous successive
halving, Li et al. 2020). When a sweep runs its trials at once, arrival order then decides: trials with smaller
groups reach a rung first and go on as the best so far, while a better but slower trial arrives later, is
measured against more, and stops. Here the trials that reach a rung while others are still on their way wait
for them and are ranked together, as synchronous successive halving ranks a whole rung (Jamieson and Talwalkar
2016; Hyperband's brackets). A trial judged alone, with no other trial running, meets Optuna's rule exactly.
Waiting trials keep training: a rung's verdict costs them steps, never a pause.
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
    best `kept` of the `of` values logged at that rung."""

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


def judge(trials: list[RungTrial], min_steps: int, maximize: bool) -> list[Verdict]:
    """The verdicts due now, lowest rung first. A rung is due once every running trial has reached it (or passed
    it); the running trials waiting there are ranked with every value already counted at that rung: the values
    trials were judged on, and those of trials that ended (completed or stopped by hand) without a verdict."""
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
            kept = max(1, len(values) // REDUCTION_FACTOR)
            bar = sorted(values, reverse=maximize)[kept - 1]
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
