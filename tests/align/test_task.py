"""The synthetic arithmetic task: correct worked solutions, disjoint splits, difficulty, reward."""

from __future__ import annotations

import random

import pytest

from scratchlm.align.prompts import get_template
from scratchlm.align.task import ArithmeticTask, arithmetic_reward
from scratchlm.errors import UserError


@pytest.mark.parametrize("difficulty", [1, 3, 6])
def test_worked_solutions_are_correct(difficulty):
    task = ArithmeticTask(difficulty=difficulty, max_operand=12, max_value=150)
    for ex in task.examples(200, seed=1):
        steps = ex.reasoning.split(", ")
        assert len(steps) == difficulty
        value = None
        for step in steps:
            lhs, rhs = step.split("=")
            assert value is None or lhs.startswith(str(value))
            assert eval(lhs) == int(rhs)  # noqa: S307 - digits and one operator
            assert 0 <= int(rhs) <= 150
            value = int(rhs)
        assert str(value) == ex.answer
        assert ex.question.startswith("Start with ") and ex.question.endswith("What is the result?")


def test_splits_are_disjoint_and_reproducible():
    task = ArithmeticTask(difficulty=2)
    train = task.examples(500, split="train", seed=0)
    test = task.examples(100, split="test", seed=0)
    other_seed_train = task.examples(500, split="train", seed=5)
    assert not {e.question for e in test} & ({e.question for e in train} | {e.question for e in other_seed_train})
    assert [e.question for e in task.examples(20, split="test", seed=0)] == [e.question for e in test[:20]]
    assert len({e.question for e in train}) == 500


def test_difficulty_knob_lengthens_the_chain():
    rng = random.Random(0)
    short = ArithmeticTask(difficulty=1).sample(rng)
    long = ArithmeticTask(difficulty=5).sample(rng)
    assert short.reasoning.count("=") == 1 and long.reasoning.count("=") == 5
    with pytest.raises(ValueError):
        ArithmeticTask(difficulty=0)



def test_more_problems_than_a_difficulty_holds_is_a_user_error():
    # arith:1 without a limit draws 1000 problems, more than it has: a ValueError (rc 1)
    from scratchlm.align.datasets import load_examples

    with pytest.raises(UserError, match=r"arith:1 has only \d+ distinct test problems, fewer than the 1000 asked for; "
                                        r"set a limit of at most \d+") as error:
        load_examples("arith:1", "test")
    n = int(str(error.value).split()[3])
    assert len(load_examples("arith:1", "test", limit=n)) == n  # the limit it names is one that works


def test_a_huge_limit_is_refused_as_fast_as_a_small_one():
    # The draws allowed grew with the limit: eval-math --dataset arith:1 --limit 10**20 never ended.
    from scratchlm.align.datasets import load_examples

    with pytest.raises(UserError, match=r"arith:1 has only \d+ distinct test problems, fewer than the 10+ asked for"):
        load_examples("arith:1", "test", limit=10**20)


def test_reward_checks_the_answer():
    ex = ArithmeticTask(difficulty=2).examples(1)[0]
    t = get_template("r1_zero")
    assert arithmetic_reward(t.response(ex.reasoning, ex.answer), ex.answer)["reward"] == 1.0
    wrong = str(int(ex.answer) + 1)
    assert arithmetic_reward(t.response(ex.reasoning, wrong), ex.answer) == {
        "format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
    assert arithmetic_reward(f" {ex.reasoning} </think> {ex.answer}", ex.answer)["format_reward"] == 0.0
    assert arithmetic_reward(f" x </think> <answer> {ex.answer}.5 </answer>", ex.answer)["reward"] == 0.0
