"""Loading GSM8K and MATH into MathExamples (shared data), and JSONL edge cases."""

from __future__ import annotations

import json

import pytest

from scratchlm.align.datasets import gsm8k_example, load_examples, math_example
from scratchlm.align.math_normalize import answers_match, last_boxed
from scratchlm.align.prompts import get_template
from scratchlm.align.rewards import r1_zero_reward
from scratchlm.errors import UserError


def test_gsm8k_example_strips_calculator_annotations():
    ex = gsm8k_example({"question": "Q?", "answer": "48/2 = <<48/2=24>>24 clips.\n#### 1,024"})
    assert ex.answer == "1024" and ex.reasoning == "48/2 = 24 clips."


def test_math_example_falls_back_to_the_last_box():
    ex = math_example({"problem": "P", "solution": "so $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"})
    assert ex.answer == "\\frac{1}{2}" and ex.meta == {"level": "Level 1"}


def test_real_gsm8k(shared_data):
    examples = load_examples("gsm8k", "test", data_dir=shared_data, limit=50)
    assert len(examples) == 50
    t = get_template("r1_zero")
    for ex in examples:
        assert ex.answer.lstrip("-").replace(".", "").isdigit()
        assert "<<" not in ex.reasoning
        assert r1_zero_reward(t.response(ex.reasoning, ex.answer), ex.answer)["reward"] == 1.0


def test_real_math_answers_grade_against_their_own_boxes(shared_data):
    examples = load_examples("math500", "test", data_dir=shared_data)
    assert len(examples) == 500
    agree = sum(answers_match(last_boxed(ex.reasoning) or "", ex.answer) for ex in examples)
    assert agree >= 0.97 * len(examples)


def test_jsonl_path_and_errors(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n\n", encoding="utf-8")
    assert load_examples(str(path))[0].answer == "2"
    path.write_text("{bad json\n", encoding="utf-8")
    with pytest.raises(UserError, match="mine.jsonl:1"):
        load_examples(str(path))
    with pytest.raises(UserError, match="unknown dataset"):
        load_examples("imagenet")
    with pytest.raises(FileNotFoundError):
        load_examples("gsm8k", "nosuchsplit", data_dir=tmp_path)


def test_arith_dataset_name():
    ex = load_examples("arith:3", "test", limit=5)
    assert len(ex) == 5 and all(e.reasoning.count("=") == 3 for e in ex)
    with pytest.raises(UserError, match="arith has a train and a test split, not 'validation'"):
        load_examples("arith", "validation")  # was a ValueError


@pytest.mark.parametrize("row, message", [
    ({"question": "1+1?", "answer": 2}, r"row 1: answer must be a string, got int"),
    ({"question": None, "answer": "#### 2"}, r"row 1: question must be a string, got NoneType"),
    ({"problem": "p", "solution": 7}, r"row 1: solution must be a string, got int"),
    ({"problem": "p", "solution": "s", "answer": ["2"]}, r"row 1: answer must be a string or a number"),
    # no answer to grade against: every response was graded wrong, silently
    ({"problem": "p", "solution": "s"}, r"row 1: a MATH row needs an answer: an 'answer' value or a \\boxed"),
    ({"problem": "p", "solution": "s", "answer": " "}, r"row 1: a MATH row needs an answer"),
    ({"question": "1+1?", "answer": "2"}, r"row 1: a GSM8K answer must end with '#### <number>'"),
    ({"question": "1+1?", "answer": "1+1=2\n#### "}, r"row 1: .* not an empty '####'"),
    (5, r"row 1 has neither question/answer"),
])
def test_jsonl_rows_of_the_wrong_shape_name_the_file_and_row(tmp_path, row, message):
    path = tmp_path / "mine.jsonl"
    good = {"question": "2+2?", "answer": "2+2=4\n#### 4"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=f"mine.jsonl: {message}"):
        load_examples(str(path))


def test_math_row_with_a_numeric_answer(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"problem": "6*7?", "solution": "6*7=42", "answer": 42}) + "\n", encoding="utf-8")
    assert load_examples(str(path))[0].answer == "42"


def test_jsonl_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n{"question": "caf\xe9?", "answer": "#### 1"}\n')
    with pytest.raises(UserError, match=r"mine.jsonl:2: not UTF-8 text \(byte 0xe9 at column 18\)"):
        load_examples(str(path))


@pytest.mark.parametrize("name, message", [("arith:x", "must be an integer"), ("arith:0", "at least 1"),
                                           ("arith:-2", "at least 1")])
def test_arith_difficulty_must_be_a_positive_integer(name, message):
    with pytest.raises(UserError, match=message):
        load_examples(name, "test", limit=2)
