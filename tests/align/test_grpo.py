"""Group-normalised advantages and the three policy-gradient losses, checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from scratchlm.align.config import GRPOConfig
from scratchlm.align.grpo import (
    check_train_examples,
    compute_grpo_clip_loss,
    compute_group_normalized_rewards,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    grpo_microbatch_train_step,
)
from scratchlm.align.task import ArithmeticTask
from scratchlm.errors import UserError


def _reward(response: str, truth: str) -> dict[str, float]:
    r = 1.0 if response == truth else 0.0
    return {"format_reward": 1.0, "answer_reward": r, "reward": r}


def test_group_normalized_advantages_by_hand():
    responses = ["7", "x", "x", "7", "1", "1", "1", "1"]
    truths = ["7"] * 4 + ["1"] * 4
    adv, raw, meta = compute_group_normalized_rewards(_reward, responses, truths, 4, 1e-6, True)
    assert raw.tolist() == [1, 0, 0, 1, 1, 1, 1, 1]
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: all equal -> advantage 0.
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    assert meta["reward_mean"] == pytest.approx(0.75)
    assert meta["solved_groups"] == 1.0 and meta["zero_std_groups"] == 0.5
    adv, _, _ = compute_group_normalized_rewards(_reward, responses, truths, 4, 1e-6, False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_group_size_must_divide():
    with pytest.raises(ValueError):
        compute_group_normalized_rewards(_reward, ["a"] * 3, ["a"] * 3, 2, 1e-6, True)


def test_naive_losses_by_hand():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.25]])
    scores = torch.tensor([[2.0], [-1.0]])
    torch.testing.assert_close(compute_naive_policy_gradient_loss(scores, logp), torch.tensor([[2.0, 4.0], [-0.5, -0.25]]))
    loss, meta = compute_policy_gradient_loss(logp, "no_baseline", raw_rewards=scores)
    torch.testing.assert_close(loss, torch.tensor([[2.0, 4.0], [-0.5, -0.25]]))
    loss, _ = compute_policy_gradient_loss(logp, "reinforce_with_baseline", advantages=-scores)
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -4.0], [0.5, 0.25]]))
    with pytest.raises(ValueError):
        compute_policy_gradient_loss(logp, "reinforce_with_baseline", raw_rewards=scores)


def test_grpo_clip_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.55, 0.25]]))  # ratios 1.5, 1.1, 0.5
    loss, meta = compute_grpo_clip_loss(torch.tensor([[1.0]]), new, old, 0.2)
    # A > 0: min(r, clip(r)) -> 1.2 (clipped), 1.1, 0.5
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.1, -0.5]]))
    assert meta["clipped"].tolist() == [[True, False, False]]
    loss, meta = compute_grpo_clip_loss(torch.tensor([[-2.0]]), new, old, 0.2)
    # A < 0: min(-2r, -2 clip(r)) -> -3.0, -2.2, -1.6 (clipped at 0.8)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.2, 1.6]]))
    assert meta["clipped"].tolist() == [[False, False, True]]


def test_grpo_clip_gradient_is_zero_where_clipped():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.55]])).requires_grad_()
    loss, _ = compute_grpo_clip_loss(torch.tensor([[1.0]]), new, old, 0.2)
    loss.sum().backward()
    assert new.grad[0, 0] == 0.0 and new.grad[0, 1] == pytest.approx(-1.1)


def test_microbatch_step_length_normalisation():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([[1.0], [2.0]])
    loss, _ = grpo_microbatch_train_step(logp, mask, 2, "reinforce_with_baseline", advantages=adv)
    # per sequence: mean of -A logp over its tokens -> 1.5 and 2.0; batch mean 1.75; / 2 steps
    assert loss.item() == pytest.approx(0.875)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.125, -0.125, 0.0], [-1 / 6, -1 / 6, -1 / 6]]))
    logp.grad = None
    loss, _ = grpo_microbatch_train_step(logp, mask, 1, "reinforce_with_baseline", advantages=adv,
                                         length_normalization="constant", normalize_constant=4.0)
    # per sequence: sum / 4 -> 3/4 and 6/4
    assert loss.item() == pytest.approx((0.75 + 1.5) / 2)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.125, -0.125, 0.0], [-0.25, -0.25, -0.25]]))


def test_microbatch_step_clip_fraction():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.55, 0.25]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    _, meta = grpo_microbatch_train_step(new, mask, 1, "grpo_clip", advantages=torch.tensor([[1.0]]),
                                         old_log_probs=old, cliprange=0.2)
    assert meta["clip_fraction"].item() == pytest.approx(0.5)


class _SplitPolicy:
    """Encodes "70" as one token (5), though a sampler may have written it as "7", "0"."""

    eos_id, pad_id = 0, 0
    vocab = {0: "", 1: "7", 2: "0", 3: " </answer>", 5: "70"}

    def encode(self, text):
        ids = []
        while text:
            for tok, s in sorted(self.vocab.items(), key=lambda kv: -len(kv[1])):
                if s and text.startswith(s):
                    ids.append(tok)
                    text = text[len(s):]
                    break
        return ids


def test_rollout_ids_are_the_sampled_ones():
    from scratchlm.align.grpo import rollout_response_ids
    from scratchlm.align.policy import Completion

    policy = _SplitPolicy()
    completions = [
        Completion("70 </answer>", 4, True, [1, 2, 3, 0]),  # sampled "7","0": kept, not re-encoded to "70"
        Completion("70 </answer>", 2, True, [5, 3]),  # stopped on the string: end-of-text appended
        Completion("70", 2, False, [1, 2]),  # out of budget: no end-of-text
        Completion("70 </answer>", 3, True),  # ids unknown: re-encoded
        Completion("", 0, False, []),  # empty: one token to normalise over
    ]
    ids, retokenized = rollout_response_ids(policy, completions)
    assert ids == [[1, 2, 3, 0], [5, 3, 0], [1, 2], [5, 3, 0], [0]]
    assert retokenized == pytest.approx(2 / 5)
    calls, encode = [], policy.encode
    policy.encode = lambda text: calls.append(text) or encode(text)
    assert rollout_response_ids(policy, completions) == (ids, retokenized)
    assert sorted(calls) == ["", "70", "70 </answer>"]  # each distinct text encoded once


def test_training_set_must_hold_one_rollout_batch_of_questions():
    # grpo_train drew fewer questions than the batch has rows and stopped with an IndexError.
    grpo = GRPOConfig(rollout_batch_size=4, group_size=2, train_batch_size=4, grad_accum_steps=1)
    examples = ArithmeticTask(difficulty=1).examples(2)
    check_train_examples(examples, grpo)
    with pytest.raises(UserError, match="GRPO draws 2 questions a step .* the training set has 1"):
        check_train_examples(examples[:1], grpo)
