import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from scratchlm.infer.kv_cache import KVCache
from scratchlm.model.attention import MultiHeadSelfAttention
from scratchlm.model.layers import Linear
from scratchlm.model.rope import RotaryEmbedding

D, H = 16, 4


def _reference(attn, x, positions=None):
    B, T, _ = x.shape

    def heads(w):
        return F.linear(x, w).view(B, T, H, D // H).transpose(1, 2)

    q, k, v = heads(attn.q_proj.weight), heads(attn.k_proj.weight), heads(attn.v_proj.weight)
    if attn.rope is not None:
        pos = torch.arange(T) if positions is None else positions.unsqueeze(1)
        q, k = attn.rope(q, pos), attn.rope(k, pos)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(1, 2).reshape(B, T, D), attn.output_proj.weight)


def test_submodules_and_keys():
    attn = MultiHeadSelfAttention(D, H)
    assert sorted(attn.state_dict()) == [f"{n}_proj.weight" for n in ("k", "output", "q", "v")]
    assert attn.q_proj.weight.shape == (D, D)


@pytest.mark.parametrize("use_rope", [False, True])
def test_matches_torch_sdpa(use_rope):
    torch.manual_seed(0)
    rope = RotaryEmbedding(10_000.0, D // H, 32) if use_rope else None
    attn = MultiHeadSelfAttention(D, H, rope, dtype=torch.float64)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    torch.testing.assert_close(attn(x), _reference(attn, x))


def test_per_row_positions():
    rope = RotaryEmbedding(10_000.0, D // H, 32)
    attn = MultiHeadSelfAttention(D, H, rope, dtype=torch.float64)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    out = attn(x, pos)
    torch.testing.assert_close(out, _reference(attn, x, pos))
    # RoPE makes attention depend only on relative positions: a shift changes nothing.
    torch.testing.assert_close(out[1], attn(x[1:], torch.arange(5))[0])


def test_causal():
    attn = MultiHeadSelfAttention(D, H, RotaryEmbedding(10_000.0, D // H, 32), dtype=torch.float64)
    x = torch.randn(1, 8, D, dtype=torch.float64)
    y = x.clone()
    y[:, 5:] = torch.randn(1, 3, D, dtype=torch.float64)
    torch.testing.assert_close(attn(x)[:, :5], attn(y)[:, :5])
    assert not torch.allclose(attn(x)[:, 5:], attn(y)[:, 5:])


def test_left_padding_mask_equals_unpadded():
    attn = MultiHeadSelfAttention(D, H, RotaryEmbedding(10_000.0, D // H, 32), dtype=torch.float64)
    x = torch.randn(1, 6, D, dtype=torch.float64)
    padded = torch.cat([torch.randn(1, 3, D, dtype=torch.float64), x], dim=1)  # 3 padding slots
    mask = torch.tensor([[False] * 3 + [True] * 6])
    pos = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4, 5]])
    out = attn(padded, pos, attention_mask=mask)
    torch.testing.assert_close(out[:, 3:], attn(x))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("use_rope", [False, True])
def test_kv_cache_incremental_equals_full(use_rope):
    rope = RotaryEmbedding(10_000.0, D // H, 32) if use_rope else None
    attn = MultiHeadSelfAttention(D, H, rope, dtype=torch.float64)
    x = torch.randn(2, 10, D, dtype=torch.float64)
    full = attn(x)
    cache = KVCache(1, 2, H, 16, D // H)
    parts = [attn(x[:, :4], kv_cache=cache)]
    parts += [attn(x[:, t : t + 1], kv_cache=cache) for t in range(4, 7)]
    parts.append(attn(x[:, 7:], kv_cache=cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full)
    assert cache.seq_len == 10


def test_kv_cache_with_padding_matches_unpadded_rows():
    attn = MultiHeadSelfAttention(D, H, RotaryEmbedding(10_000.0, D // H, 32), dtype=torch.float64)
    a, b = torch.randn(1, 6, D, dtype=torch.float64), torch.randn(1, 4, D, dtype=torch.float64)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 2, D, dtype=torch.float64), b], 1)])  # b left-padded by 2
    cache = KVCache(1, 2, H, 8, D // H, pad_lens=[0, 2])
    out = torch.cat([attn(batch[:, :3], kv_cache=cache), attn(batch[:, 3:], kv_cache=cache)], 1)
    torch.testing.assert_close(out[0], attn(a)[0])
    torch.testing.assert_close(out[1, 2:], attn(b)[0])


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        MultiHeadSelfAttention(D, H, backend="nope")


@pytest.mark.skipif(
    importlib.util.find_spec("scratchlm.kernels.flash_attention_torch") is None, reason="flash_torch not present"
)
def test_flash_torch_backend_matches_math():
    torch.manual_seed(0)
    rope = RotaryEmbedding(10_000.0, D // H, 64)
    math_attn = MultiHeadSelfAttention(D, H, rope)
    flash_attn = MultiHeadSelfAttention(D, H, rope, backend="flash_torch")
    flash_attn.load_state_dict(math_attn.state_dict())
    x = torch.randn(2, 40, D, requires_grad=True)
    out_m, out_f = math_attn(x), flash_attn(x)
    torch.testing.assert_close(out_f, out_m, rtol=1e-4, atol=1e-5)
    g_m = torch.autograd.grad(out_m.square().sum(), x)[0]
    g_f = torch.autograd.grad(out_f.square().sum(), x)[0]
    torch.testing.assert_close(g_f, g_m, rtol=1e-4, atol=1e-4)


def test_flash_triton_backend_falls_back_on_cpu():
    attn = MultiHeadSelfAttention(D, H, backend="flash_triton", dtype=torch.float64)
    x = torch.randn(1, 5, D, dtype=torch.float64)
    torch.testing.assert_close(attn(x), _reference(attn, x))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_torch", "flash_triton"])
def test_flash_backends_on_gpu(backend):
    module = "scratchlm.kernels.flash_attention_" + backend.split("_")[1]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} not present")
    torch.manual_seed(0)
    rope = RotaryEmbedding(10_000.0, 64, 512, device="cuda")
    ref = MultiHeadSelfAttention(256, 4, rope, device="cuda")
    fast = MultiHeadSelfAttention(256, 4, rope, backend=backend, device="cuda")
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(2, 300, 256, device="cuda", requires_grad=True)
    out_r, out_f = ref(x), fast(x)
    torch.testing.assert_close(out_f, out_r, rtol=2e-3, atol=2e-3)
    g_r = torch.autograd.grad(out_r.square().sum(), x)[0]
    g_f = torch.autograd.grad(out_f.square().sum(), x)[0]
    torch.testing.assert_close(g_f, g_r, rtol=5e-3, atol=5e-3)


def test_qkv_init_is_the_glorot_scale_of_the_fused_projection():
    # q, k, v are blocks of one d -> 3d map: std sqrt(2 / (d + 3d)), as torch.nn.Linear(d, 3 * d) would get
    # with the same Glorot rule; output_proj is a d -> d map of its own: sqrt(2 / (d + d)).
    torch.manual_seed(0)
    d = 512
    attn = MultiHeadSelfAttention(d, 16)
    fused = math.sqrt(2 / (d + 3 * d))
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.std().item() == pytest.approx(fused * 0.9865, rel=0.03)  # 3σ truncation: -1.3%
        assert proj.weight.abs().max().item() <= 3 * fused + 1e-6
    assert attn.output_proj.weight.std().item() == pytest.approx(math.sqrt(2 / (2 * d)) * 0.9865, rel=0.03)
    # The same draws as the per-block scale, shrunk by sqrt(2): changing the scale moved no RNG stream.
    torch.manual_seed(0)
    per_block = Linear(d, d)
    torch.testing.assert_close(attn.q_proj.weight, per_block.weight * math.sqrt(0.5))


def test_separate_qkv_init_keeps_the_per_projection_scale():
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(512, 16, qkv_init="separate")
    torch.manual_seed(0)
    torch.testing.assert_close(attn.q_proj.weight, Linear(512, 512).weight)
    with pytest.raises(ValueError, match="qkv_init"):
        MultiHeadSelfAttention(16, 4, qkv_init="xavier")


def test_fused_qkv_matches_separate_projections_and_gradients():
    torch.manual_seed(0)
    rope = RotaryEmbedding(10_000.0, 16, 32)
    fused = MultiHeadSelfAttention(64, 4, rope)
    separate = MultiHeadSelfAttention(64, 4, rope, fused_qkv=False)
    separate.load_state_dict(fused.state_dict())
    calls = []
    for attn in (fused, separate):
        attn.k_proj.forward = lambda t, _m=attn.k_proj: calls.append(1) or Linear.forward(_m, t)
    x = torch.randn(2, 7, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_fused, out_separate = fused(x), separate(x)
    assert len(calls) == 1  # only the separate module called k_proj
    torch.testing.assert_close(out_fused, out_separate)
    g = torch.randn_like(out_fused)
    (out_fused.float() * g).sum().backward()
    (out_separate.float() * g).sum().backward()
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, dict(separate.named_parameters())[name].grad, msg=name)
