"""Prompt templates and the stop condition."""

from __future__ import annotations

import pytest

from scratchlm.align.prompts import get_template, truncate_at_stop
from scratchlm.align.rewards import r1_zero_reward
from scratchlm.errors import UserError


def test_r1_zero_prompt_and_response():
    t = get_template("r1_zero")
    prompt = t.format("  What is 2+2?  ")
    assert prompt.startswith("A conversation between User and Assistant.")
    assert "<think> </think>" in prompt and "<answer> </answer>" in prompt
    assert prompt.endswith("User: What is 2+2?\nAssistant: <think>")
    response = t.response("2+2=4", "4")
    assert response == " 2+2=4 </think> <answer> 4 </answer>"
    assert r1_zero_reward(response, "4")["reward"] == 1.0
    assert t.stop == ("</answer>",)


def test_question_only_prompt():
    t = get_template("question_only")
    assert t.format("What is 2+2?") == "What is 2+2?\nAnswer:"
    assert t.response("2+2=4", "4") == " 2+2=4\n#### 4"


def test_question_with_braces_is_not_a_format_field():
    assert "{x}" in get_template("r1_zero").format("Solve for {x}.")


def test_truncate_at_stop():
    assert truncate_at_stop(" 7 </think> <answer> 7 </answer> junk", ("</answer>",)) == (
        " 7 </think> <answer> 7 </answer>", True)
    assert truncate_at_stop("no stop", ("</answer>",)) == ("no stop", False)
    assert truncate_at_stop("a\n\nb </answer>", ("</answer>", "\n\n")) == ("a\n\n", True)


def test_unknown_template():
    with pytest.raises(UserError, match="unknown prompt template"):
        get_template("chatml")
