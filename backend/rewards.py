"""Reward scorers: a registry keyed by `data_source`, a user's own function, and batch scoring.

A scorer has verl's custom-reward signature::

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None)
        -> float | dict

A dict return holds "score" (a number) and may hold other numeric parts ("correct", "format", ...)
and a string "pred" (the answer the scorer read from the response). Scorers are called with keyword
arguments, as verl calls them, so a user's function must use these four parameter names.

`score_batch` scores every row in isolation: a scorer that raises, returns something that is not a
finite number, or runs past `timeout_s` scores 0.0 for that row, is counted in a metric, and the
batch goes on. A hung Python function cannot be killed from outside; its thread is a daemon thread
that is abandoned (left running until it returns or the process exits).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any

__all__ = [
    "RewardError",
    "ScoredBatch",
    "register_reward",
    "get_scorer",
    "known_data_sources",
    "load_custom_reward",
    "score_batch",
    "extract_hash_answer",
    "extract_last_number",
    "extract_boxed",
    "normalize_number",
    "gsm8k_score",
    "gsm8k_default_score",
    "math_score",
    "arithmetic_score",
    "GSM8K_DATA_SOURCES",
    "MATH_DATA_SOURCES",
    "ARITHMETIC_DATA_SOURCES",
]

logger = logging.getLogger(__name__)

Scorer = Callable[..., "float | dict[str, Any]"]

GSM8K_DATA_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_DATA_SOURCES = ("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
ARITHMETIC_DATA_SOURCES = ("arithmetic",)

# Rows scored at once. Scoring is mostly regex work under the GIL, so more threads buy nothing; the
# pool exists so that one hung row does not hold up the others.
_MAX_WORKERS = 16


class RewardError(ValueError):
    """A reward function cannot be found, loaded or called as configured."""


# ---- registry ----

_REGISTRY: dict[str, Scorer] = {}


def register_reward(*data_sources: str) -> Callable[[Scorer], Scorer]:
    """Decorator registering a scorer for one or more `data_source` names; returns the function unchanged.

    Registering a name again replaces the earlier scorer (re-running a notebook cell or re-importing a
    user module must not fail).
    """
    if not data_sources or callable(data_sources[0]):
        raise RewardError(
            "register_reward needs at least one data_source name: use @register_reward('my_source')"
        )
    for name in data_sources:
        if not isinstance(name, str) or not name:
            raise RewardError(f"register_reward: data_source names must be non-empty strings, got {name!r}")

    def decorate(fn: Scorer) -> Scorer:
        _check_signature(fn, getattr(fn, "__name__", "?"), getattr(fn, "__module__", "?"))
        for name in data_sources:
            _REGISTRY[name] = fn
        return fn

    return decorate


def known_data_sources() -> list[str]:
    """The registered data_source names, sorted."""
    return sorted(_REGISTRY)


def get_scorer(data_source: str) -> Scorer:
    """The scorer registered for `data_source`; `RewardError` naming the known ones when there is none."""
    try:
        return _REGISTRY[data_source]
    except (KeyError, TypeError):
        pass
    known = known_data_sources()
    close = difflib.get_close_matches(str(data_source), known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise RewardError(
        f"no reward function is registered for data_source '{data_source}'.{hint} "
        f"Known data sources: {', '.join(known) or '(none)'}. To score it with your own function, set "
        "custom_reward_function.path (a .py file or module) and custom_reward_function.name (the function)."
    )


# ---- a user's own function ----

_CALL_SHAPE = "fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)"


def load_custom_reward(path: str, name: str) -> Scorer:
    """Load a user's scorer named `name` from a .py file (relative or absolute) or an importable module.

    `path` is a file when it ends in ".py", contains a path separator, or names an existing file;
    otherwise it is imported as a module name (`pkg.mod`). With an empty `name`, `path` may be written
    as "target:function". Raises `RewardError` when the file is missing, the function is missing (listing
    the callables the file defines), the attribute is not callable, or its signature cannot be called as
    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...).
    """
    path, name = str(path).strip(), str(name or "").strip()
    if not name and ":" in path:
        target, _, func = path.rpartition(":")
        if func.isidentifier():
            path, name = target, func
    if not path:
        raise RewardError("custom_reward_function.path is empty: give a .py file or an importable module")
    if not name:
        raise RewardError(f"custom_reward_function.name is empty: give the name of the function in '{path}'")

    module = _load_module(path)
    where = f"'{path}'"
    if not hasattr(module, name):
        defined = sorted(
            n for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise RewardError(
            f"custom_reward_function.name='{name}' is not defined in {where}; "
            f"callables found there: {', '.join(defined) or '(none)'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(
            f"custom_reward_function.name='{name}' in {where} is a {type(fn).__name__}, not a function"
        )
    _check_signature(fn, name, where)
    return fn


def _check_signature(fn: Callable, name: str, where: str) -> None:
    """A scorer must accept verl's keyword call; say how to define it when it does not."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no introspectable signature; the call itself will tell
    try:
        signature.bind(data_source="", solution_str="", ground_truth="", extra_info=None)
    except TypeError as exc:
        raise RewardError(
            f"reward function '{name}{signature}' in {where} cannot be called as {_CALL_SHAPE} "
            f"({exc}); define it as def {name}(data_source, solution_str, ground_truth, extra_info=None)"
        ) from exc


def _load_module(path: str) -> Any:
    as_file = path.endswith(".py") or "/" in path or "\\" in path or Path(path).is_file()
    if not as_file:
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError as exc:
            missing_itself = exc.name is None or path == exc.name or path.startswith(exc.name + ".")
            if not missing_itself:  # the module exists but imports something that does not
                raise RewardError(f"importing custom reward module '{path}' failed: {exc}") from exc
            raise RewardError(
                f"custom_reward_function.path='{path}' is neither an existing .py file nor an importable "
                "module; give a file path like path/to/reward.py or a module name like pkg.rewards"
            ) from exc
        except Exception as exc:
            raise RewardError(
                f"importing custom reward module '{path}' raised {type(exc).__name__}: {exc}"
            ) from exc

    file = Path(path).expanduser()
    resolved = file.resolve()
    if not resolved.is_file():
        raise RewardError(f"custom_reward_function.path: file not found: '{path}' (looked at {resolved})")
    # A stable, unique module name per file: two users' "reward.py" must not collide, and registering
    # in sys.modules lets classes and dataclasses defined in the file work (they look themselves up).
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", resolved.stem)
    module_name = f"_custom_reward_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise RewardError(f"custom_reward_function.path: cannot load '{path}' as Python source")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise RewardError(f"loading custom reward file '{path}' raised {type(exc).__name__}: {exc}") from exc
    return module


# ---- answer extraction ----

# A number with optional thousands separators ("1,234,567") and decimals. Separators must group by
# three so that a list like "5,6" reads as two numbers, not 56.
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_HASH_TAIL = re.compile(rf"\s*(-)?\s*(?:\\?\$\s*)?(-)?\s*({_NUM})")
# A minus counts only when it does not follow a word character: "10-5" is a dash, "x = -5" a minus.
_ANY_NUMBER = re.compile(rf"(?<![\w.])(-\s?)?(?:\\?\$\s?)?(-)?({_NUM})")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def _unicode_minus(text: str) -> str:
    return text.replace("\u2212", "-")


def extract_hash_answer(text: str) -> str | None:
    """The number right after the LAST "####" (strict GSM8K format), as written minus "$"; else None.

    Whitespace, a "$" and a minus sign may sit between "####" and the digits ("#### -$5" gives "-5").
    Only the last "####" counts: when it is not followed by a number the answer is None, even if an
    earlier "####" had one. Text after the number is ignored; a sentence-ending period is not part of it.
    """
    if not text:
        return None
    text = _unicode_minus(text)
    at = text.rfind("####")
    if at < 0:
        return None
    m = _HASH_TAIL.match(text, at + 4)
    if m is None:
        return None
    sign = "-" if (m.group(1) or m.group(2)) else ""
    return sign + m.group(3)


def extract_last_number(text: str) -> str | None:
    """The last number anywhere in the text (flexible GSM8K format), as written minus "$"; else None."""
    if not text:
        return None
    found = None
    for m in _ANY_NUMBER.finditer(_unicode_minus(text)):
        found = m
    if found is None:
        return None
    sign = "-" if (found.group(1) or found.group(2)) else ""
    return sign + found.group(3)


def extract_boxed(text: str) -> str | None:
    r"""The content of the last \boxed{...} (or \fbox{...}), nested braces included; else None.

    "\boxed 5" (the brace-less form) gives "5". A last box whose braces never close (a response cut off
    by the length limit) gives None rather than an earlier box.
    """
    if not text:
        return None
    starts = [(text.rfind(cmd), cmd) for cmd in ("\\boxed", "\\fbox")]
    at, cmd = max(starts)
    if at < 0:
        return None
    i = at + len(cmd)
    if text.startswith(" ", i):
        m = re.match(r"\s+([^\s$]+)", text[i:])
        answer = m.group(1).rstrip("\\") if m else ""  # "\boxed 5\$" ends before the escaped dollar
        return answer or None
    if not text.startswith("{", i):
        return None
    depth = 0
    j = i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2  # an escaped brace (\{ or \}) is content, not structure
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


def normalize_number(s: str) -> str | None:
    """A canonical string for a number written in `s`, or None when `s` is not a plain number.

    Strips commas, "$", spaces and trailing periods; "3.0" and "3" give "3", "-0" gives "0",
    "1,234" gives "1234", "0.50" gives "0.5". Fractions, words, NaN and infinity give None.
    """
    if s is None:
        return None
    s = _unicode_minus(str(s)).replace("\\$", "").replace("$", "").replace(",", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def _same_number(pred: str | None, truth: str | None) -> bool:
    if pred is None or truth is None:
        return False
    a = normalize_number(pred)
    return a is not None and a == normalize_number(truth)


def _number_ground_truth(ground_truth: Any, data_source: str) -> str:
    """The ground truth as a canonical number; a full GSM8K solution ("... #### 72") gives its answer."""
    text = str(ground_truth)
    if "####" in text:
        text = extract_hash_answer(text) or text
    value = normalize_number(text)
    if value is None:
        raise RewardError(
            f"ground truth {str(ground_truth)[:80]!r} for data_source '{data_source}' is not a number"
        )
    return value


def _parts(score: float, correct: bool, formatted: bool, pred: str | None) -> dict[str, Any]:
    return {"score": float(score), "correct": float(correct), "format": float(formatted), "pred": pred}


# ---- GSM8K ----

def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, Any]:
    """GSM8K as verl scores it: `score` for the right answer, `format_score` for a wrong one, 0 for none.

    method="strict" reads the number after the last "####"; method="flexible" reads the last number
    anywhere in the response. Numbers compare after `normalize_number` ("1,234" == "1234.0").
    Returns {score, correct, format (1.0 when an answer was extracted), pred}.
    """
    if method == "strict":
        pred = extract_hash_answer(solution_str)
    elif method == "flexible":
        pred = extract_last_number(solution_str)
    else:
        raise RewardError(f"gsm8k_score: method must be 'strict' or 'flexible', got {method!r}")
    truth = _number_ground_truth(ground_truth, data_source)
    if pred is None:
        return _parts(0.0, False, False, None)
    correct = normalize_number(pred) == truth
    return _parts(score if correct else format_score, correct, True, normalize_number(pred))


@register_reward(*GSM8K_DATA_SOURCES)
def gsm8k_default_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict[str, Any]:
    """The registered GSM8K rule, with partial credit for a right answer in the wrong format.

    - the number after the last "####" is right: 1.0
    - no number after a last "####", but the last number in the response is right: 0.5
    - otherwise (a wrong "####" answer, or no right number at all): 0.0

    Parts: correct (the answer read, strict or else flexible, is right), format (a "#### n" answer was
    found), pred. For verl's plain rule use `gsm8k_score` with `method` and `format_score`.
    """
    truth = _number_ground_truth(ground_truth, data_source)
    strict = extract_hash_answer(solution_str)
    if strict is not None:
        correct = normalize_number(strict) == truth
        return _parts(1.0 if correct else 0.0, correct, True, normalize_number(strict))
    flexible = extract_last_number(solution_str)
    correct = _same_number(flexible, truth)
    return _parts(0.5 if correct else 0.0, correct, False, normalize_number(flexible) if flexible else None)


# ---- arithmetic (our synthetic sets) ----

@register_reward(*ARITHMETIC_DATA_SOURCES)
def arithmetic_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict[str, Any]:
    """Exact integer answers asked for as "#### <number>", with partial credit so a small model learns.

    - the number after the last "####" is right: 1.0
    - a number after the last "####", but the wrong one: 0.1 (format credit)
    - no "#### <number>", but the last number in the response is right: 0.5
    - otherwise: 0.0

    Parts: correct (the answer read is right), format (a "#### <number>" answer was found), pred.
    """
    truth = _number_ground_truth(ground_truth, data_source)
    strict = extract_hash_answer(solution_str)
    if strict is not None:
        correct = normalize_number(strict) == truth
        return _parts(1.0 if correct else 0.1, correct, True, normalize_number(strict))
    flexible = extract_last_number(solution_str)
    correct = _same_number(flexible, truth)
    return _parts(0.5 if correct else 0.0, correct, False, normalize_number(flexible) if flexible else None)


# ---- math (\boxed answers) ----

_SPACING = re.compile(r"\\[!,;: ]")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_FRAC = re.compile(rf"(-?)\\frac\{{(-?{_NUM})\}}\{{(-?{_NUM})\}}")
_SLASH = re.compile(rf"(-?{_NUM})/(-?{_NUM})")
_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _normalize_math(s: str) -> str:
    s = s.strip().replace("\\$", "").replace("$", "")
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", s).rstrip(".")


def _as_fraction(s: str) -> Fraction | None:
    # In math answers a comma more often separates a list ("1,2") than thousands; only grouped digits
    # ("1,234") are read as one number.
    if "," in s and not _GROUPED.fullmatch(s):
        return None
    plain = normalize_number(s)
    if plain is not None:
        return Fraction(plain)
    for pattern in (_FRAC, _SLASH):
        m = pattern.fullmatch(s)
        if m:
            sign, num, den = (m.group(1), m.group(2), m.group(3)) if pattern is _FRAC else ("", *m.groups())
            n, d = normalize_number(num), normalize_number(den)
            if n is None or d is None or Fraction(d) == 0:
                return None
            value = Fraction(n) / Fraction(d)
            return -value if sign else value
    return None


def _math_equal(pred: str, truth: str) -> bool:
    a, b = _normalize_math(pred), _normalize_math(truth)
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    return fa is not None and fa == fb


@register_reward(*MATH_DATA_SOURCES)
def math_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict[str, Any]:
    r"""1.0 when the last \boxed{} answer of the response equals the ground truth, else 0.0.

    The ground truth may itself be a solution with a \boxed{} answer. Both sides are lightly normalised
    (spaces, \left/\right, \! \, \; \:, "$", a trailing "." removed; \dfrac and \tfrac read as \frac),
    then compared as strings, or as numbers when both are plain numbers or simple fractions
    ("0.5" == "\frac{1}{2}" == "1/2"). No symbolic algebra. Parts: correct, format (a box was found), pred.
    """
    truth = extract_boxed(str(ground_truth))
    if truth is None:
        truth = str(ground_truth)
    pred = extract_boxed(solution_str)
    if pred is None:
        return _parts(0.0, False, False, None)
    correct = _math_equal(pred, truth)
    return _parts(1.0 if correct else 0.0, correct, True, pred)


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


def score_batch(
    data_sources: list[str],
    responses: list[str],
    ground_truths: list[str],
    extra_infos: list[dict | None] | None = None,
    *,
    custom_fn: Callable | None = None,
    timeout_s: float = 10.0,
) -> ScoredBatch:
    """Score each response with its data_source's scorer (or `custom_fn` for every row, as verl does).

    Every row is scored in isolation, concurrently on a small pool of daemon threads. A row whose
    scorer raises, returns something other than a finite number (None, a string, NaN, inf, a dict
    without a numeric "score"), or runs past `timeout_s` seconds scores 0.0, and the batch goes on.
    A hung Python function cannot be killed: its thread is abandoned and runs on in the background.
    If as many rows hang as there are worker threads, the rows not yet started score 0.0 as timeouts.
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

    if custom_fn is not None:
        custom_name = getattr(custom_fn, "__name__", type(custom_fn).__name__)
        scorers: list[Callable] = [custom_fn] * n
        labels = [f"custom reward function '{custom_name}'"] * n
    else:
        by_source = {ds: get_scorer(ds) for ds in dict.fromkeys(data_sources)}
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

    outcomes = _run_rows(n, run_one, timeout_s, on_timeout, on_skip)

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
