"""r1_zero and question_only rewards, including formatting that must earn nothing."""

from __future__ import annotations

import pytest

from scratchlm.align.rewards import (
    extract_question_only_answer,
    extract_r1_answer,
    get_reward_fn,
    gsm8k_answer,
    question_only_reward,
    r1_zero_reward,
)

GOOD = " 3+4=7, 7*2=14 </think> <answer> 14 </answer>"


def test_correct_response_gets_full_reward():
    assert r1_zero_reward(GOOD, "14") == {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}


def test_formatted_but_wrong():
    assert r1_zero_reward(GOOD, "15") == {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}


def test_equivalent_answers_inside_tags():
    assert r1_zero_reward(" half </think> <answer> \\boxed{\\dfrac{1}{2}} </answer>", "0.5")["reward"] == 1.0
    assert r1_zero_reward(" money </think> <answer> $1,000. </answer>", "1000")["reward"] == 1.0
    assert r1_zero_reward(" </think><answer>x = 3</answer>", ["4", "3"])["reward"] == 1.0


@pytest.mark.parametrize("response", [
    " 3+4=7, 7*2=14 </think> the answer is 14",  # answer outside the tags
    " 7*2=14 <answer> 14 </answer>",  # </think> missing
    " 14 </think> <answer> 14 </answer> <answer> 14 </answer>",  # several answer blocks
    " 14 </think> <answer>   </answer>",  # empty answer
    " 14 </think> <answer> 14",  # unclosed answer
    " 14 </think> <answer> 1, 7, 14, 21 </answer>",  # many candidates
    " 14 </think> <answer> 12 13 14 15 </answer>",
    " <answer> 14 </answer> </think>",  # tags out of order
    " 14 </think> so <answer> 14 </answer>",  # text between the blocks
    " 14 </think> <answer> 14 </answer> and also 15",  # text after the answer
    " 14 </think> </think> <answer> 14 </answer>",  # two </think>
    " 14 </answer> </think> <answer> 14",  # close before open
    "14",
    "",
])
def test_adversarial_formats_earn_nothing(response):
    assert r1_zero_reward(response, "14")["reward"] == 0.0


@pytest.mark.parametrize("response", [
    " 14 </think> <answer> 14 </answer>",
    "<think> 14 </think> <answer> 14 </answer>",  # an explicit opening tag is fine
    " 14 </think>\n<answer>14</answer>\n",
])
def test_accepted_formats(response):
    assert r1_zero_reward(response, "14")["reward"] == 1.0


def test_format_reward_without_answer_reward():
    r = r1_zero_reward(" 14 </think> <answer> 1, 7, 14 </answer>", "14")
    assert r == {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
    r = r1_zero_reward(" 14 </think> <answer> 14 </answer> <answer> 14 </answer>", "14")
    assert r["format_reward"] == 0.0 and r["answer_reward"] == 0.0


def test_extract_r1_answer():
    assert extract_r1_answer(GOOD) == "14"
    assert extract_r1_answer(" a </think> <answer> so \\boxed{7} </answer>") == "7"
    assert extract_r1_answer(" a </think> 14") is None


def test_gsm8k_answer():
    assert gsm8k_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 1,072") == "1072"
    with pytest.raises(ValueError):
        gsm8k_answer("no marker")


def test_question_only_reward():
    assert question_only_reward(" 3+4=7\n#### 7", "7")["reward"] == 1.0
    assert question_only_reward(" so \\boxed{7}", "7")["reward"] == 1.0
    assert question_only_reward(" it is 7", "7") == {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}
    assert question_only_reward(" #### 7 8", "7")["reward"] == 0.0
    assert extract_question_only_answer(" x\n#### 12\nmore") == "12"
    assert get_reward_fn("question_only") is question_only_reward


@pytest.mark.parametrize("response, truth, expected", [
    ("She pays $1,234.50 in total.", "1234.5", (1.0, 1.0)),
    ("3 + 4 = 7, so she has 7.", "7", (1.0, 1.0)),
    ("7 at first, then 8.", "7", (1.0, 0.0)),  # graded by the last number
    ("#### 72\nthat took 3 days", "72", (1.0, 1.0)),
    ("#### 1,072", ["1072", "1073"], (1.0, 1.0)),
    ("It fell to -3.", "-3", (1.0, 1.0)),
    ("I cannot tell.", "3", (0.0, 0.0)),
])
def test_gsm8k_last_number_reward(response, truth, expected):
    from scratchlm.align.rewards import gsm8k_last_number_reward

    r = gsm8k_last_number_reward(response, truth)
    assert (r["format_reward"], r["answer_reward"]) == expected and r["reward"] == expected[0] * expected[1]


@pytest.mark.parametrize("response, truth, expected", [
    ("The correct answer is (B).", "B", (1.0, 1.0)),
    ("the correct answer is b", "(B)", (1.0, 1.0)),
    ("The correct answer is C.", "B", (1.0, 0.0)),
    (" C is tempting </think> <answer> B </answer>", "B", (1.0, 1.0)),  # the r1_zero answer block
    ("It is either B or C.", "B", (0.0, 0.0)),
    ("The answer is a mystery.", "A", (0.0, 0.0)),
])
def test_multiple_choice_reward(response, truth, expected):
    from scratchlm.align.rewards import multiple_choice_reward

    r = multiple_choice_reward(response, truth)
    assert (r["format_reward"], r["answer_reward"]) == expected and r["reward"] == expected[0] * expected[1]

