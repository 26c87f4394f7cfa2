"""Expert iteration's checks of its training set (the loop itself: test_loops.py)."""

from __future__ import annotations

import pytest

from scratchlm.align.config import ExpertIterationConfig, OptimConfig, SamplingConfig, SFTConfig
from scratchlm.align.expert_iteration import check_train_examples, expert_iteration
from scratchlm.align.prompts import get_template
from scratchlm.align.task import ArithmeticTask
from scratchlm.errors import UserError


def test_more_questions_a_step_than_the_training_set_has_is_an_error(tiny_policy):
    # A step quietly drew all 3 questions instead of the 4 asked for.
    examples = ArithmeticTask(difficulty=1).examples(3)
    ei = ExpertIterationConfig(n_ei_steps=1, questions_per_step=4, group_size=2)
    message = "expert iteration draws 4 questions a step .* the training set has 3; lower ei.questions_per_step"
    with pytest.raises(UserError, match=message):
        check_train_examples(examples, ei)
    with pytest.raises(UserError, match=message):
        expert_iteration(tiny_policy, examples, template=get_template("r1_zero"), reward_fn="r1_zero", ei=ei,
                         sft=SFTConfig(), optim=OptimConfig(), sampling=SamplingConfig(max_new_tokens=4),
                         evaluate=lambda step: pytest.fail("evaluated before the check"))
    check_train_examples(examples, ExpertIterationConfig(questions_per_step=3))
