import pytest
import torch
import torch.nn.functional as F

from scratchlm.kernels.flash_attention_torch import naive_attention
from scratchlm.kernels.flash_attention_triton import FlashAttentionTriton, flash_attention, triton_available


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / (b.double().norm() + 1e-12)).item()


def _check_against_float64(shape, is_causal, dtype, device, tol):
    torch.manual_seed(hash((shape, is_causal, str(dtype))) % 2**31)
    q, k, v = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    out = FlashAttentionTriton.apply(q, k, v, is_causal)
    assert out.shape == q.shape and out.dtype == dtype
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_attention(q64, k64, v64, is_causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in grads)
    assert _rel(out, ref) < tol
    for a, b in zip(grads, ref_grads):
        assert (a.double() - b).norm() <= tol * b.norm() + 1e-4


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


def test_rejects_bad_inputs():
    with pytest.raises(ValueError):
        FlashAttentionTriton.apply(torch.randn(2, 4, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    with pytest.raises(ValueError):
        FlashAttentionTriton.apply(*(torch.randn(2, 4, 8, dtype=torch.float64) for _ in range(3)))


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
