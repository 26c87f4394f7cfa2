import math

import pytest
import torch
import torch.nn.functional as F

from scratchlm.model.layers import Embedding, Linear, RMSNorm, SiLUFFN, SwiGLU


def test_linear_shape_and_formula():
    lin = Linear(6, 4)
    assert lin.weight.shape == (4, 6)
    assert [n for n, _ in lin.named_parameters()] == ["weight"]
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


def test_linear_init_scale_and_truncation():
    torch.manual_seed(0)
    lin = Linear(512, 256)
    std = math.sqrt(2 / (512 + 256))
    assert lin.weight.std().item() == pytest.approx(std * 0.9865, rel=0.03)  # truncation at 3σ shrinks std by ~1.3%
    assert lin.weight.abs().max().item() <= 3 * std + 1e-6


def test_linear_device_dtype():
    lin = Linear(3, 5, device="cpu", dtype=torch.float64)
    assert lin.weight.dtype == torch.float64 and lin.weight.device.type == "cpu"


def test_embedding_lookup_and_init():
    torch.manual_seed(0)
    emb = Embedding(1000, 64, dtype=torch.float64)
    assert emb.weight.shape == (1000, 64) and emb.weight.dtype == torch.float64
    ids = torch.randint(0, 1000, (3, 7))
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))
    assert emb.weight.abs().max().item() <= 3.0
    assert emb.weight.std().item() == pytest.approx(0.986, rel=0.03)


def _torch_rmsnorm(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def test_rmsnorm_matches_torch():
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(2, 3, 16) * 4
    ref = torch.nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
    torch.testing.assert_close(norm(x), ref(x))
    torch.testing.assert_close(norm(x), _torch_rmsnorm(x, norm.weight, 1e-5))


def test_rmsnorm_bf16_returns_input_dtype_and_computes_in_fp32():
    norm = RMSNorm(64, dtype=torch.bfloat16)
    x = (torch.randn(4, 64) * 100).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    expected = _torch_rmsnorm(x, norm.weight, 1e-5)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert out.float().pow(2).mean(-1).sub(1).abs().max() < 0.02


def test_swiglu_formula():
    ffn = SwiGLU(8, 24, dtype=torch.float64)
    assert [n for n, _ in ffn.named_parameters()] == ["w1.weight", "w2.weight", "w3.weight"]
    assert ffn.w1.weight.shape == (24, 8) and ffn.w2.weight.shape == (8, 24) and ffn.w3.weight.shape == (24, 8)
    x = torch.randn(3, 8, dtype=torch.float64)
    ref = F.linear(F.silu(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)
    torch.testing.assert_close(ffn(x), ref)


def test_silu_ffn_formula():
    ffn = SiLUFFN(8, 32, dtype=torch.float64)
    assert [n for n, _ in ffn.named_parameters()] == ["w1.weight", "w2.weight"]
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(ffn(x), F.linear(F.silu(F.linear(x, ffn.w1.weight)), ffn.w2.weight))


def test_linear_init_std_override():
    torch.manual_seed(0)
    lin = Linear(512, 256, init_std=0.01)
    assert lin.weight.std().item() == pytest.approx(0.01 * 0.9865, rel=0.03)
    assert lin.weight.abs().max().item() <= 0.03 + 1e-6
    lin.reset_parameters()  # a reset keeps the override
    assert lin.weight.abs().max().item() <= 0.03 + 1e-6
