"""The attention backends with grouped-query k/v and sliding windows, against SDPA on k and v
repeated to q's heads (the backends themselves live in scratchlm.model.attention_backends)."""

import pytest
import torch
import torch.nn.functional as F

from scratchlm.model.attention_backends import ATTENTION_BACKENDS, make_attention_backend
from scratchlm.model.rope import RotaryEmbedding, apply_rope

BACKENDS = ["math", "flash_torch", "flash_triton"]


def _dtype(name):
    return torch.float32 if name == "flash_triton" else torch.float64  # the Triton ops take no float64


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)


def _repeated_sdpa(q, k, v, mask):
    G = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask)


def _window_mask(T, window):
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (j > i - window)


def test_backends_say_they_take_grouped_kv_and_windows():
    for name in BACKENDS:
        assert ATTENTION_BACKENDS[name].grouped_kv and ATTENTION_BACKENDS[name].sliding_window


@pytest.mark.parametrize("window", [None, 1, 6, 50])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("name", BACKENDS)
def test_attend_grouped_kv_and_window_matches_sdpa_on_repeated_kv(name, kv_heads, window):
    dtype = _dtype(name)
    torch.manual_seed(kv_heads * 10 + (window or 0))
    q = torch.randn(2, 4, 23, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 23, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    out = make_attention_backend(name).attend(q, k, v, True, window=window)
    ref = _repeated_sdpa(q, k, v, _window_mask(23, window))
    torch.testing.assert_close(out, ref, **_tol(dtype))
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, **_tol(dtype))


@pytest.mark.parametrize("name", BACKENDS)
def test_attend_without_causality_and_grouped_kv(name):
    dtype = _dtype(name)
    q = torch.randn(1, 6, 9, 8, dtype=dtype)
    k, v = (torch.randn(1, 2, 9, 8, dtype=dtype) for _ in range(2))
    torch.testing.assert_close(make_attention_backend(name).attend(q, k, v, False), _repeated_sdpa(q, k, v, None),
                               **_tol(dtype))
    with pytest.raises(ValueError, match="is_causal=True"):
        make_attention_backend(name).attend(q, k, v, False, window=3)


def test_math_attend_masked_grouped_kv_with_cache_and_padding_masks():
    math = make_attention_backend("math")
    q = torch.randn(2, 4, 3, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 8, dtype=torch.float64) for _ in range(2))
    cache_mask = torch.ones(3, 7, dtype=torch.bool).tril(4)  # the last 3 of 7 positions
    padding = cache_mask.expand(2, 1, 3, 7).clone()
    padding[0, :, :, :2] = False  # a left-padded sequence
    per_head = padding.expand(2, 4, 3, 7).clone()
    per_head[:, 1, :, 3] = False
    for mask in (cache_mask, padding, per_head, None):
        torch.testing.assert_close(math.attend_masked(q, k, v, mask), _repeated_sdpa(q, k, v, mask),
                                   rtol=1e-10, atol=1e-10)


def test_math_window_with_more_keys_than_queries_counts_positions_from_the_end():
    # decoding: 2 queries at positions 5 and 6 of 7 keys, window 3 -> keys 3..5 and 4..6
    math = make_attention_backend("math")
    q, k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 1, 7, 4), torch.randn(1, 1, 7, 4)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, 3:6] = mask[1, 4:7] = True
    torch.testing.assert_close(math.attend(q, k, v, True, window=3), _repeated_sdpa(q, k, v, mask))


@pytest.mark.parametrize("window", [None, 4])
def test_flash_triton_attend_qkv_takes_kv_heads(window):
    backend = make_attention_backend("flash_triton")
    B, T, H, Hkv, d = 2, 11, 4, 2, 8
    cos, sin = RotaryEmbedding(10_000.0, d, 32).tables(torch.arange(T))
    qkv = torch.randn(B, T, (H + 2 * Hkv) * d, requires_grad=True)
    out = backend.attend_qkv(qkv, H, cos, sin, True, Hkv, window=window)
    q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([H * d, Hkv * d, Hkv * d], -1))
    q, k = (apply_rope(t, cos.unsqueeze(-2), sin.unsqueeze(-2)) for t in (q, k))
    ref = _repeated_sdpa(*(t.transpose(1, 2) for t in (q, k, v)), _window_mask(T, window))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, g)
    (ref_grad,) = torch.autograd.grad(ref, qkv, g)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)
