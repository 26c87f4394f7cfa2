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
