"""FP8 training matmuls: e4m3 weights and activations forward, e5m2 gradients backward.

`Float8Linear` is a `Linear` (same `weight`, same state-dict key) whose three matmuls run on
8-bit floats through `torch._scaled_mm` (Hopper's FP8 tensor cores on CUDA; a reference
implementation on the CPU):

    forward   y  = x  Wᵀ      x, W in e4m3 (3 mantissa bits, max 448)
    backward  dx = dy W       dy in e5m2 (2 mantissa bits, max 57344: a gradient's range), W e4m3
              dW = dyᵀ x      dy e5m2, x e4m3

Scaling is per tensor and dynamic: each operand is divided by amax / fp8_max just before the
cast, so its largest entry lands on the format's largest value, and `_scaled_mm` multiplies the
product back (its `scale_a`, `scale_b`), accumulating in float32 and writing the output in the
input's dtype (bf16 under autocast). The forward saves the 8-bit x and W for the backward, which
halves what a bf16 layer keeps.

`convert_to_float8(model)` turns the Linears of the Transformer blocks into Float8Linears (the
embedding and the LM head stay in bf16, as FP8 recipes do: their error reaches every logit).
A matmul whose sizes `_scaled_mm` cannot take (each a multiple of 16 on CUDA) runs as a plain
matmul. `trainer.fp8 = true` applies it to a run (docs/training_recipes.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from scratchlm.model.functional import compute_dtype
from scratchlm.model.layers import Linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _quantize(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """t in `dtype` scaled so its largest magnitude maps to the format's maximum; and the float32
    scale that multiplies it back (t ≈ q.float() * scale)."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float().clamp(min=1e-12)
    scale = amax / fmax
    q = (t.float() / scale).clamp(-fmax, fmax).to(dtype)
    return q, scale


def _mm(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(a·sa) @ (b·sb) with a (M, K) and b (K, N) in FP8, accumulated in float32; `_scaled_mm`
    wants a row-major and b column-major."""
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def fp8_shapes_ok(*dims: int) -> bool:
    """Whether `_scaled_mm` takes matmuls of these sizes (multiples of 16, which CUDA requires)."""
    return all(d % 16 == 0 for d in dims)


class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
        xq, sx = _quantize(x, E4M3)
        wq, sw = _quantize(weight, E4M3)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.dtypes = (x.dtype, weight.dtype)
        return _mm(xq, sx, wq.t(), sw, out_dtype)  # (M, N)

    @staticmethod
    def backward(ctx, dy: Tensor):
        xq, sx, wq, sw = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        gq, sg = _quantize(dy, E5M2)
        dx = _mm(gq, sg, wq, sw, x_dtype) if ctx.needs_input_grad[0] else None  # (M, K)
        dw = _mm(gq.t(), sg, xq, sx, w_dtype) if ctx.needs_input_grad[1] else None  # (N, K)
        return dx, dw, None


def float8_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x Wᵀ with FP8 operands (see the module docstring); x (..., K), weight (N, K). The output
    takes the autocast dtype under autocast, else x's."""
    *lead, K = x.shape
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if not fp8_shapes_ok(x2.shape[0], K, N):
        return x @ weight.t()
    dev = x.device.type
    out_dtype = compute_dtype(x)
    with torch.autocast(dev, enabled=False):
        y = _Float8Matmul.apply(x2, weight, out_dtype)
    return y.reshape(*lead, N)


class Float8Linear(Linear):
    """A `Linear` whose matmuls run in FP8 (`float8_linear`); same parameter, same checkpoint."""

    def forward(self, x: Tensor) -> Tensor:
        return float8_linear(x, self.weight)


def convert_to_float8(model: nn.Module) -> int:
    """Turn every plain `Linear` inside `model.layers` into a `Float8Linear` (in place, the same
    weight tensors); the embedding and LM head stay as they are. Returns how many were turned."""
    n = 0
    for block in getattr(model, "layers", []):
        for module in block.modules():
            if type(module) is Linear:
                module.__class__ = Float8Linear
                n += 1
    return n
