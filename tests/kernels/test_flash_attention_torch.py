import pytest
import torch
import torch.nn.functional as F

from scratchlm.kernels.flash_attention_torch import FlashAttentionTorch, naive_attention


def _inputs(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 1, 8), (2, 17, 16), (3, 100, 8), (2, 3, 45, 16), (1, 2, 64, 32)])
def test_matches_naive_forward_and_grads(shape, is_causal):
    q, k, v = _inputs(shape, seed=sum(shape) + is_causal)
    out = FlashAttentionTorch.apply(q, k, v, is_causal, 16, 8)
    ref = naive_attention(q, k, v, is_causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_sdpa_float32_default_tiles(is_causal):
    q, k, v = _inputs((2, 4, 130, 32), seed=7, dtype=torch.float32)
    out = FlashAttentionTorch.apply(q, k, v, is_causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    (out.square().sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref.square().sum().backward()
    for a, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-4)


def _saved_by_forward(fn, *args):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, saved


def test_saves_one_logsumexp_per_row():
    q, k, v = _inputs((2, 3, 20, 8), seed=3)
    out, saved = _saved_by_forward(FlashAttentionTorch.apply, q, k, v, True)
    lse = [t for t in saved if t.shape != q.shape]
    assert len(saved) == 5 and len(lse) == 1 and lse[0].shape == (2, 3, 20)
    # L is the log-sum-exp of the scaled, masked scores.
    with torch.no_grad():
        scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5
        scores = scores.masked_fill(~torch.ones(20, 20, dtype=torch.bool).tril(), float("-inf"))
        torch.testing.assert_close(lse[0], torch.logsumexp(scores, -1))
    q3, k3, v3 = _inputs((4, 9, 8), seed=4)
    _, saved3 = _saved_by_forward(FlashAttentionTorch.apply, q3, k3, v3)
    assert [t.shape for t in saved3 if t.shape != q3.shape] == [(4, 9)]


def test_rejects_mismatched_shapes():
    q = torch.randn(2, 5, 8)
    with pytest.raises(ValueError):
        FlashAttentionTorch.apply(q, torch.randn(2, 5, 4), torch.randn(2, 5, 4))
