"""Answer normalisation and equivalence for GSM8K and MATH spellings."""

from __future__ import annotations

import pytest

from scratchlm.align.math_normalize import answers_match, canonical_macros, find_braced, last_boxed, normalize_answer, parse_number


@pytest.mark.parametrize("prediction, truth", [
    ("0.5", "\\frac12"),
    ("\\dfrac{1}{2}", "1/2"),
    ("\\tfrac{1}{2}", "0.5"),
    ("\\frac{1}{2}", ".5"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("90 degrees", "90"),
    ("\\text{5 cm}", "5"),
    ("5\\text{ inches}", "5"),
    ("x = 3", "3"),
    ("y=-2", "-2"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\sqrt3", "\\sqrt{3}"),
    ("2\\sqrt{3}", "2 \\sqrt 3"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{\\sqrt2}{2}"),
    ("$1,000.", "1000"),
    ("\\$18.00", "18"),
    ("18 dollars", "18"),
    ("1,234,567", "1234567"),
    ("50\\%", "50"),
    ("5.", "5"),
    ("\\boxed{\\frac{3}{4}}", "0.75"),
    ("-\\frac{3}{4}", "-0.75"),
    ("\\frac{3}{-4}", "-0.75"),
    ("1{,}000", "1000"),
    ("\\text{(B)}", "(B)"),
])
def test_equivalent_spellings_match(prediction, truth):
    assert answers_match(prediction, truth), (normalize_answer(prediction), normalize_answer(truth))


@pytest.mark.parametrize("prediction, truth", [
    ("1,4", "14"),  # not a thousands group: two numbers
    ("1, 2, 14", "14"),  # a list of candidates is not the answer
    ("5 or 14", "14"),
    ("14 15", "14"),
    ("", "14"),
    ("\\frac{1}{3}", "0.33"),
    ("x+1", "x-1"),
    ("\\sqrt{2}", "2"),
    ("13", "14"),
])
def test_different_answers_do_not_match(prediction, truth):
    assert not answers_match(prediction, truth)


def test_boxed_with_nested_braces_and_last_wins():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b^{2}}}") == "\\frac{a}{b^{2}}"
    assert last_boxed("answer \\boxed 7.") == "7."
    assert last_boxed("\\fbox{3}") == "3"
    assert last_boxed("no box here") is None
    assert last_boxed("\\boxed{unclosed") is None


def test_find_braced():
    assert find_braced("{a{b}c}d", 0) == ("a{b}c", 7)
    assert find_braced("{a", 0) is None
    assert find_braced("a", 0) is None


def test_canonical_macros():
    assert canonical_macros("\\frac12") == "\\frac{1}{2}"
    assert canonical_macros("\\frac1{23}") == "\\frac{1}{23}"
    assert canonical_macros("\\frac{\\sqrt3}2") == "\\frac{\\sqrt{3}}{2}"
    assert canonical_macros("\\sqrt[3]{8}") == "\\sqrt[3]{8}"
    assert canonical_macros("\\fracture") == "\\fracture"  # a longer command is left alone


def test_parse_number():
    assert parse_number("-\\frac{3}{4}") == -0.75
    assert parse_number("2/5") == 0.4
    assert parse_number("1/0") is None
    assert parse_number("x+1") is None
    assert parse_number("1e400") is None or parse_number("1e400") != float("inf")


def test_integers_are_canonical():
    assert normalize_answer("05") == "5"
    assert normalize_answer("+5.0") == "5"
    assert normalize_answer("\\frac{4}{2}") == "\\frac{4}{2}"  # fractions keep their spelling
    assert answers_match("\\frac{4}{2}", "2")
