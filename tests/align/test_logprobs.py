"""Log-probabilities, entropies, masked reductions and the SFT microbatch step against direct torch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from scratchlm.align.logprobs import (
    compute_entropy,
    masked_mean,
    masked_normalize,
    response_log_probs,
    sft_microbatch_train_step,
    tokenize_prompt_and_output,
)


class _Logits(torch.nn.Module):
    """A model whose logits are a learnable table indexed by the input token."""

    def __init__(self, vocab: int = 7) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, ids):
        return self.table[ids]


def test_tokenize_prompt_and_output():
    out = tokenize_prompt_and_output([[1, 2], [3]], [[4, 5, 6], [7]], pad_id=0)
    assert out["input_ids"].tolist() == [[1, 2, 4, 5], [3, 7, 0, 0]]
    assert out["labels"].tolist() == [[2, 4, 5, 6], [7, 0, 0, 0]]
    assert out["response_mask"].tolist() == [[False, True, True, True], [True, False, False, False]]


def test_response_log_probs_matches_log_softmax_gather():
    model = _Logits()
    ids = torch.tensor([[1, 2, 3, 4], [6, 5, 0, 0]])
    labels = torch.tensor([[2, 3, 4, 5], [5, 0, 0, 1]])
    out = response_log_probs(model, ids, labels, return_token_entropy=True)
    logits = model(ids)
    expected = F.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(out["log_probs"], expected)
    p = logits.softmax(-1)
    torch.testing.assert_close(out["token_entropy"], -(p * p.log()).sum(-1))
    assert out["log_probs"].requires_grad and not out["token_entropy"].requires_grad


def test_entropy_is_stable_for_extreme_logits():
    h = compute_entropy(torch.tensor([[1000.0, -1000.0, -1000.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(h, torch.tensor([0.0, math.log(3)]))


def test_masked_mean_and_normalize():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 6) / 3)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 6.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=0), torch.tensor([1.0, 2.0, 6.0]))
    assert masked_normalize(x, mask, 2.0).item() == pytest.approx(4.5)
    torch.testing.assert_close(masked_normalize(x, mask, 2.0, dim=1), torch.tensor([1.5, 3.0]))
    torch.testing.assert_close(masked_normalize(x, mask, 4.0, dim=0), torch.tensor([0.25, 0.5, 1.5]))


def test_sft_step_is_response_token_nll_and_accumulates():
    model = _Logits()
    batch = tokenize_prompt_and_output([[1, 2], [3]], [[4, 5, 6], [2]], pad_id=0)
    out = response_log_probs(model, batch["input_ids"], batch["labels"])
    loss, meta = sft_microbatch_train_step(out["log_probs"], batch["response_mask"], 2)
    ce = F.cross_entropy(model(batch["input_ids"])[batch["response_mask"]], batch["labels"][batch["response_mask"]])
    assert loss.item() == pytest.approx(ce.item() / 2)
    assert meta["response_tokens"].item() == 4
    grad_full = torch.autograd.grad(ce, model.table)[0]
    torch.testing.assert_close(model.table.grad, grad_full / 2)
    # A second microbatch adds its scaled gradient: two halves of 1/2 make one full gradient.
    out = response_log_probs(model, batch["input_ids"], batch["labels"])
    sft_microbatch_train_step(out["log_probs"], batch["response_mask"], 2)
    torch.testing.assert_close(model.table.grad, grad_full)


def test_sft_step_with_normalize_constant():
    model = _Logits()
    batch = tokenize_prompt_and_output([[1], [3]], [[4, 5], [2]], pad_id=0)
    out = response_log_probs(model, batch["input_ids"], batch["labels"])
    loss, _ = sft_microbatch_train_step(out["log_probs"], batch["response_mask"], 1, normalize_constant=10.0)
    nll = -(out["log_probs"] * batch["response_mask"]).sum(-1) / 10.0
    assert loss.item() == pytest.approx(nll.mean().item())
