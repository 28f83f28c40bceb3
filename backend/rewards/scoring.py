"""Scoring a batch: every row in isolation, each response's score and its parts.

`score_batch` scores every row in isolation: a scorer that raises, returns something that is not a
finite number, or runs past `timeout_s` scores 0.0 for that row, is counted in a metric, and the
batch goes on. A hung Python function cannot be killed from outside; its thread is a daemon thread
that is abandoned (left running until it returns or the process exits).
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from backend.rewards.registry import RewardError, get_scorer
from backend.rewards.rules import GSM8K_SCORERS, gsm8k_score

logger = logging.getLogger(__name__)

# Rows scored at once. Scoring is mostly regex work under the GIL, so more threads buy nothing; the
# pool exists so that one hung row does not hold up the others.
_MAX_WORKERS = 16


# ---- batch scoring ----

@dataclass
class ScoredBatch:
    """Per-row scores, their numeric parts and extracted answers, and the batch's reward metrics."""

    scores: list[float]
    parts: list[dict[str, float]]
    preds: list[str | None]
    metrics: dict[str, float]
    first_error: str | None = None


def weighted_sum(terms: list[tuple[str, float, ScoredBatch]]) -> ScoredBatch:
    """Several scorers' batches as one: score_i = sum_k w_k s_k,i. The first term is the rule scorer (its
    parts, predictions and first error stay); every other term's score joins each row's parts under its
    name and is logged as reward/<name>/mean. Failure counts add up over all terms.

    terms: (name, weight, batch) with batches of equal length; at least one.
    """
    n = len(terms[0][2].scores)
    scores = [sum(weight * batch.scores[i] for _, weight, batch in terms) for i in range(n)]
    first_name, _, first = terms[0]
    parts = [dict(p) for p in first.parts]
    metrics = dict(first.metrics)
    for name, _, batch in terms[1:]:
        for i in range(n):
            parts[i][name] = batch.scores[i]
        metrics[f"reward/{name}/mean"] = sum(batch.scores) / max(n, 1)
        for key in ("reward/errors", "reward/timeouts", "reward/invalid"):
            metrics[key] = metrics.get(key, 0.0) + batch.metrics.get(key, 0.0)
    first_error = next((b.first_error for _, _, b in terms if b.first_error), None)
    return ScoredBatch(scores=scores, parts=parts, preds=list(first.preds), metrics=metrics, first_error=first_error)


def from_scores(scores: list[float]) -> ScoredBatch:
    """A scored batch of plain numbers (a reward model's, or zeros where no rule scores): no parts, no
    predictions, no failures."""
    return ScoredBatch(scores=list(scores), parts=[{} for _ in scores], preds=[None] * len(scores),
                       metrics={"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/invalid": 0.0})


def concat_scored(parts: list[tuple[ScoredBatch, list[int]]]) -> ScoredBatch:
    """The chosen rows of several scored batches as one. Failure counts are those of every row scored
    (a failure in a dropped row still happened); part means are over the chosen rows."""
    scores, row_parts, preds = [], [], []
    metrics = {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/invalid": 0.0}
    for scored, rows in parts:
        scores += [scored.scores[i] for i in rows]
        row_parts += [scored.parts[i] for i in rows]
        preds += [scored.preds[i] for i in rows]
        for key in metrics:
            metrics[key] += scored.metrics[key]
    sums: dict[str, list[float]] = {}
    for part in row_parts:
        for key, value in part.items():
            sums.setdefault(key, []).append(value)
    metrics.update({f"reward/{key}/mean": sum(v) / len(v) for key, v in sums.items()})
    first_error = next((s.first_error for s, _ in parts if s.first_error), None)
    return ScoredBatch(scores=scores, parts=row_parts, preds=preds, metrics=metrics, first_error=first_error)


@dataclass
class _Outcome:
    kind: str  # "ok" | "error" | "invalid" | "timeout"
    score: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    pred: str | None = None
    message: str | None = None


def _as_finite(value: Any) -> float | None:
    if isinstance(value, (str, bytes)) or value is None:
        return None
    if not isinstance(value, numbers.Real) and not hasattr(type(value), "__float__"):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _interpret(value: Any, who: str, row: int) -> _Outcome:
    if isinstance(value, dict):
        score = _as_finite(value.get("score"))
        if score is None:
            return _Outcome("invalid", message=(
                f"{who} returned a dict whose 'score' is {_describe(value.get('score'))}, "
                f"not a finite number (row {row})"
            ))
        parts: dict[str, float] = {}
        for key, part in value.items():
            if key in ("score", "pred"):
                continue
            number = _as_finite(part)
            if number is not None:
                parts[str(key)] = number
        pred = value.get("pred")
        return _Outcome("ok", score, parts, None if pred is None else str(pred))
    score = _as_finite(value)
    if score is None:
        message = f"{who} returned {_describe(value)}, not a finite number (row {row})"
        return _Outcome("invalid", message=message)
    return _Outcome("ok", score)


def _run_rows(n: int, run_one: Callable[[int], _Outcome], timeout_s: float,
              on_timeout: Callable[[int], _Outcome], on_skip: Callable[[int], _Outcome]) -> list[_Outcome]:
    """Run `run_one(i)` for every row on a pool of daemon threads, each row under its own timeout.

    A row past its timeout gets `on_timeout(i)`; its thread is abandoned (it cannot be stopped) and a
    fresh worker takes over the remaining rows, so one hung row costs about `timeout_s` of wall time.
    Once as many rows have hung as there are workers, the scorer is hanging systematically: the rows
    not started yet get `on_skip(i)` instead of each waiting out its own timeout and leaving a thread.
    """
    cond = threading.Condition()
    pending = deque(range(n))
    results: list[_Outcome | None] = [None] * n
    started: dict[int, float] = {}  # row -> monotonic start time, rows in flight only
    abandoned: set[int] = set()
    done = 0
    workers = min(n, _MAX_WORKERS)

    def worker() -> None:
        nonlocal done
        while True:
            with cond:
                if not pending:
                    return
                i = pending.popleft()
                started[i] = time.monotonic()
                cond.notify_all()  # the watcher must learn of the new deadline
            outcome = run_one(i)
            with cond:
                if i in abandoned:
                    return  # already scored as a timeout; a replacement worker runs the rest
                del started[i]
                results[i] = outcome
                done += 1
                cond.notify_all()

    def start_worker() -> None:
        threading.Thread(target=worker, name="reward-scorer", daemon=True).start()

    with cond:
        for _ in range(workers):
            start_worker()
        while done < n:
            now = time.monotonic()
            for i, t0 in list(started.items()):
                if now - t0 < timeout_s:
                    continue
                del started[i]
                abandoned.add(i)
                results[i] = on_timeout(i)
                done += 1
                if len(abandoned) >= workers:
                    while pending:
                        j = pending.popleft()
                        results[j] = on_skip(j)
                        done += 1
                elif pending:
                    start_worker()
            if done >= n:
                break
            wait = None
            if started and math.isfinite(timeout_s):
                wait = max(0.0, min(started.values()) + timeout_s - now)
            cond.wait(wait)
    return [r for r in results if r is not None]


def _rule_scorer(data_source: str, gsm8k_scorer: str) -> Callable:
    """The registered scorer of `data_source`, with the chosen GSM8K rule in place of the built-in one."""
    scorer = get_scorer(data_source)
    return GSM8K_SCORERS[gsm8k_scorer] if scorer is gsm8k_score else scorer


def score_batch(
    data_sources: list[str],
    responses: list[str],
    ground_truths: list[str],
    extra_infos: list[dict | None] | None = None,
    *,
    custom_fn: Callable | None = None,
    gsm8k_scorer: str = "verl",
    timeout_s: float = 10.0,
    in_this_thread: bool = False,
) -> ScoredBatch:
    """Score each response with its data_source's scorer (or `custom_fn` for every row, as verl does).

    `gsm8k_scorer` names the rule for rows whose data_source is a GSM8K one (`rules.GSM8K_SCORERS`:
    "verl", verl 0.9.1's exact rule, the default of reward.gsm8k_scorer too; "lenient", ours, with
    partial credit). A scorer someone registered over the built-in one for a GSM8K source is kept.

    Every row is scored in isolation, concurrently on a small pool of daemon threads. A row whose
    scorer raises, returns something other than a finite number (None, a string, NaN, inf, a dict
    without a numeric "score"), or runs past `timeout_s` seconds scores 0.0, and the batch goes on.
    A hung Python function cannot be killed: its thread is abandoned and runs on in the background.
    If as many rows hang as there are worker threads, the rows not yet started score 0.0 as timeouts.
    `in_this_thread` scores the rows one after another in the calling thread, without timeouts: for a
    debugger (`python -m backend replay --pdb`), whose breakpoints stop only the thread it traces.
    An unknown data_source (without `custom_fn`) raises `RewardError` before anything is scored.

    Metrics: reward/errors (rows that raised), reward/timeouts, reward/invalid (non-number returns),
    and reward/<part>/mean for every numeric part returned (averaged over the rows that returned it).
    `first_error` is the message of the lowest-numbered failed row, or None.
    """
    n = len(responses)
    if extra_infos is None:
        extra_infos = [None] * n
    if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
        raise RewardError(
            f"score_batch: lists differ in length: data_sources={len(data_sources)}, responses={n}, "
            f"ground_truths={len(ground_truths)}, extra_infos={len(extra_infos)}"
        )
    if not timeout_s > 0:
        raise RewardError(f"score_batch: timeout_s must be > 0, got {timeout_s}")
    if gsm8k_scorer not in GSM8K_SCORERS:
        raise RewardError(f"score_batch: gsm8k_scorer={gsm8k_scorer!r} is not a GSM8K rule; choose one of: "
                          f"{', '.join(GSM8K_SCORERS)}")

    if custom_fn is not None:
        custom_name = getattr(custom_fn, "__name__", type(custom_fn).__name__)
        scorers: list[Callable] = [custom_fn] * n
        labels = [f"custom reward function '{custom_name}'"] * n
    else:
        by_source = {ds: _rule_scorer(ds, gsm8k_scorer) for ds in dict.fromkeys(data_sources)}
        scorers = [by_source[ds] for ds in data_sources]
        labels = [f"scorer for '{ds}'" for ds in data_sources]

    def run_one(i: int) -> _Outcome:
        try:
            value = scorers[i](
                data_source=data_sources[i],
                solution_str=responses[i],
                ground_truth=ground_truths[i],
                extra_info=extra_infos[i],
            )
            return _interpret(value, labels[i], i)
        except BaseException as exc:  # a user's scorer may raise anything, SystemExit included
            return _Outcome("error", message=f"{labels[i]} raised {type(exc).__name__}: {exc} (row {i})")

    def on_timeout(i: int) -> _Outcome:
        return _Outcome("timeout", message=(
            f"{labels[i]} ran past timeout_s={timeout_s:g} (row {i}); its thread cannot be stopped and is "
            "left running"
        ))

    def on_skip(i: int) -> _Outcome:
        return _Outcome("timeout", message=(
            f"{labels[i]} not run (row {i}): {min(n, _MAX_WORKERS)} rows of this batch already hung past "
            f"timeout_s={timeout_s:g}"
        ))

    outcomes = ([run_one(i) for i in range(n)] if in_this_thread
                else _run_rows(n, run_one, timeout_s, on_timeout, on_skip))

    counts = {kind: sum(o.kind == kind for o in outcomes) for kind in ("error", "timeout", "invalid")}
    metrics: dict[str, float] = {
        "reward/errors": float(counts["error"]),
        "reward/timeouts": float(counts["timeout"]),
        "reward/invalid": float(counts["invalid"]),
    }
    sums: dict[str, list[float]] = {}
    for o in outcomes:
        for key, value in o.parts.items():
            sums.setdefault(key, []).append(value)
    for key, values in sums.items():
        metrics[f"reward/{key}/mean"] = sum(values) / len(values)

    first_error = next((o.message for o in outcomes if o.kind != "ok"), None)
    failed = sum(counts.values())
    if failed:
        logger.warning("%d of %d reward rows scored 0 after a failure; first: %s", failed, n, first_error)
    return ScoredBatch(
        scores=[o.score for o in outcomes],
        parts=[o.parts for o in outcomes],
        preds=[o.pred for o in outcomes],
        metrics=metrics,
        first_error=first_error,
    )


class RewardSettings(Protocol):
    """What reward_terms reads of a config's reward section (backend.core.config.RewardConfig)."""

    rule_weight: float
    weights: list[float]
    gsm8k_scorer: str
    timeout_s: float


def reward_terms(reward: RewardSettings, rows: list[dict], texts: list[str], custom_fn: Callable | None,
                 functions: list[tuple[str, Callable]], in_this_thread: bool = False
                 ) -> list[tuple[str, float, ScoredBatch]]:
    """The rule scorer's batch (data_source's scorer, or `custom_fn`) and one batch per reward function, each
    with its weight from `reward` (the config's reward section): the terms of a step's score that need no
    model and no environment. `rows` hold data_source, ground_truth and extra_info."""
    args = ([row["data_source"] for row in rows], texts, [row["ground_truth"] for row in rows],
            [row["extra_info"] for row in rows])
    rule = (score_batch(*args, custom_fn=custom_fn, gsm8k_scorer=reward.gsm8k_scorer, timeout_s=reward.timeout_s,
                        in_this_thread=in_this_thread)
            if reward.rule_weight else from_scores([0.0] * len(texts)))
    terms = [("rule", reward.rule_weight, rule)]
    for (name, fn), weight in zip(functions, reward.weights or [1.0] * len(functions), strict=True):
        terms.append((name, weight, score_batch(*args, custom_fn=fn, timeout_s=reward.timeout_s,
                                                in_this_thread=in_this_thread)))
    return terms


def combine(terms: list[tuple[str, float, ScoredBatch]]) -> ScoredBatch:
    """A step's scores from its terms (reward_terms', then a reward model's and an environment's): the rule
    scorer's batch as it is when it is the only term at weight 1, else their weighted sum."""
    return weighted_sum(terms) if len(terms) > 1 or terms[0][1] != 1 else terms[0][2]
