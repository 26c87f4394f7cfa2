import math

import pytest
import torch
import torch.nn.functional as F

from scratchlm.model.functional import (
    causal_mask,
    cross_entropy,
    log_softmax,
    scaled_dot_product_attention,
    silu,
    softmax,
)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_matches_torch(dim):
    x = torch.randn(4, 5, 7, dtype=torch.float64)
    torch.testing.assert_close(softmax(x, dim), F.softmax(x, dim=dim))


def test_softmax_is_stable_for_large_inputs():
    x = torch.tensor([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -999.0]])
    out = softmax(x, -1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.softmax(x, dim=-1))
    torch.testing.assert_close(softmax(x + 1e4, -1), softmax(x, -1))


def test_softmax_with_neg_inf_entries():
    x = torch.tensor([[0.0, float("-inf"), 1.0]])
    torch.testing.assert_close(softmax(x, -1), F.softmax(x, dim=-1))


def test_log_softmax_matches_torch():
    x = torch.randn(3, 11, dtype=torch.float64) * 50
    torch.testing.assert_close(log_softmax(x, -1), F.log_softmax(x, dim=-1))


def test_silu_matches_torch():
    x = torch.randn(100, dtype=torch.float64) * 10
    torch.testing.assert_close(silu(x), F.silu(x))


@pytest.mark.parametrize("shape", [(8,), (2, 8), (2, 3, 8)])
def test_cross_entropy_matches_torch(shape):
    V = 13
    logits = torch.randn(*shape, V, dtype=torch.float64)
    targets = torch.randint(0, V, shape)
    ours = cross_entropy(logits, targets)
    ref = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-6)


def test_cross_entropy_large_logits_is_finite_and_correct():
    logits = torch.tensor([[1e4, 0.0, -1e4], [5e3, 5e3 + 1.0, 0.0]])
    targets = torch.tensor([1, 0])
    ours = cross_entropy(logits, targets)
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours, F.cross_entropy(logits, targets))
    # Exact value: row 0 loses 1e4; row 1 loses log(1 + e) - 0 ... computed in float64 below.
    expected = (1e4 + (math.log(1 + math.e) - 0.0)) / 2
    assert ours.item() == pytest.approx(expected, rel=1e-5)


def test_cross_entropy_bf16_upcasts():
    logits = torch.randn(4, 6, 50) * 5
    targets = torch.randint(0, 50, (4, 6))
    ours = cross_entropy(logits.bfloat16(), targets)
    assert ours.dtype == torch.float32
    ref = F.cross_entropy(logits.bfloat16().float().reshape(-1, 50), targets.reshape(-1))
    torch.testing.assert_close(ours, ref)


def test_cross_entropy_ignore_index_and_gradient():
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, :2] = -100
    ours = cross_entropy(logits, targets, ignore_index=-100)
    ref = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(ours.double(), ref)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_ref,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(g_ours, g_ref)


def test_cross_entropy_shape_mismatch():
    with pytest.raises(ValueError):
        cross_entropy(torch.randn(2, 3, 5), torch.zeros(2, dtype=torch.long))


def test_causal_mask():
    assert causal_mask(3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert causal_mask(2, 3).tolist() == [[True, True, False], [True, True, True]]
    assert causal_mask(1, 4).tolist() == [[True, True, True, True]]


@pytest.mark.parametrize("leading", [(), (3,), (2, 4), (2, 2, 3)])
def test_sdpa_matches_torch_without_mask(leading):
    q = torch.randn(*leading, 5, 8, dtype=torch.float64)
    k = torch.randn(*leading, 7, 8, dtype=torch.float64)
    v = torch.randn(*leading, 7, 6, dtype=torch.float64)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("leading", [(3,), (2, 4)])
def test_sdpa_matches_torch_with_mask(leading):
    q = torch.randn(*leading, 5, 8, dtype=torch.float64)
    k = torch.randn(*leading, 7, 8, dtype=torch.float64)
    v = torch.randn(*leading, 7, 8, dtype=torch.float64)
    mask = torch.rand(*leading, 5, 7) > 0.4
    mask[..., 0] = True  # every query sees at least one key, so torch's output is defined
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    )


def test_sdpa_causal_mask_matches_torch_is_causal():
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v, causal_mask(6)), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )


def test_sdpa_broadcast_mask_and_fully_masked_row():
    q, k, v = (torch.randn(2, 2, 4, 4, dtype=torch.float64) for _ in range(3))
    mask = causal_mask(4).clone()
    mask[0] = False  # the first query sees nothing
    out = scaled_dot_product_attention(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert (out[..., 0, :] == 0).all()
    torch.testing.assert_close(out[..., 1:, :], F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[..., 1:, :])


def test_sdpa_gradients_match_torch():
    q, k, v = (torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = causal_mask(5)
    g_ours = torch.autograd.grad(scaled_dot_product_attention(q, k, v, mask).sum(), (q, k, v))
    g_ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum(), (q, k, v))
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b)


def test_sdpa_low_precision_softmax_in_fp32():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 64, 16) * 3 for _ in range(3))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=causal_mask(64))
    ours = scaled_dot_product_attention(q, k, v, causal_mask(64))
    assert ours.dtype == torch.bfloat16
    # Only the bf16 rounding of the output remains (bf16 scores would be off by ~0.2 here).
    torch.testing.assert_close(ours.float(), ref, rtol=0.01, atol=0.01)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = scaled_dot_product_attention(q.float(), k.float(), v.float(), causal_mask(64))
    torch.testing.assert_close(auto, ref)
