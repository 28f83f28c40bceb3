"""The calculator tool: arithmetic on numbers, evaluated by walking the syntax tree, never with `eval`.

A model calls it during an episode with whatever text it wrote, so every input ends in either a number or a
`ValueError` whose message the model can read and act on. Only int and float literals, + - * / // % **, unary
+ and -, and parentheses are evaluated; `^` is read as power and `×` / `÷` as * and /, because models write
them. Powers and big integers are bounded before they are computed, so `9**9**9` is refused at once instead of
holding the training process for minutes.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_CHARS = 300
# A result of about 10**1000 is far past any answer a task wants, and still cheap to compute.
MAX_DIGITS = 1000
MAX_EXPONENT = 1000
# Digits of an int are counted by its bits: 1000 decimal digits need at most 3322 bits.
_MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))
# Floats this large are printed in exponent form, where an int's digits would pretend to a precision they lack.
_LARGEST_PRINTED_AS_INT = 1e15

_ALLOWED = "use numbers, + - * / // % ** and parentheses"
_SPELLINGS = {"^": "**", "×": "*", "÷": "/"}

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of `expression` as text: "2268", "3.5", "0.333333333333".

    Raises ValueError, its message starting with "calculator: ", for anything that is not plain arithmetic,
    for input past MAX_CHARS characters, for division by zero and for results too large to be worth computing.
    """
    source = _normalized(expression)
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError) as exc:  # some Python versions raise ValueError for a null byte
        raise ValueError(f"calculator: cannot parse {source!r}: {getattr(exc, 'msg', exc)}") from None
    try:
        value = _evaluate(tree.body, source)
    except ZeroDivisionError:
        raise ValueError("calculator: division by zero") from None
    except OverflowError:
        raise ValueError("calculator: result too large") from None
    return _formatted(value)


def _normalized(expression: str) -> str:
    """The expression on one line, without outer whitespace, with the other spellings of operators replaced."""
    if not isinstance(expression, str):
        raise ValueError(f"calculator: the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"calculator: the expression is {len(expression)} characters long; the limit is {MAX_CHARS}")
    # Joining the words drops leading indentation, which the parser would reject, and line breaks.
    source = " ".join(expression.split())
    if not source:
        raise ValueError(f"calculator: the expression is empty: {_ALLOWED}")
    for spelling, python in _SPELLINGS.items():
        source = source.replace(spelling, python)
    return source


def _evaluate(node: ast.expr, source: str) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool is an int subclass
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand, source)))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_evaluate(node.left, source), _evaluate(node.right, source))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        return _checked(_BINARY[type(node.op)](left, right))
    raise ValueError(_refusal(node, source))


def _refusal(node: ast.expr, source: str) -> str:
    found = ast.get_source_segment(source, node) or type(node).__name__
    if len(found) > 40:
        found = found[:37] + "..."
    if isinstance(node, ast.Tuple):
        return f"calculator: {found!r} is not allowed: write numbers without thousands separators, and {_ALLOWED}"
    return f"calculator: {found!r} is not allowed: {_ALLOWED}"


def _power(base: int | float, exponent: int | float) -> int | float:
    # Estimated from logarithms first: computing 9**387420489 to find out it is too large would take minutes.
    if abs(exponent) > MAX_EXPONENT or (base != 0 and exponent * math.log10(abs(base)) > MAX_DIGITS):
        raise ValueError("calculator: result too large")
    result = base**exponent
    if isinstance(result, complex):  # a negative base to a fractional power, e.g. (-8) ** (1/3)
        raise ValueError("calculator: the result is not a real number")
    return _checked(result)


def _checked(value: int | float) -> int | float:
    """`value`, once it is known to be finite and of at most MAX_DIGITS digits."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("calculator: result too large")
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ValueError("calculator: result too large")
    return value


def _formatted(value: int | float) -> str:
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < _LARGEST_PRINTED_AS_INT:
        return str(int(value))
    return f"{value:.12g}"
