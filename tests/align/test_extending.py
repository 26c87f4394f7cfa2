"""docs/extending.md, section "A reward function": its example runs, registers, and drives GRPO."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scratchlm.align import reward_registry
from tests.docs_examples import python_blocks, section

SECTION = ("extending.md", "A reward function")


@pytest.fixture
def example(monkeypatch):
    """The namespace of the section's python blocks, run in order on a copy of the registry."""
    monkeypatch.setattr(reward_registry, "REWARDS", dict(reward_registry.REWARDS))
    namespace: dict = {"__name__": "docs_example"}
    for block in python_blocks(*SECTION):
        exec(compile(block, "docs/extending.md", "exec"), namespace)
    return namespace


def test_example_reward_is_selectable_by_name_and_scores_as_described(example):
    reward = reward_registry.get_reward_fn("concise")
    assert reward is example["concise_reward"]
    assert reward_registry.select_reward("concise", template="r1_zero", dataset="gsm8k") is reward
    within = " 3+4=7 </think> <answer> 7 </answer>"
    assert reward(within, "7")["reward"] == 1.0 and reward(within, ["6", "7"])["reward"] == 1.0
    assert reward(within, "8") == {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
    assert reward(" 7 </think> 7", "7")["format_reward"] == 0.0  # the r1_zero format still applies
    assert reward("", "7")["reward"] == 0.0
    budget = example["MAX_WORDS"]
    at_budget = " " + "x " * (budget - 4) + "</think> <answer> 7 </answer>"
    assert len(at_budget.split()) == budget and reward(at_budget, "7")["reward"] == 1.0
    over = " x" + at_budget
    assert reward(over, "7") == {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}


def test_example_name_passes_config_validation(example):
    from scratchlm.align.config import GRPORunConfig
    from scratchlm.config import load_config

    assert load_config(GRPORunConfig, "align-grpo", ["--data.reward=concise"]).data.reward == "concise"


def test_example_reward_drives_a_grpo_step(example, tiny_policy):
    from scratchlm.align.config import GRPOConfig, OptimConfig, SamplingConfig
    from scratchlm.align.grpo import grpo_train
    from scratchlm.align.prompts import get_template
    from scratchlm.align.task import ArithmeticTask

    graded = []
    inner = example["r1_zero_reward"]
    example["r1_zero_reward"] = lambda response, truth: graded.append(response) or inner(response, truth)
    history = grpo_train(tiny_policy, ArithmeticTask(difficulty=1).examples(4), template=get_template("r1_zero"),
                         reward_fn="concise",
                         grpo=GRPOConfig(n_grpo_steps=1, rollout_batch_size=4, group_size=2, train_batch_size=4,
                                         grad_accum_steps=2),
                         optim=OptimConfig(lr=1e-3), sampling=SamplingConfig(max_new_tokens=6, batch_size=4))
    assert len(graded) == 4  # every rollout (all within the word budget) went through the example's reward
    assert [h["step"] for h in history] == [1] and 0.0 <= history[0]["reward_mean"] <= 1.0


def test_registry_lines_shown_in_the_docs_match_the_registry():
    """The diff context lines of step 2 exist in reward_registry.py, so the shown edit applies."""
    text = section(*SECTION)
    diff = re.search(r"^```diff\n(.*?)^```", text, re.S | re.M)[1]
    source = Path(reward_registry.__file__).read_text(encoding="utf-8")
    context = [line[1:] for line in diff.splitlines() if line.startswith(" ") and line.strip() != "..."]
    assert context and all(line in source for line in context)
