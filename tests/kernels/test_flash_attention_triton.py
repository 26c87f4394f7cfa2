import pytest
import torch
import torch.nn.functional as F

from scratchlm.kernels.flash_attention_torch import naive_attention
from scratchlm.kernels.flash_attention_triton import (
    FlashAttentionTriton,
    flash_attention,
    flash_attention_qkv,
    triton_available,
)
from scratchlm.model.rope import RotaryEmbedding, apply_rope


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / (b.double().norm() + 1e-12)).item()


def _reference(q, k, v, is_causal, window=None):
    # float64 attention on k and v repeated to q's heads (autograd sums their gradients over
    # each group), under an explicit sliding-window mask
    if q.dim() == 4:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if window is None:
        return naive_attention(q, k, v, is_causal)
    T = q.shape[-2]
    i, j = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)[None, :]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill((j > i) | (j <= i - window), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _check_against_float64(shape, is_causal, dtype, device, tol, kv_heads=None, window=None, layout="bhtd"):
    # shape: q's; k and v get kv_heads heads (default: q's). layout "bthd": (B, T, H, d) memory
    # viewed as (B, H, T, d), as the model hands the projections over.
    torch.manual_seed(hash((shape, is_causal, str(dtype), kv_heads, window)) % 2**31)
    kv_shape = shape if kv_heads is None else (shape[0], kv_heads, *shape[2:])

    def make(s):
        if layout == "bthd":
            return torch.randn(s[0], s[2], s[1], s[3], device=device, dtype=dtype).transpose(1, 2).requires_grad_()
        return torch.randn(s, device=device, dtype=dtype, requires_grad=True)

    q, k, v = make(shape), make(kv_shape), make(kv_shape)
    args = (q, k, v, is_causal) if window is None else (q, k, v, is_causal, window)
    out = FlashAttentionTriton.apply(*args)
    assert out.shape == q.shape and out.dtype == dtype
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _reference(q64, k64, v64, is_causal, window)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in grads)
    assert _rel(out, ref) < tol
    # With a window of one key each query sees only itself: the exact dq and dk are 0, and the
    # kernels' are the rounding of dP - D (RMS ~1e-6), so a window gets an RMS floor instead.
    for a, b, t in zip(grads, ref_grads, (q, k, v)):
        assert a.shape == t.shape
        floor = 1e-4 if window is None else 3e-5 * b.numel() ** 0.5
        assert (a.double() - b).norm() <= tol * b.norm() + floor


# --- CPU: the custom ops fall back to the tiled PyTorch reference --------------------------------

@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 17, 16), (3, 100, 8), (1, 1, 1, 8)])
def test_cpu_fallback_matches_float64(shape, is_causal):
    _check_against_float64(shape, is_causal, torch.float32, "cpu", 1e-5)


def test_functional_form_has_autograd():
    q, k, v = [torch.randn(2, 2, 33, 16, requires_grad=True) for _ in range(3)]
    out = flash_attention(q, k, v, True)
    out.sum().backward()
    ref = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert q.grad is not None and k.grad.shape == k.shape


def test_output_is_laid_out_like_sdpa_so_merging_heads_is_a_view():
    # (B, H, T, d) in, whatever the inputs' layout: the output's memory is (B, T, H, d), so
    # out.transpose(1, 2).reshape(B, T, H * d) costs no copy, eagerly and in the fake kernel.
    q, k, v = [torch.randn(2, 3, 17, 16, requires_grad=True) for _ in range(3)]
    out = flash_attention(q, k, v, True)
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fq = torch.empty(2, 3, 17, 16)
        fake_out = flash_attention(fq, fq, fq, True)
    assert fake_out.stride() == out.stride()


def test_gradients_are_laid_out_like_the_output():
    # dq, dk and dv are (B, T, H, d) in memory too, whatever the inputs' layout, so the RoPE
    # backward and the projections' matmuls read them without a transposing copy; the fake
    # backward agrees with the eager one.
    from scratchlm.kernels.flash_attention_triton import flash_attention_backward_op, flash_attention_forward_op

    q, k = [torch.randn(2, 3, 17, 16, requires_grad=True) for _ in range(2)]
    v = torch.randn(2, 17, 3, 16).transpose(1, 2).requires_grad_()
    do = torch.randn(2, 3, 17, 16)
    out, lse = flash_attention_forward_op(q, k, v, True)
    grads = flash_attention_backward_op(do, q, k, v, out, lse, True)
    for g in grads:
        assert g.transpose(1, 2).is_contiguous()
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fq = torch.empty(2, 3, 17, 16)
        fake = flash_attention_backward_op(fq, fq, fq, fq, fq, torch.empty(2, 3, 17), True)
    assert [g.stride() for g in fake] == [g.stride() for g in grads]


def test_rejects_bad_inputs():
    with pytest.raises(ValueError):
        FlashAttentionTriton.apply(torch.randn(2, 4, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    with pytest.raises(ValueError):
        FlashAttentionTriton.apply(*(torch.randn(2, 4, 8, dtype=torch.float64) for _ in range(3)))
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(ValueError, match="kv_heads dividing"):
        flash_attention(q, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8))
    with pytest.raises(ValueError, match="kv_heads dividing"):  # k and v of different heads
        flash_attention(q, torch.randn(2, 2, 5, 8), torch.randn(2, 1, 5, 8))
    with pytest.raises(ValueError, match="kv_heads dividing"):  # k of another length
        flash_attention(q, torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8))
    with pytest.raises(ValueError, match="is_causal=True"):
        flash_attention(q, q, q, False, window=3)
    with pytest.raises(ValueError, match="positive number of keys"):
        flash_attention(q, q, q, True, window=0)


# --- grouped-query attention and sliding windows on CPU (the reference behind the ops) ----------

@pytest.mark.parametrize("is_causal,window", [(False, None), (True, None), (True, 1), (True, 6), (True, 40)])
@pytest.mark.parametrize("shape,kv_heads", [((2, 4, 37, 16), 2), ((1, 6, 20, 8), 1), ((2, 3, 17, 16), 3)])
def test_cpu_fallback_grouped_kv_and_window_match_float64(shape, kv_heads, is_causal, window):
    _check_against_float64(shape, is_causal, torch.float32, "cpu", 1e-5, kv_heads, window, layout="bthd")


def test_window_on_3d_inputs_cpu():
    _check_against_float64((3, 40, 8), True, torch.float32, "cpu", 1e-5, window=9)


def test_grouped_kv_gradients_keep_their_heads_and_layout_in_the_fake_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scratchlm.kernels.flash_attention_triton import flash_attention_backward_op, flash_attention_forward_op

    q = torch.randn(2, 6, 17, 16)
    k, v = (torch.randn(2, 17, 2, 16).transpose(1, 2) for _ in range(2))
    do = torch.randn(2, 6, 17, 16)
    out, lse = flash_attention_forward_op(q, k, v, True, 5)
    grads = flash_attention_backward_op(do, q, k, v, out, lse, True, 5)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    with FakeTensorMode():
        fq, fk = torch.empty(2, 6, 17, 16), torch.empty(2, 2, 17, 16)
        fake_out, fake_lse = flash_attention_forward_op(fq, fk, fk, True, 5)
        fake = flash_attention_backward_op(fq, fq, fk, fk, fq, torch.empty(2, 6, 17), True, 5)
    assert fake_out.stride() == out.stride() and fake_lse.shape == lse.shape
    assert [(g.shape, g.stride()) for g in fake] == [(g.shape, g.stride()) for g in grads]


class _GroupedAttn(torch.nn.Module):
    def __init__(self, window):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(16, 64), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.window = window

    def forward(self, x):  # x: (B, T, 16) -> 4 query heads, 1 kv head of 16
        q = self.q(x).unflatten(-1, (4, 16)).transpose(1, 2)
        k, v = (p(x).unsqueeze(1) for p in (self.k, self.v))
        return flash_attention(q, k, v, True, window=self.window)


@pytest.mark.parametrize("window", [None, 7])
def test_grouped_kv_and_window_compile_full_graph_cpu(window):
    torch._dynamo.reset()
    model = _GroupedAttn(window)
    x = torch.randn(2, 24, 16, requires_grad=True)
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    out.square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    ref = model(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, x.grad, rtol=1e-4, atol=1e-4)


class _Attn(torch.nn.Module):
    def __init__(self, use_function: bool):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))
        self.use_function = use_function

    def forward(self, x):  # x: (B, H, T, 16)
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.use_function:
            return FlashAttentionTriton.apply(q, k, v, True)
        return flash_attention(q, k, v, True)


@pytest.mark.parametrize("use_function", [True, False])
def test_torch_compile_full_graph_cpu(use_function):
    torch._dynamo.reset()
    model = _Attn(use_function)
    x = torch.randn(2, 2, 24, 16, requires_grad=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    model(x).square().sum().backward()
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, x.grad, rtol=1e-4, atol=1e-4)


# --- attention over the concatenated projections, RoPE undone in the backward -----------------

def _rope_then_attention(qkv, num_heads, cos, sin, is_causal=True, num_kv_heads=None, window=None):
    # the composition flash_attention_qkv stands in for, from torch ops
    Hkv = num_heads if num_kv_heads is None else num_kv_heads
    d = qkv.shape[-1] // (num_heads + 2 * Hkv)
    q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([num_heads * d, Hkv * d, Hkv * d], -1))
    if cos is not None:
        q, k = (apply_rope(t, cos.unsqueeze(-2), sin.unsqueeze(-2)) for t in (q, k))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return _reference(q, k, v, is_causal, window)


def _check_qkv_against_float64(B, T, H, D, positions, dtype, device, tol, use_rope=True, kv_heads=None,
                               window=None):
    torch.manual_seed(T * D)
    Hkv = H if kv_heads is None else kv_heads
    rope = RotaryEmbedding(10_000.0, D, 4 * T + 8, device=device)
    cos, sin = rope.tables(positions.to(device)) if use_rope else (None, None)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, device=device, dtype=dtype, requires_grad=True)
    out = flash_attention_qkv(qkv, H, cos, sin, True, kv_heads, window=window)
    assert out.shape == (B, H, T, D) and out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, g)
    assert grad.shape == qkv.shape and grad.is_contiguous()
    qkv64 = qkv.detach().double().requires_grad_()
    ref = _rope_then_attention(qkv64, H, cos, sin, True, kv_heads, window)
    (ref_grad,) = torch.autograd.grad(ref, qkv64, g.double())
    assert _rel(out, ref) < tol
    widths = [H * D, Hkv * D, Hkv * D]
    for block, ref_block in zip(grad.split(widths, -1), ref_grad.split(widths, -1)):  # dq, dk, dv
        assert _rel(block, ref_block) < tol


@pytest.mark.parametrize("use_rope", [True, False])
@pytest.mark.parametrize("per_sequence_positions", [False, True])
def test_qkv_form_cpu_matches_rope_then_attention(per_sequence_positions, use_rope):
    B, T = 2, 19
    positions = torch.stack([torch.arange(T), torch.arange(T) + 7]) if per_sequence_positions else torch.arange(T)
    _check_qkv_against_float64(B, T, 3, 8, positions, torch.float32, "cpu", 1e-5, use_rope)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("use_rope", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1)])
def test_qkv_form_grouped_kv_cpu_matches_rope_then_attention(heads, kv_heads, use_rope, window):
    positions = torch.stack([torch.arange(19), torch.arange(19) + 3])
    _check_qkv_against_float64(2, 19, heads, 8, positions, torch.float32, "cpu", 1e-5, use_rope, kv_heads, window)


def test_qkv_form_fake_gradient_is_one_contiguous_tensor():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scratchlm.kernels.flash_attention_triton import flash_attention_backward_qkv_op

    with FakeTensorMode():
        q = torch.empty(2, 17, 3, 4, 8).select(2, 0).transpose(1, 2)  # (B, H, T, d) view
        lse = torch.empty(2, 4, 17)
        grad = flash_attention_backward_qkv_op(q, q, q, q, q, lse, None, None, True)
        kv = torch.empty(2, 17, 8, 8)[:, :, :2].transpose(1, 2)  # 2 kv heads, (B, Hkv, T, d) view
        grouped = flash_attention_backward_qkv_op(q, q, kv, kv, q, lse, None, None, True, 4)
    assert grad.shape == (2, 17, 3 * 4 * 8) and grad.is_contiguous()
    assert grouped.shape == (2, 17, (4 + 2 * 2) * 8) and grouped.is_contiguous()


def test_qkv_form_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"\(heads \+ 2·kv_heads\)·d\) for 3 heads and 3 kv heads"):
        flash_attention_qkv(torch.randn(2, 5, 40), 3)
    with pytest.raises(ValueError, match="for 4 heads and 2 kv heads"):
        flash_attention_qkv(torch.randn(2, 5, 50), 4, num_kv_heads=2)
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads"):
        flash_attention_qkv(torch.randn(2, 5, 4 * 8 + 2 * 3 * 8), 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="is_causal=True"):
        flash_attention_qkv(torch.randn(2, 5, 48), 2, is_causal=False, window=2)
    with pytest.raises(ValueError, match=r"must be \(5, 4\) or \(2, 5, 4\)"):  # d = 64 / (4 + 2·2) = 8
        flash_attention_qkv(torch.randn(2, 5, 64), 4, torch.randn(5, 8), torch.randn(5, 8), num_kv_heads=2)
    with pytest.raises(ValueError, match="cos and sin"):
        flash_attention_qkv(torch.randn(2, 5, 48), 2, torch.randn(5, 4), None)
    with pytest.raises(ValueError, match=r"must be \(5, 4\) or \(2, 5, 4\)"):
        flash_attention_qkv(torch.randn(2, 5, 48), 2, torch.randn(6, 4), torch.randn(6, 4))


def test_qkv_form_takes_positions_shared_as_a_batch_of_one():
    rope = RotaryEmbedding(10_000.0, 8, 32)
    qkv = torch.randn(2, 7, 48)
    shared = flash_attention_qkv(qkv, 2, *rope.tables(torch.arange(7)))
    torch.testing.assert_close(flash_attention_qkv(qkv, 2, *rope.tables(torch.arange(7)[None])), shared)


def test_qkv_form_compiles_into_one_graph_cpu():
    torch._dynamo.reset()
    rope = RotaryEmbedding(10_000.0, 8, 64)
    cos, sin = rope.tables(torch.arange(24))

    def f(x):
        return flash_attention_qkv(x * 2, 2, cos, sin).square().sum()

    x = torch.randn(2, 24, 48, requires_grad=True)
    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    (grad,) = torch.autograd.grad(loss, x)
    (ref,) = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-4)


# --- GPU: the Triton kernels ------------------------------------------------------------------

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

SHAPES = [(2, 3, 1, 64), (1, 2, 17, 64), (2, 2, 100, 64), (1, 4, 256, 64), (2, 2, 333, 128),
          (1, 2, 1024, 128), (3, 130, 64), (1, 2, 77, 80), (1, 1, 1100, 64),
          (4, 16, 256, 32), (2, 3, 97, 32)]  # head dim 32: the 17M preset (d_model 512, 16 heads)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_float64(shape, is_causal, dtype):
    _check_against_float64(shape, is_causal, dtype, "cuda", 2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("is_causal", [False, True])
def test_triton_autotuned_length_matches_sdpa(is_causal):
    # T >= 1024 in bf16 takes the autotuned path.
    q, k, v = [torch.randn(2, 4, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]
    out = FlashAttentionTriton.apply(q, k, v, is_causal)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.float())
    assert _rel(out, ref) < 1e-2
    for a, b in zip(grads, ref_grads):
        assert _rel(a, b) < 2e-2


# (B, H, Hkv, T, d): ragged lengths (not multiples of any tile), head dims 64 and 128, groups of
# 1 to 8 query heads; T = 1024 in bf16 takes the autotuned tiles.
GROUPED_SHAPES = [(2, 4, 2, 100, 64), (1, 8, 1, 333, 64), (2, 4, 2, 333, 128), (1, 6, 3, 1100, 128),
                  (2, 8, 2, 1024, 64), (1, 4, 4, 200, 64)]
# windows of one key, less than a tile, a tile, not a multiple of one, and past a causal tile pair
WINDOWED_CASES = [(False, None), (True, None), (True, 1), (True, 17), (True, 64), (True, 100), (True, 257)]


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_causal,window", WINDOWED_CASES)
@pytest.mark.parametrize("shape", GROUPED_SHAPES)
def test_triton_grouped_kv_and_window_match_float64(shape, is_causal, window, dtype):
    B, H, Hkv, T, D = shape
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    _check_against_float64((B, H, T, D), is_causal, dtype, "cuda", tol, Hkv, window, layout="bthd")


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_autotuned_grouped_kv_matches_sdpa_with_enable_gqa(head_dim, window):
    q = torch.randn(2, 8, 2048, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 2048, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    out = flash_attention(q, k, v, True, window=window)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    i, j = torch.arange(2048, device="cuda")[:, None], torch.arange(2048, device="cuda")[None, :]
    mask = None if window is None else (j <= i) & (j > i - window)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.float())
    assert _rel(out, ref) < 1e-2
    for a, b in zip(grads, ref_grads):
        assert _rel(a, b) < 2e-2


@pytest.mark.gpu
@needs_triton
def test_triton_handles_transposed_layout_and_saves_one_lse():
    # (B, T, H, d) projections viewed as (B, H, T, d), as the model produces them.
    x = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = x.transpose(1, 2)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = FlashAttentionTriton.apply(q, q, q, True)
    lse = [t for t in saved if t.dtype == torch.float32]
    assert len(lse) == 1 and lse[0].shape == (2, 4, 200)
    ref = naive_attention(q.double(), q.double(), q.double(), True)
    assert _rel(out, ref) < 2e-2
    out.float().square().sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.gpu
@needs_triton
def test_triton_torch_compile_inductor():
    torch._dynamo.reset()
    model = _Attn(True).cuda()
    x = torch.randn(2, 2, 128, 16, device="cuda", requires_grad=True)
    out = torch.compile(model, fullgraph=True)(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("window", [None, 40])
def test_triton_grouped_kv_and_window_torch_compile_inductor(window):
    torch._dynamo.reset()
    model = _GroupedAttn(window).cuda()
    x = torch.randn(2, 128, 16, device="cuda", requires_grad=True)
    out = torch.compile(model, fullgraph=True)(x)
    out.square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    ref = model(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad, x.grad, rtol=1e-4, atol=1e-4)


# --- registration: triton_ops that torch.compile traces into ------------------------------------

def _uses_triton_op() -> bool:
    from scratchlm.kernels.triton_support import op_registration

    return op_registration() == "triton_op"


@needs_triton
@pytest.mark.skipif(not hasattr(torch.library, "triton_op"), reason="torch without triton_op")
def test_ops_are_triton_ops_that_name_their_kernels():
    # triton_op finds the kernels an op launches from its source (``wrap_triton(<name>)``) and
    # torch keys compile caches on their code; a refactor that hides them must fail here.
    from torch._library.triton import get_triton_kernels_for_op

    if not _uses_triton_op():
        pytest.skip("ops are custom ops here (Triton interpreter, or set_op_registration('custom_op'))")

    def names(op):
        return {getattr(getattr(k, "fn", k), "__name__", "") for k in get_triton_kernels_for_op(op)}

    assert names("scratchlm::flash_attention_forward") == {"_fwd_kernel"}
    # the dQ kernel (the default backward) or the delta kernel (the five-matmul one), then dK/dV
    backward = {"_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"}
    assert names("scratchlm::flash_attention_backward") == backward
    assert names("scratchlm::flash_attention_backward_qkv") == backward


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype,shape,tol", [
    (torch.bfloat16, (2, 1024, 4, 64), 2e-2),  # autotuned tiles
    (torch.bfloat16, (2, 2048, 2, 128), 2e-2),
    (torch.bfloat16, (3, 333, 2, 64), 2e-2),  # ragged tiles
    (torch.float32, (2, 77, 3, 32), 1e-4),
])
@pytest.mark.parametrize("per_sequence_positions", [False, True])
def test_triton_qkv_form_matches_float64(dtype, shape, tol, per_sequence_positions):
    B, T, H, D = shape
    positions = torch.arange(T).expand(B, T) + torch.arange(B)[:, None] * 3 if per_sequence_positions else torch.arange(T)
    _check_qkv_against_float64(B, T, H, D, positions, dtype, "cuda", tol)


@pytest.mark.gpu
@needs_triton
def test_triton_qkv_form_without_rope():
    _check_qkv_against_float64(2, 300, 2, 64, torch.arange(300), torch.bfloat16, "cuda", 2e-2, use_rope=False)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype,shape,tol", [
    (torch.bfloat16, (2, 1024, 8, 2, 64), 2e-2),  # autotuned tiles
    (torch.bfloat16, (3, 333, 4, 2, 128), 2e-2),  # ragged tiles
    (torch.bfloat16, (2, 256, 8, 1, 64), 2e-2),
    (torch.float32, (2, 77, 6, 3, 32), 1e-4),
])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("use_rope", [True, False])
def test_triton_qkv_form_grouped_kv_matches_float64(dtype, shape, tol, window, use_rope):
    B, T, H, Hkv, D = shape
    positions = torch.arange(T).expand(B, T) + torch.arange(B)[:, None] * 3
    _check_qkv_against_float64(B, T, H, D, positions, dtype, "cuda", tol, use_rope, Hkv, window)


def _traced_by_aot():
    # ({"forward"/"backward": the graph AOTAutograd hands a compiler}, aot_function(f) that fills
    # it and runs the graphs as they are); skips where the ops are opaque custom ops.
    from functools import partial

    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    if not _uses_triton_op():
        pytest.skip("ops are custom ops here (set_op_registration('custom_op'), or torch without triton_op)")
    graphs = {}

    def keep(name):
        def compiler(gm, _inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    return graphs, partial(aot_function, fw_compiler=keep("forward"), bw_compiler=keep("backward"))


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("seq", [256, 1024])  # fixed tiles; autotuned configs
def test_traced_ops_are_triton_kernel_hops_that_clone_only_outputs(seq):
    # What AOTAutograd hands Inductor: one functional triton kernel HOP per launch, no opaque op.
    # Each HOP clones the tensors torch's analysis of the kernel's IR says it writes; an input
    # among them (q, k, v, ...) means that analysis failed and every launch pays extra copies.
    graphs, aot_function = _traced_by_aot()

    x = torch.randn(2, seq, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = x.transpose(1, 2)
    f = aot_function(lambda a, b, c: FlashAttentionTriton.apply(a, b, c, True))
    out = f(q, q, q)
    out.float().sum().backward()
    ref = naive_attention(q.double(), q.double(), q.double(), True)
    assert _rel(out, ref) < 2e-2
    writes = {"O", "LSE", "DELTA", "DK", "DV", "DQ"}
    for name, gm in graphs.items():
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert not any("scratchlm" in t for t in targets), (name, targets)
        hops = [n for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
        assert len(hops) == (1 if name == "forward" else 2), (name, targets)  # backward: dQ, then dK/dV
        for n in hops:
            assert set(n.kwargs["tensors_to_clone"]) <= writes, (name, n.kwargs["tensors_to_clone"])


@pytest.mark.gpu
@needs_triton
def test_traced_qkv_backward_writes_each_buffer_through_one_argument():
    # The packed gradient is written by two launches (dQ, then dK/dV). torch.compile's functional
    # form of a launch copies each written argument on its own: had one launch received the buffer
    # twice (as DK and DV), each argument would get a private copy and one block's gradients would
    # be dropped. So: one written argument per buffer per launch, each launch consuming the last's.
    graphs, aot_function = _traced_by_aot()

    B, T, H, D = 2, 256, 4, 64
    cos, sin = RotaryEmbedding(10_000.0, D, T, device="cuda").tables(torch.arange(T, device="cuda"))
    qkv = torch.randn(B, T, 3 * H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = aot_function(lambda t, c, s: flash_attention_qkv(t, H, c, s))  # tables as inputs, not constants
    g = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    (grad,) = torch.autograd.grad(f(qkv, cos, sin), qkv, g)
    qkv64 = qkv.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(_rope_then_attention(qkv64, H, cos, sin), qkv64, g.double())
    for block, ref_block in zip(grad.chunk(3, -1), ref.chunk(3, -1)):
        assert _rel(block, ref_block) < 2e-2
    hops = [n for n in graphs["backward"].graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    assert len(hops) == 2
    for n in hops:
        written = [n.kwargs["kwargs"][name] for name in n.kwargs["tensors_to_clone"]]
        assert len(set(written)) == len(written), n.kwargs["tensors_to_clone"]


def _no_compile_caches():
    # Cache hits skip code generation: no code to inspect, no partition counted.
    from contextlib import ExitStack

    import torch._functorch.config
    import torch._inductor.config

    stack = ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def _model_17m(device="cuda"):
    from scratchlm.model.transformer import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16,
                         d_ff=1344, rope_theta=10_000.0, attention_backend="flash_triton", device=device)


@pytest.mark.gpu
@needs_triton
def test_compiled_17m_model_has_no_graph_break_and_launches_kernels_from_inductor():
    from torch._inductor.utils import run_and_get_code

    if not _uses_triton_op():
        pytest.skip("ops are custom ops here (set_op_registration('custom_op'), or torch without triton_op)")
    torch._dynamo.reset()
    model = _model_17m()
    x = torch.randint(0, 10_000, (4, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1

    torch._dynamo.reset()
    compiled = torch.compile(model)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = compiled(x)
        logits.float().square().mean().backward()
        return logits

    with _no_compile_caches():
        logits, codes = run_and_get_code(step)
    code = "\n".join(codes)
    assert "scratchlm.flash_attention" not in code  # no opaque op call left in the compiled code
    for kernel in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        assert kernel in code, kernel
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ref = model(x)
    assert _rel(logits.float(), ref.float()) < 2e-2


@pytest.mark.gpu
@needs_triton
def test_reduce_overhead_17m_model_is_not_partitioned():
    # With opaque custom ops Inductor cut each compiled graph at every attention call, so a
    # training step replayed ~44 CUDA graphs; with triton_ops forward and backward are one each.
    from torch._dynamo.utils import counters

    if not _uses_triton_op():
        pytest.skip("ops are custom ops here (set_op_registration('custom_op'), or torch without triton_op)")
    torch._dynamo.reset()
    counters.clear()
    model = _model_17m()
    compiled = torch.compile(model, mode="reduce-overhead")
    x = torch.randint(0, 10_000, (4, 256), device="cuda")
    losses = []
    with _no_compile_caches():
        for _ in range(4):  # warm-up, recording, replays
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = compiled(x)
            loss = logits.float().square().mean()
            loss.backward()
            losses.append(loss.item())
            model.zero_grad(set_to_none=True)
    assert counters["inductor"]["cudagraph_partitions"] == 0, dict(counters["inductor"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert len(set(round(v, 4) for v in losses)) == 1, losses  # same inputs, same weights


# --- kernels compile for Hopper whatever type the launcher gives the scale ----------------------

@needs_triton
@pytest.mark.parametrize("scale_type", ["fp32", "fp64"])  # Inductor passes a Python float as fp64
@pytest.mark.parametrize("name", ["_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"])
@pytest.mark.parametrize("is_causal,even,windowed,grouped", [(True, True, False, False), (False, False, False, False),
                                                             (True, False, True, True), (True, True, True, False),
                                                             (False, True, False, True)])
@pytest.mark.parametrize("rope,atomic_dq", [(False, False), (True, False), (True, True)])
def test_kernels_compile_for_sm90_with_an_fp32_or_fp64_scale(name, scale_type, is_causal, even, windowed, grouped,
                                                             rope, atomic_dq):
    # Ahead-of-time compilation to a Hopper cubin needs no GPU; an fp64 scale once made the
    # softmax, and so the tl.dot accumulator, fp64, which Triton rejects at compile time.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from scratchlm.kernels import flash_attention_triton as fat

    if fat._interpreting():
        pytest.skip("under TRITON_INTERPRET=1 the kernels are interpreted functions, not compilable")
    fn = getattr(fat, name)
    while not isinstance(fn, JITFunction):  # autotuner / heuristics wrappers
        fn = fn.fn
    if rope and "ROPE" not in fn.arg_names:
        pytest.skip("the forward takes q and k rotated")
    if atomic_dq and "ATOMIC_DQ" not in fn.arg_names:
        pytest.skip("only the dK/dV kernel adds into dQ")
    tensors = {"LSE": "*fp32", "DELTA": "*fp32", "COS": "*fp32", "SIN": "*fp32", "DQA": "*fp32"}
    meta = dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, IS_CAUSAL=is_causal, WINDOWED=windowed,
                GROUPED=grouped, EVEN_D=True, EVEN_M=even, EVEN_N=even, DOT_PRECISION="tf32", ROPE=rope, PACKED=rope,
                ATOMIC_DQ=atomic_dq)
    meta = {k: v for k, v in meta.items() if k in fn.arg_names}
    signature = {}
    for arg in fn.arg_names:
        if arg in meta:
            signature[arg] = "constexpr"
        elif arg == "sm_scale":
            signature[arg] = scale_type
        elif arg.isupper() and arg not in ("H", "N_CTX"):
            signature[arg] = tensors.get(arg, "*bf16")
        else:
            signature[arg] = "i32"
    constexprs = {(fn.arg_names.index(k),): v for k, v in meta.items()}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("kv_heads,window", [(3, None), (1, None), (1, 50), (3, 130)])
def test_launchers_take_explicit_tiles(kv_heads, window):
    # benchmarks/attention_tiles.py launches the kernels with tiles of its choosing: any valid
    # config computes the same attention as the path the model takes (ragged length, masks on).
    from scratchlm.kernels import flash_attention_triton as fa

    B, H, T, D = 2, 3, 333, 64
    q, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o_ref, lse_ref = fa._forward_triton(q, k, v, True, window)
    grads_ref = fa._backward_triton(do, q, k, v, o_ref, lse_ref, True, window)
    o, lse = fa._alloc_out(q).fill_(float("nan")), torch.full_like(lse_ref, float("nan"))
    fa._launch_forward(q, k, v, o, lse, True, autotune=True, tiles=(128, 64, 8, 2), window=window)
    assert _rel(o, o_ref) < 1e-2 and _rel(lse, lse_ref) < 1e-4
    grads = [fa._alloc_out(t).fill_(float("nan")) for t in (q, k, v)]
    fa._launch_backward(do, q, k, v, o_ref, *grads, lse_ref, True, autotune=True,
                        tiles={"dq": (128, 32, 8, 2), "dkdv": (32, 128, 4, 2)}, window=window)
    for g, ref in zip(grads, grads_ref):
        assert _rel(g, ref) < 1e-2
