"""The built-in scorers: GSM8K (verl's rule, and our lenient one as an option), exact arithmetic and math
answers in \\boxed{}, each registered for its data sources, with the answer extraction they share.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from backend.rewards.registry import RewardError, Scorer, register_reward

GSM8K_DATA_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_DATA_SOURCES = ("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
ARITHMETIC_DATA_SOURCES = ("arithmetic",)


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

# verl 0.9.1 reads only the response's last 300 characters.
_VERL_CLIP_CHARS = 300
_VERL_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_VERL_FLEXIBLE = re.compile(r"(-?[0-9.,]+)")


def verl_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer verl 0.9.1's GSM8K rule reads from a response, as a string, or None.

    Only the last 300 characters are searched. strict: the last "#### " followed at once by a run of
    digits, ".", "," (a "-" may lead), commas then removed ("#### 1,2,3" gives "123"; "####18",
    "#### $18" and "#### - 5" give None). flexible: the last run of that kind anywhere, commas kept,
    skipping runs that are a lone "."; when every run is a lone ".", the first one.
    """
    if method not in ("strict", "flexible"):
        raise RewardError(f"gsm8k_score: method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-_VERL_CLIP_CHARS:]
    if method == "strict":
        found = _VERL_STRICT.findall(text)
        return found[-1].replace(",", "") if found else None
    found = _VERL_FLEXIBLE.findall(text)
    if not found:
        return None
    return next((answer for answer in reversed(found) if answer != "."), found[0])


@register_reward(*GSM8K_DATA_SOURCES)
def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, Any]:
    """GSM8K exactly as verl 0.9.1 scores it (verl/utils/reward_score/gsm8k.py): the answer read by
    ``verl_gsm8k_answer`` compared with the ground truth as strings, "2.50" != "2.5", "018" != "18".

    - no answer read: 0
    - answer == ground_truth: ``score``
    - another answer: ``format_score``

    The ground truth is compared as given: verl's GSM8K data holds the bare answer with commas removed
    ("1234"), as ``python -m backend data gsm8k`` writes it. Registered for the GSM8K data sources; the
    run config's reward.gsm8k_scorer picks between this rule ("verl") and ``gsm8k_lenient_score``.
    Returns {score, correct (the answer equals the ground truth), format (an answer was read), pred}.
    """
    answer = verl_gsm8k_answer(solution_str, method)
    if answer is None:
        return _parts(0.0, False, False, None)
    correct = answer == ground_truth
    return _parts(score if correct else format_score, correct, True, answer)


def gsm8k_lenient_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict[str, Any]:
    """Our own GSM8K rule, friendlier to small models than verl's, with partial credit:

    - the number after the last "####" is right: 1.0
    - no number after a last "####", but the last number in the response is right: 0.5
    - otherwise (a wrong "####" answer, or no right number at all): 0.0

    It differs from verl: numbers compare by value ("2.50" == "2.5", "018" == "18", "1,234" == "1234"); the
    marker may be followed by spaces, "$" or a minus ("#### $18", "####18", "#### - 5" read 18, 18, -5);
    U+2212 is a minus; the whole response is searched, not its last 300 characters; commas count only
    between groups of three digits ("#### 1,2,3" reads 1, not 123); a right last number without the
    marker earns 0.5; a ground truth may be a whole solution ("... #### 72").

    Parts: correct (the answer read, strict or else flexible, is right), format (a "#### n" answer was
    found), pred.
    """
    truth = _number_ground_truth(ground_truth, data_source)
    strict = extract_hash_answer(solution_str)
    if strict is not None:
        correct = normalize_number(strict) == truth
        return _parts(1.0 if correct else 0.0, correct, True, normalize_number(strict))
    flexible = extract_last_number(solution_str)
    correct = _same_number(flexible, truth)
    return _parts(0.5 if correct else 0.0, correct, False, normalize_number(flexible) if flexible else None)


# The rules reward.gsm8k_scorer names; the first is what a GSM8K data source is registered with.
GSM8K_SCORERS: dict[str, Scorer] = {"verl": gsm8k_score, "lenient": gsm8k_lenient_score}


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


