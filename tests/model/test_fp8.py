"""FP8 matmuls (`scratchlm.model.fp8`) against a float64 emulation of the same quantisation."""

import pytest
import torch

from scratchlm.model.fp8 import E4M3, E5M2, Float8Linear, _quantize, convert_to_float8, float8_linear
from scratchlm.model.layers import Linear
from scratchlm.model.transformer import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")


def _dq(t, dtype, rows=False):
    q, s = _quantize(t, dtype, rows=rows)
    return q.double() * s.double()


def test_quantize_maps_amax_to_the_format_max_and_round_trips():
    t = torch.randn(64, 32) * 7
    for dtype, rel in ((E4M3, 2**-4), (E5M2, 2**-3)):
        q, s = _quantize(t, dtype)
        assert q.dtype == dtype
        assert q.float().abs().max() == torch.finfo(dtype).max
        big = t.abs() > t.abs().max() / 100  # away from the subnormals
        err = ((q.float() * s - t).abs() / t.abs())[big]
        assert err.max() <= rel + 1e-6


def test_forward_and_backward_equal_the_emulated_quantised_products():
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    dy = torch.randn(4, 8, 48)
    y = float8_linear(x, w)
    y.backward(dy)
    x2 = x.detach().reshape(-1, 32)
    y_ref = _dq(x2, E4M3) @ _dq(w.detach(), E4M3).t()
    torch.testing.assert_close(y.detach().reshape(-1, 48).double(), y_ref, rtol=1e-5, atol=1e-5)
    g = dy.reshape(-1, 48)
    dx_ref = _dq(g, E5M2) @ _dq(w.detach(), E4M3)
    dw_ref = _dq(g, E5M2).t() @ _dq(x2, E4M3)
    torch.testing.assert_close(x.grad.reshape(-1, 32).double(), dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), dw_ref, rtol=1e-5, atol=1e-5)


def test_close_to_the_exact_product_and_falls_back_on_odd_sizes():
    torch.manual_seed(1)
    x, w = torch.randn(64, 128), torch.randn(96, 128)
    exact = x @ w.t()
    rel = (float8_linear(x, w) - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.08  # quantised, but within FP8's precision
    x_odd, w_odd = torch.randn(5, 30), torch.randn(20, 30)  # sizes _scaled_mm cannot take: a plain matmul
    torch.testing.assert_close(float8_linear(x_odd, w_odd), x_odd @ w_odd.t())


def test_autocast_output_dtype_and_float32_gradients():
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = float8_linear(x, w)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_convert_keeps_weights_and_keys_and_leaves_embedding_and_head():
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=2, d_ff=48,
                          rope_theta=10_000.0)
    keys = list(model.state_dict())
    weight = model.layers[0].attn.q_proj.weight
    assert convert_to_float8(model) == 2 * 7  # q, k, v, output, w1, w2, w3 per block
    assert type(model.layers[0].attn.q_proj) is Float8Linear and model.layers[0].attn.q_proj.weight is weight
    assert type(model.lm_head) is not Float8Linear
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 64, (2, 16))
    logits = model(ids)
    logits.float().mean().backward()
    assert weight.grad is not None and torch.isfinite(logits).all()
    assert isinstance(model.layers[0].ffn.w2, Linear)


def _cuda_runs(recipe):
    """(y, x, w, dy) of float8_linear's `recipe` on CUDA, eagerly then compiled, x.grad and w.grad set."""
    torch.manual_seed(0)
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    w = torch.randn(384, 512, device="cuda", requires_grad=True)
    dy = torch.randn(256, 384, device="cuda")
    linear = lambda a, b: float8_linear(a, b, recipe)  # noqa: E731
    for fn in (linear, torch.compile(linear)):
        x.grad = w.grad = None
        y = fn(x, w)
        y.backward(dy)
        yield y, x, w, dy


@pytest.mark.gpu
def test_cuda_scaled_mm_matches_the_emulation_and_compiles():
    for y, x, w, dy in _cuda_runs("tensorwise"):
        torch.testing.assert_close(y.double(), _dq(x.detach(), E4M3) @ _dq(w.detach(), E4M3).t(), rtol=1e-4,
                                   atol=1e-3)
        torch.testing.assert_close(x.grad.double(), _dq(dy, E5M2) @ _dq(w.detach(), E4M3), rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(w.grad.double(), _dq(dy, E5M2).t() @ _dq(x.detach(), E4M3), rtol=1e-4, atol=1e-3)


def test_rowwise_scales_each_row_to_the_format_max():
    t = torch.randn(16, 32) * torch.logspace(-3, 3, 16)[:, None]  # rows six decades apart
    q, s = _quantize(t, E4M3, rows=True)
    assert s.shape == (16, 1) and q.dtype == E4M3
    assert torch.all(q.float().abs().amax(dim=1) == torch.finfo(E4M3).max)
    rel = ((q.float() * s - t).norm(dim=1) / t.norm(dim=1)).max()
    assert rel < 2**-4  # every row keeps FP8's relative precision, the small ones too


def test_rowwise_forward_dx_quantised_and_weight_gradient_exact():
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    dy = torch.randn(4, 8, 48)
    y = float8_linear(x, w, "rowwise")
    y.backward(dy)
    x2, g = x.detach().reshape(-1, 32), dy.reshape(-1, 48)
    y_ref = _dq(x2, E4M3, True) @ _dq(w.detach(), E4M3, True).t()
    torch.testing.assert_close(y.detach().reshape(-1, 48).double(), y_ref, rtol=1e-5, atol=1e-5)
    dx_ref = _dq(g, E5M2, True) @ _dq(w.detach().t(), E4M3, True).t()  # W scaled per input feature
    torch.testing.assert_close(x.grad.reshape(-1, 32).double(), dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), g.double().t() @ x2.double(), rtol=1e-5, atol=1e-5)


def test_rowwise_under_autocast_keeps_float32_gradients_and_a_bf16_weight_gradient():
    torch.manual_seed(0)
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = float8_linear(x, w, "rowwise")
    assert y.dtype == torch.bfloat16
    dy = torch.randn(16, 16)
    y.float().backward(dy)
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    bf16 = (dy.bfloat16().t() @ x.detach().bfloat16()).float()
    torch.testing.assert_close(w.grad, bf16)


def test_convert_takes_a_recipe_and_refuses_an_unknown_one():
    model = TransformerLM(vocab_size=64, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=48,
                          rope_theta=10_000.0)
    convert_to_float8(model, recipe="rowwise")
    assert model.layers[0].attn.q_proj.fp8_recipe == "rowwise"
    with pytest.raises(ValueError, match="recipe"):
        convert_to_float8(model, recipe="blockwise")


@pytest.mark.gpu
def test_cuda_rowwise_matches_the_emulation_and_compiles():
    # float32 in and out: CUDA's row-wise product is bf16, then cast
    for y, x, w, dy in _cuda_runs("rowwise"):
        y_ref = _dq(x.detach(), E4M3, True) @ _dq(w.detach(), E4M3, True).t()
        dx_ref = _dq(dy, E5M2, True) @ _dq(w.detach().t(), E4M3, True).t()
        for got, want in ((y, y_ref), (x.grad, dx_ref)):
            torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        torch.testing.assert_close(w.grad, dy.t() @ x.detach(), rtol=1e-4, atol=1e-3)
