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


# --- grouped-query attention and sliding windows ----------------------------------------------

def _window_mask(T: int, window: int | None) -> torch.Tensor:
    # (T, T), True = may attend: causal, and within the last `window` keys when given
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (j > i - window)


def _sdpa_on_repeated_kv(q, k, v, is_causal, window, g):
    # SDPA on k and v repeated to q's heads, its gradients for k and v summed over each group.
    G = q.shape[-3] // k.shape[-3]
    q_ = q.detach().requires_grad_()
    k_, v_ = (t.detach().repeat_interleave(G, dim=-3).requires_grad_() for t in (k, v))
    mask = _window_mask(q.shape[-2], window) if is_causal else None
    out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)
    dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), g)
    dk, dv = (t.unflatten(-3, (k.shape[-3], G)).sum(-3) for t in (dk, dv))
    return out, (dq, dk, dv)


@pytest.mark.parametrize("tiles", [(16, 8), (64, 64), (8, 32)])
@pytest.mark.parametrize("is_causal,window", [(False, None), (True, None), (True, 1), (True, 7), (True, 10), (True, 24),
                                              (True, 200)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (3, 3)])
def test_grouped_kv_and_window_match_sdpa_on_repeated_kv(heads, kv_heads, is_causal, window, tiles):
    g = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + (window or 0))
    B, T, d = 2, 45, 16
    q = torch.randn(B, heads, T, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, T, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = FlashAttentionTorch.apply(q, k, v, is_causal, *tiles, window)
    assert out.shape == q.shape
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref, ref_grads = _sdpa_on_repeated_kv(q, k, v, is_causal, window, grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b, t in zip(grads, ref_grads, (q, k, v)):
        assert a.shape == t.shape
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_window_on_3d_inputs_and_lse_matches_masked_logsumexp():
    q, k, v = _inputs((3, 30, 8), seed=11)
    out = FlashAttentionTorch.apply(q, k, v, True, 8, 8, 5)
    mask = _window_mask(30, 5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-10, atol=1e-10)
    from scratchlm.kernels.flash_attention_torch import flash_attention_forward_torch

    _, lse = flash_attention_forward_torch(q.detach(), k.detach(), v.detach(), True, window=5, q_tile=8, k_tile=8)
    scores = (q @ k.transpose(-1, -2)).detach() / 8 ** 0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1))


def test_window_at_least_the_length_is_plain_causal_attention():
    q, k, v = _inputs((1, 2, 33, 8), seed=12)
    plain = FlashAttentionTorch.apply(q, k, v, True, 16, 16)
    torch.testing.assert_close(FlashAttentionTorch.apply(q, k, v, True, 16, 16, 33), plain, rtol=0, atol=0)
    assert not torch.allclose(FlashAttentionTorch.apply(q, k, v, True, 16, 16, 32), plain)


def test_rejects_kv_heads_that_do_not_divide_and_windows_without_causality():
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(ValueError, match="divides"):
        FlashAttentionTorch.apply(q, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8))
    with pytest.raises(ValueError, match="incompatible"):  # k and v of different heads
        FlashAttentionTorch.apply(q, torch.randn(2, 2, 5, 8), torch.randn(2, 1, 5, 8))
    k = torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match="is_causal=True"):
        FlashAttentionTorch.apply(q, k, k, False, 64, 64, 3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive number of keys"):
            FlashAttentionTorch.apply(q, k, k, True, 64, 64, bad)
