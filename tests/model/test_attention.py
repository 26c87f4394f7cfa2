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


# ---------------------------------------------------------------- GQA, QK-norm, sliding window


def _gqa_and_repeated(seed=0, backend="math", **kwargs):
    """A GQA model (4 query heads, 2 kv heads) and the same model with each kv head's rows
    repeated into a full-head k/v (num_kv_heads = num_heads)."""
    from scratchlm.model.transformer import TransformerLM

    shape = dict(vocab_size=37, context_length=24, d_model=32, num_layers=2, num_heads=4, d_ff=48)
    torch.manual_seed(seed)
    gqa = TransformerLM(**shape, num_kv_heads=2, attention_backend=backend, **kwargs)
    full = TransformerLM(**shape, attention_backend=backend, **kwargs)
    state = gqa.state_dict()
    for key, w in list(state.items()):
        if key.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            # kv head j serves query heads 2j and 2j + 1 (h // 2)
            state[key] = w.unflatten(0, (2, -1)).repeat_interleave(2, dim=0).flatten(0, 1)
    full.load_state_dict(state)
    return gqa, full


def _grads(model, ids):
    model.zero_grad()
    F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("backend,kwargs", [
    ("math", {}), ("math", dict(qk_norm=True, qkv_bias=True)), ("math", dict(sliding_window=5)),
    ("flash_torch", {}),
])
def test_gqa_equals_the_model_with_kv_heads_repeated(backend, kwargs):
    gqa, full = _gqa_and_repeated(backend=backend, **kwargs)
    assert gqa.layers[0].attn.k_proj.weight.shape == (16, 32)
    ids = torch.randint(0, 37, (3, 20))
    torch.testing.assert_close(gqa(ids), full(ids), rtol=1e-5, atol=1e-5)
    g_gqa, g_full = _grads(gqa, ids), _grads(full, ids)
    for key, g in g_gqa.items():
        expected = g_full[key]
        if key.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            expected = expected.unflatten(0, (2, 2, -1)).sum(1).flatten(0, 1)  # a kv head's gradient sums its copies
        torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-5, msg=key)


def test_gqa_fused_projections_match_separate_under_autocast():
    torch.manual_seed(0)
    rope = RotaryEmbedding(10_000.0, 16, 32)
    fused = MultiHeadSelfAttention(64, 4, rope, num_kv_heads=2)
    separate = MultiHeadSelfAttention(64, 4, rope, num_kv_heads=2, fused_qkv=False)
    separate.load_state_dict(fused.state_dict())
    x = torch.randn(2, 7, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_fused, out_separate = fused(x), separate(x)
    torch.testing.assert_close(out_fused, out_separate)
    g = torch.randn_like(out_fused)
    (out_fused.float() * g).sum().backward()
    (out_separate.float() * g).sum().backward()
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, dict(separate.named_parameters())[name].grad, msg=name)


def test_gqa_shapes_init_and_errors():
    from scratchlm.model.attention import qkv_init_std

    attn = MultiHeadSelfAttention(32, 8, num_kv_heads=2)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (8, 32)
    assert "num_kv_heads=2" in repr(attn)
    # fused: the Glorot scale of the one 32 -> 32 + 2·8 map; without GQA the old sqrt(2 / 4d)
    assert qkv_init_std(32, "fused", 8) == (math.sqrt(2 / (32 + 48)),) * 2
    assert qkv_init_std(32, "fused") == (math.sqrt(2 / 128),) * 2
    assert qkv_init_std(32, "separate", 8) == (math.sqrt(2 / 64), math.sqrt(2 / 40))
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadSelfAttention(32, 8, num_kv_heads=3)
    with pytest.raises(ValueError, match="sliding_window"):
        MultiHeadSelfAttention(32, 8, sliding_window=0)


def test_qk_norm_matches_a_direct_reference():
    torch.manual_seed(0)
    d = D // H
    rope = RotaryEmbedding(10_000.0, d, 32)
    attn = MultiHeadSelfAttention(D, H, rope, qk_norm=True, norm_eps=1e-6)
    assert {"q_norm.weight", "k_norm.weight"} <= set(attn.state_dict())
    assert attn.q_norm.weight.shape == (d,)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 2.0)
        attn.k_norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(2, 9, D)
    B, T = 2, 9

    def heads(w, norm=None):
        t = F.linear(x, w).view(B, T, H, d)
        if norm is not None:  # RMS over each head's d features
            t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
        return t.transpose(1, 2)

    q = rope(heads(attn.q_proj.weight, attn.q_norm), torch.arange(T))
    k = rope(heads(attn.k_proj.weight, attn.k_norm), torch.arange(T))
    out = F.scaled_dot_product_attention(q, k, heads(attn.v_proj.weight), is_causal=True)
    expected = F.linear(out.transpose(1, 2).reshape(B, T, D), attn.output_proj.weight)
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)
    no_norm = MultiHeadSelfAttention(D, H, rope)
    no_norm.load_state_dict({k: v for k, v in attn.state_dict().items() if "norm" not in k})
    assert (no_norm(x) - expected).abs().max() > 1e-3  # the norm changes the result


def test_sliding_window_mask_example():
    from scratchlm.model.attention import sliding_window_mask

    assert sliding_window_mask(3, 3, 2).tolist() == [[True, False, False], [True, True, False], [False, True, True]]
    assert sliding_window_mask(2, 4, 2).tolist() == [[False, True, True, False], [False, False, True, True]]


def _window_reference(attn, x, window):
    # Attention by hand: query i sees keys j with i - window < j <= i; kv head h // groups.
    B, T, _ = x.shape
    d = attn.head_dim
    q = F.linear(x, attn.q_proj.weight).view(B, T, attn.num_heads, d).transpose(1, 2)
    k = F.linear(x, attn.k_proj.weight).view(B, T, attn.num_kv_heads, d).transpose(1, 2)
    v = F.linear(x, attn.v_proj.weight).view(B, T, attn.num_kv_heads, d).transpose(1, 2)
    q, k = attn.rope(q, torch.arange(T)), attn.rope(k, torch.arange(T))
    groups = attn.num_heads // attn.num_kv_heads
    mask = torch.tensor([[i - window < j <= i for j in range(T)] for i in range(T)])
    out = torch.empty_like(q)
    for h in range(attn.num_heads):
        scores = q[:, h] @ k[:, h // groups].transpose(-1, -2) / math.sqrt(d)
        out[:, h] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, h // groups]
    return F.linear(out.transpose(1, 2).reshape(B, T, -1), attn.output_proj.weight)


@pytest.mark.parametrize("backend,native", [("math", True), ("flash_torch", True), ("flash_torch", False)])
def test_sliding_window_matches_a_direct_reference(backend, native, caplog):
    torch.manual_seed(0)
    rope = RotaryEmbedding(10_000.0, 8, 32)
    attn = MultiHeadSelfAttention(32, 4, rope, num_kv_heads=2, sliding_window=4, backend=backend)
    if not native:  # a backend without windows: the call falls back to "math", logged once
        attn._backend.sliding_window = False
    x = torch.randn(2, 13, 32)
    with caplog.at_level("WARNING", logger="scratchlm.model.attention_backends"):
        out = attn(x)
        attn(x)
    torch.testing.assert_close(out, _window_reference(attn, x, 4), rtol=1e-5, atol=1e-6)
    fallbacks = [r for r in caplog.records if "sliding window" in r.getMessage()]
    assert len(fallbacks) == (0 if native else 1)  # logged once, only for a real fallback
    # a sequence no longer than the window is plain causal attention, on the backend itself
    short = torch.randn(2, 4, 32)
    torch.testing.assert_close(attn(short), _window_reference(attn, short, 100), rtol=1e-5, atol=1e-6)


def test_sliding_window_with_padding_and_kv_cache():
    torch.manual_seed(0)
    rope = RotaryEmbedding(10_000.0, 8, 32)
    attn = MultiHeadSelfAttention(32, 4, rope, num_kv_heads=2, sliding_window=3)
    x = torch.randn(2, 10, 32)
    full = attn(x)
    # left padding: each row as if alone
    padded = torch.cat([torch.zeros(2, 4, 32), x], dim=1)
    mask = torch.arange(14) >= 4
    out = attn(padded, attention_mask=mask.expand(2, 14))
    torch.testing.assert_close(out[:, 4:], full, rtol=1e-5, atol=1e-6)
    # incremental decoding over a cache of the kv heads only
    cache = KVCache(1, 2, 2, 10, 8, sliding_window=3)
    steps = [attn(x[:, :6], kv_cache=cache)] + [attn(x[:, t:t + 1], kv_cache=cache) for t in range(6, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6)
    assert cache._k[0].shape == (2, 2, 10, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        attn(x[:, :2], kv_cache=KVCache(1, 2, 2, 10, 8))  # a cache without the model's window


class _RecordingBackend:
    """Stands in for a flash backend with the packed q|k|v path; records how it was called."""

    name, heads_first, padding_mask, kv_cache, packed_qkv, sliding_window = "fake", False, False, False, True, False

    def __init__(self, grouped_kv):
        self.grouped_kv = grouped_kv
        self.calls = []

    def runs_on(self, device):
        return True

    def attend(self, q, k, v, is_causal):
        self.calls.append(("attend", k.shape[1]))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def attend_qkv(self, qkv, num_heads, cos, sin, is_causal, **kwargs):
        self.calls.append(("attend_qkv", kwargs))
        B, T, _ = qkv.shape
        return torch.zeros(B, num_heads, T, 32 // num_heads, dtype=qkv.dtype)


@pytest.mark.parametrize("num_kv_heads,grouped", [(4, False), (2, False), (2, True)])
def test_packed_path_passes_num_kv_heads_only_to_a_grouped_backend(num_kv_heads, grouped):
    attn = MultiHeadSelfAttention(32, 4, num_kv_heads=num_kv_heads)
    attn._backend = fake = _RecordingBackend(grouped)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn(torch.randn(1, 5, 32))
    if num_kv_heads == 4:
        assert fake.calls == [("attend_qkv", {})]  # the call of a backend that predates GQA
    elif grouped:
        assert fake.calls == [("attend_qkv", {"num_kv_heads": 2})]
    else:
        assert fake.calls == [("attend", 4)]  # not packed; k and v repeated to the query heads
