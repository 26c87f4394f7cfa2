import pytest
import torch

from scratchlm.kernels.triton_support import triton_available
from scratchlm.kernels.swiglu_triton import swiglu
from scratchlm.model.functional import silu


def _check_against_float64(shape, dtype, device, tol):
    torch.manual_seed(sum(shape))
    gate_up = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    out = swiglu(gate_up)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, gate_up, g)
    ref_in = gate_up.detach().double().requires_grad_()
    a, b = ref_in.chunk(2, dim=-1)
    ref = silu(a) * b
    (ref_grad,) = torch.autograd.grad(ref, ref_in, g.double())
    assert grad.shape == gate_up.shape and grad.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(3, 5, 14), (4, 66), (2, 1, 2 * 1030)])
def test_cpu_matches_float64(shape):
    _check_against_float64(shape, torch.float32, "cpu", 1e-5)


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu(torch.randn(2, 7))


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(3, 7, 2 * 33), (8, 1024, 2 * 2048), (1, 2 * 5)])
def test_triton_matches_float64(shape, dtype, tol):
    _check_against_float64(shape, dtype, "cuda", tol)


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_backward_compiles_into_the_graph():
    torch._dynamo.reset()
    x = torch.randn(4, 64, 2 * 96, device="cuda", requires_grad=True)
    loss = torch.compile(lambda t: swiglu(t * 1.5).square().sum(), fullgraph=True)(x)
    (grad,) = torch.autograd.grad(loss, x)
    (ref,) = torch.autograd.grad(swiglu(x * 1.5).square().sum(), x)
    torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-4)
