"""The free-text answer parsers on the strings that trip simple regexes."""

from __future__ import annotations

import pytest

from scratchlm.align.answer_parsers import parse_gsm8k_answer, parse_last_number, parse_multiple_choice


@pytest.mark.parametrize("text, expected", [
    ("She pays $1,234.50 in total.", "1234.50"),
    ("The answer is 42.", "42"),  # a period ending the sentence is not a decimal point
    ("It costs 3.5.", "3.5"),
    ("It is 7.\n", "7"),
    ("The temperature fell to -12 degrees.", "-12"),
    ("She lost -$5 on the bet", "-5"),
    ("The balance is $-30.", "-30"),
    ("10-3 = 7", "7"),
    ("Compute 10-3", "3"),  # after a digit the minus sign is subtraction
    ("(2)-3", "3"),
    ("x = (-4)", "-4"),
    ("Total: 1,234,567 people", "1234567"),
    ("1,2,3", "3"),  # a list, not a thousands group
    ("12,34", "34"),
    ("1,2345", "2345"),
    ("48/2 = <<48/2=24>>24 clips", "24"),
    ("50% of them", "50"),
    ("3 apples and 4 pears, 7 fruit in all", "7"),
    ("Version COVID19 aside, 5 cases", "5"),
    ("0.75", "0.75"),
    ("no number here", None),
    ("", None),
    ("COVID19", None),  # digits glued to a word are not an answer
])
def test_last_number(text, expected):
    assert parse_last_number(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
    ("#### 1,072", "1072"),
    ("#### $1,234.50", "1234.50"),
    ("#### -5", "-5"),
    ("so the answer is\n#### 42\nThat took 3 steps.", "42"),  # the marker beats the last number
    ("#### 5\nfirst try\n#### 6", "6"),  # the last marker
    ("#### none\nbut the answer is 9", "9"),  # a marker without a number falls back
    ("5 + 7 = 12", "12"),
    ("nothing", None),
])
def test_gsm8k_answer(text, expected):
    assert parse_gsm8k_answer(text) == expected


def test_numbers_agree_with_the_dataset_parser_on_gsm8k_solutions():
    from scratchlm.align.rewards import gsm8k_answer

    for solution in ["a <<2*3=6>>6\n#### 6", "b\n#### 1,007", "c <<10-15=-5>>-5\n#### -5", "d\n#### 12,345,678"]:
        assert parse_gsm8k_answer(solution) == gsm8k_answer(solution)


@pytest.mark.parametrize("text, expected", [
    ("The correct answer is B", "B"),
    ("The correct answer is (C).", "C"),
    ("the correct answer is c", "C"),
    ("The answer is d.", "D"),
    ("Answer: A", "A"),
    ("**Answer:** (b)", "B"),
    ("The answer is: **D**", "D"),
    ("answer is [A]!", "A"),
    ("The answer is option C because the others fail.", "C"),
    ("I first thought the answer is A, but the correct answer is B.", "B"),  # the last phrase wins
    ("The answer is a number we can compute. The correct answer is D", "D"),  # "a" is an article
    ("B", "B"),
    ("(b)", "B"),
    ("C.", "C"),
    ("  d )  ", "D"),
    ("so \\boxed{C}", "C"),
    ("The answer is E", None),  # not one of A-D
    ("The answer is a number.", None),
    ("I answered quickly.", None),
    ("It could be B or C.", None),  # no answer phrase, not a bare letter
    ("", None),
    ("No idea.", None),
])
def test_multiple_choice(text, expected):
    assert parse_multiple_choice(text) == expected


def test_multiple_choice_other_letters():
    assert parse_multiple_choice("The answer is E", choices="ABCDE") == "E"
    assert parse_multiple_choice("The answer is (f)", choices="abcdefghij") == "F"
