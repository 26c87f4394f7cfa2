import pytest
import torch

from scratchlm.model.rope import RotaryEmbedding


def _complex_rope(x, positions, theta):
    """Reference: view adjacent pairs as complex numbers and multiply by e^{i p θ_i}."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double().unsqueeze(-1) * freqs  # (..., T, d/2)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def test_matches_complex_formula():
    rope = RotaryEmbedding(10_000.0, 16, 64)
    x = torch.randn(2, 10, 16)
    pos = torch.randint(0, 64, (2, 10))
    torch.testing.assert_close(rope(x, pos).double(), _complex_rope(x, pos, 10_000.0), rtol=1e-5, atol=1e-5)


def test_head_dims_broadcast_and_default_positions():
    rope = RotaryEmbedding(500.0, 8, 32)
    x = torch.randn(2, 3, 5, 8)  # (B, H, T, d)
    out = rope(x)
    ref = _complex_rope(x, torch.arange(5).expand(2, 3, 5), 500.0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    out = rope(x, pos.unsqueeze(1))  # (B, 1, T) broadcasts over heads
    torch.testing.assert_close(out.double(), _complex_rope(x, pos.unsqueeze(1).expand(2, 3, 5), 500.0), rtol=1e-5, atol=1e-5)


def test_interleaved_not_halves():
    rope = RotaryEmbedding(10_000.0, 4, 4)
    x = torch.tensor([1.0, 0.0, 0.0, 0.0])
    out = rope(x.view(1, 4), torch.tensor([1]))
    # pair 0 is (x[0], x[1]) rotated by angle 1: (cos 1, sin 1); the second pair stays 0.
    torch.testing.assert_close(out[0], torch.tensor([torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0)), 0.0, 0.0]))


def test_relative_property_and_norm():
    rope = RotaryEmbedding(10_000.0, 32, 128)
    q, k = torch.randn(32), torch.randn(32)

    def score(i, j):
        return (rope(q.view(1, 32), torch.tensor([i])) * rope(k.view(1, 32), torch.tensor([j]))).sum()

    torch.testing.assert_close(score(10, 3), score(50, 43), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rope(q.view(1, 32), torch.tensor([77])).norm(), q.norm())


def test_buffers_not_in_state_dict_and_dtype_kept():
    rope = RotaryEmbedding(10_000.0, 8, 16)
    assert rope.state_dict() == {}
    assert rope.cos.shape == (16, 4)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert rope(x).dtype == torch.bfloat16


def test_odd_dim_rejected():
    with pytest.raises(ValueError):
        RotaryEmbedding(10_000.0, 7, 16)


def test_tables_survive_casts_and_to_empty():
    rope = RotaryEmbedding(10_000.0, 8, 4096)
    cos = rope.cos.clone()
    rope.to(torch.bfloat16)
    assert rope.cos.dtype == torch.float32 and torch.equal(rope.cos, cos)
    meta = RotaryEmbedding(10_000.0, 8, 4096, device="meta")
    meta.to_empty(device="cpu")
    assert torch.equal(meta.cos, cos) and torch.equal(meta.sin, rope.sin)
