"""The rewards by name: the one table that configs, commands and training loops choose from.

A config names its reward with ``data.reward`` (validated against `REWARDS`), the commands
turn that name into a function with `select_reward`, and the loops (`grpo_train`,
`expert_iteration`, `evaluate_policy`) accept a name wherever they take a reward function.

Adding a reward is one new module holding a function ``(response, ground_truth) ->
{"format_reward", "answer_reward", "reward"}`` and one entry in `REWARDS` below (with its
import); a script can instead call `register_reward` at run time. docs/extending.md walks
through an example.

Nothing is chosen implicitly except the default: with ``data.reward = ""`` the reward is the
one named like the prompt template (``r1_zero``, ``question_only``), or ``arithmetic`` for the
synthetic task in the r1_zero format, whose answers are bare integers.
"""

from __future__ import annotations

from scratchlm.align.rewards import (
    RewardFn,
    gsm8k_last_number_reward,
    multiple_choice_reward,
    question_only_reward,
    r1_zero_reward,
)
from scratchlm.align.task import arithmetic_reward
from scratchlm.errors import UserError

REWARDS: dict[str, RewardFn] = {
    "r1_zero": r1_zero_reward,
    "question_only": question_only_reward,
    "arithmetic": arithmetic_reward,
    "gsm8k_last_number": gsm8k_last_number_reward,
    "multiple_choice": multiple_choice_reward,
}


def register_reward(name: str, fn: RewardFn, *, replace: bool = False) -> RewardFn:
    """Add `fn` to `REWARDS` under `name` (from a script, without editing this file); returns `fn`."""
    if not callable(fn):
        raise TypeError(f"reward {name!r} must be a function (response, ground_truth) -> dict")
    if name in REWARDS and REWARDS[name] is not fn and not replace:
        raise ValueError(f"a reward named {name!r} is already registered (pass replace=True to override it)")
    REWARDS[name] = fn
    return fn


def get_reward_fn(name: str | RewardFn) -> RewardFn:
    """The registered reward called `name`; a function passes through unchanged.

    The built-in prompt templates share their reward's name, so ``get_reward_fn(template)``
    is the template's own reward.
    """
    if callable(name):
        return name
    if name not in REWARDS:
        raise UserError(f"unknown reward {name!r}; choose one of {', '.join(sorted(REWARDS))}")
    return REWARDS[name]


def default_reward_name(template: str, dataset: str) -> str:
    """The reward used when none is named (see the module docstring)."""
    if (dataset == "arith" or dataset.startswith("arith:")) and template == "r1_zero":
        return "arithmetic"
    return template


def select_reward(name: str, *, template: str, dataset: str) -> RewardFn:
    """The reward called `name`, or when `name` is "" the default for `template` and `dataset`."""
    return get_reward_fn(name or default_reward_name(template, dataset))
