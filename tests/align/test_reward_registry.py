"""The registry of rewards by name: lookup, defaults, registration, config validation."""

from __future__ import annotations

import pytest

from scratchlm.align import reward_registry
from scratchlm.align.reward_registry import get_reward_fn
from scratchlm.align.rewards import question_only_reward, r1_zero_reward


def test_registry_names_every_reward_once():
    from scratchlm.align.reward_registry import REWARDS
    from scratchlm.align.task import arithmetic_reward

    assert REWARDS["r1_zero"] is r1_zero_reward and REWARDS["arithmetic"] is arithmetic_reward
    assert {"r1_zero", "question_only", "arithmetic", "gsm8k_last_number", "multiple_choice"} <= set(REWARDS)
    for name, fn in REWARDS.items():
        assert get_reward_fn(name) is fn
        assert set(fn(" 1 </think> <answer> 1 </answer>", "1")) == {"format_reward", "answer_reward", "reward"}


def test_unknown_reward_is_a_user_error_naming_the_choices():
    from scratchlm.errors import UserError

    with pytest.raises(UserError, match="gsm8k_last_number"):
        get_reward_fn("nope")
    assert get_reward_fn(r1_zero_reward) is r1_zero_reward  # a function passes through


def test_default_reward_follows_template_and_dataset():
    from scratchlm.align.reward_registry import default_reward_name, select_reward
    from scratchlm.align.task import arithmetic_reward

    assert default_reward_name("r1_zero", "arith:3") == "arithmetic"
    assert default_reward_name("question_only", "arith") == "question_only"
    assert default_reward_name("r1_zero", "gsm8k") == "r1_zero"
    # a file whose name starts with "arith" is not the task: its fractions were graded as integers, always wrong
    assert default_reward_name("r1_zero", "arithmetic.jsonl") == "r1_zero"
    assert default_reward_name("r1_zero", "arith_mix.jsonl") == "r1_zero"
    assert select_reward("", template="r1_zero", dataset="arith:2") is arithmetic_reward
    assert select_reward("", template="question_only", dataset="math") is question_only_reward
    assert select_reward("question_only", template="r1_zero", dataset="arith") is question_only_reward


def test_register_reward(monkeypatch):
    monkeypatch.setattr(reward_registry, "REWARDS", dict(reward_registry.REWARDS))

    def always(response, truth):
        return {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}

    assert reward_registry.register_reward("always", always) is always
    assert get_reward_fn("always") is always
    reward_registry.register_reward("always", always)  # registering the same function again is harmless
    with pytest.raises(ValueError, match="already registered"):
        reward_registry.register_reward("r1_zero", always)
    reward_registry.register_reward("r1_zero", always, replace=True)
    assert get_reward_fn("r1_zero") is always


def test_the_registry_is_still_importable_from_rewards():
    from scratchlm.align import rewards

    assert rewards.REWARDS is reward_registry.REWARDS
    assert rewards.get_reward_fn("question_only") is question_only_reward
    with pytest.raises(AttributeError):
        rewards.no_such_name  # noqa: B018


def test_data_config_validates_the_reward_name():
    from scratchlm.align.config import GRPORunConfig
    from scratchlm.config import ConfigError, load_config

    assert load_config(GRPORunConfig, "align-grpo").data.reward == ""
    cfg = load_config(GRPORunConfig, "align-grpo", ["--data.reward=multiple_choice"])
    assert cfg.data.reward == "multiple_choice"
    with pytest.raises(ConfigError, match="data.reward must be one of"):
        load_config(GRPORunConfig, "align-grpo", ["--data.reward=bogus"])
