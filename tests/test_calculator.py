"""The calculator tool: exact arithmetic on what a model wrote, and a readable refusal for anything else."""

import time

import pytest

from backend.envs.calculator import calculate


def test_a_product_of_two_numbers_is_exact():
    # 347 * 86 = 347 * 80 + 347 * 6 = 27760 + 2082
    assert calculate("347*86") == "29842"
    assert calculate("347 * 86") == "29842"


def test_four_digit_sums_and_differences_carry_correctly():
    # 4789 + 5367: 9+7=16, 8+6+1=15, 7+3+1=11, 4+5+1=10
    assert calculate("4789 + 5367") == "10156"
    # 9002 - 4789: borrow through the zeros
    assert calculate("9002 - 4789") == "4213"


def test_multiplication_binds_tighter_than_addition_and_parentheses_override_it():
    assert calculate("2 + 3 * 4") == "14"
    assert calculate("(2 + 3) * 4") == "20"
    assert calculate("2 ** 3 ** 2") == "512"  # right to left: 2 ** 9
    assert calculate("-3 ** 2") == "-9"  # the power before the sign, as in Python


def test_caret_is_read_as_power_and_the_multiplication_and_division_signs_as_their_operators():
    assert calculate("2^10") == "1024"
    assert calculate("6 × 7") == "42"
    assert calculate("84 ÷ 4") == "21"


def test_a_division_that_does_not_come_out_even_prints_its_decimals():
    assert calculate("7/2") == "3.5"
    assert calculate("1/3") == "0.333333333333"
    assert calculate("0.1 + 0.2") == "0.3"


def test_a_division_that_comes_out_even_prints_as_a_whole_number():
    assert calculate("6/2") == "3"
    assert calculate("4536 / 2") == "2268"


def test_floor_division_and_remainder_follow_python():
    assert calculate("17 // 5") == "3"
    assert calculate("17 % 5") == "2"
    assert calculate("-7 // 2") == "-4"


@pytest.mark.parametrize("expression", ["1/0", "5 // 0", "5 % 0", "0 ** -1", "2.5 / 0.0"])
def test_division_by_zero_is_refused_with_a_clear_message(expression):
    with pytest.raises(ValueError, match=r"^calculator: division by zero$"):
        calculate(expression)


@pytest.mark.parametrize("expression, found", [
    ("x + 1", "x"),
    ("sqrt(2)", "sqrt(2)"),
    ("math.pi", "math.pi"),
    ("'a' * 3", "'a'"),
    ("1 < 2", "1 < 2"),
    ("[1, 2][0]", "[1, 2][0]"),
    ("lambda: 1", "lambda: 1"),
    ("True + 1", "True"),
])
def test_names_calls_attributes_and_other_python_are_refused_naming_what_was_found(expression, found):
    with pytest.raises(ValueError) as refusal:
        calculate(expression)
    assert str(refusal.value) == \
        f"calculator: {found!r} is not allowed: use numbers, + - * / // % ** and parentheses"


def test_dunder_import_is_refused_like_any_other_call():
    with pytest.raises(ValueError) as refusal:
        calculate("__import__('os')")
    assert str(refusal.value) == \
        "calculator: \"__import__('os')\" is not allowed: use numbers, + - * / // % ** and parentheses"


def test_thousands_separators_are_refused_with_a_hint():
    with pytest.raises(ValueError, match="write numbers without thousands separators"):
        calculate("1,234 + 5")


def test_text_that_does_not_parse_is_refused_with_the_parser_message():
    with pytest.raises(ValueError) as refusal:
        calculate("2 +* 3")
    assert str(refusal.value) == "calculator: cannot parse '2 +* 3': invalid syntax"


def test_a_power_tower_is_refused_at_once_instead_of_computed():
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^calculator: result too large$"):
        calculate("9**9**9")
    assert time.monotonic() - start < 0.5


@pytest.mark.parametrize("expression", ["2 ** 1001", "10 ** 999 * 10 ** 999", "1e308 * 10", "10.0 ** 400"])
def test_results_past_about_a_thousand_digits_or_the_float_range_are_refused(expression):
    with pytest.raises(ValueError, match=r"^calculator: result too large$"):
        calculate(expression)


def test_input_longer_than_three_hundred_characters_is_refused():
    expression = "+".join(["1"] * 151)  # 301 characters
    with pytest.raises(ValueError, match=r"^calculator: the expression is 301 characters long; the limit is 300$"):
        calculate(expression)
    assert calculate("+".join(["1"] * 150)) == "150"  # 299 characters still count


def test_a_negative_number_to_a_fractional_power_is_refused_as_not_real():
    with pytest.raises(ValueError, match="not a real number"):
        calculate("(-8) ** (1/3)")


def test_whitespace_and_line_breaks_around_and_inside_are_ignored():
    assert calculate("  12 *\n 3 ") == "36"


def test_something_that_is_not_text_is_refused():
    with pytest.raises(ValueError, match="must be text, got int"):
        calculate(42)
