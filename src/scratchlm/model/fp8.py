"""FP8 training matmuls: e4m3 weights and activations forward, e5m2 gradients backward.

`Float8Linear` is a `Linear` (same `weight`, same state-dict key) whose three matmuls run on
8-bit floats through `torch._scaled_mm` (Hopper's FP8 tensor cores on CUDA; a reference
implementation on the CPU):

    forward   y  = x  Wᵀ      x, W in e4m3 (3 mantissa bits, max 448)
    backward  dx = dy W       dy in e5m2 (2 mantissa bits, max 57344: a gradient's range), W e4m3
              dW = dyᵀ x      dy e5m2, x e4m3

Two recipes (`trainer.fp8_recipe`):

- "tensorwise" (the default): scaling is per tensor and dynamic: each operand is divided by
  amax / fp8_max just before the cast, so its largest entry lands on the format's largest value,
  and `_scaled_mm` multiplies the product back (its `scale_a`, `scale_b`), accumulating in float32
  and writing the output in the input's dtype (bf16 under autocast). The forward saves the 8-bit
  x and W for the backward, which halves what a bf16 layer keeps. The weight gradient needs x and
  dy with the token dimension contiguous: two transposed copies a layer.
- "rowwise": one scale per row of each operand, along the dimension the matmul sums over (x and
  dy per token, W per output feature forward and per input feature for dx). A row's amax and its
  cast are one pass over the row, which torch.compile fuses into a single kernel, with no
  tensor-wide reduction before the cast. The weight gradient dW = dyᵀ x runs in the compute dtype
  (bf16) from a bf16 copy of x: it would need both operands scaled along the tokens, so no
  transposed FP8 copies are made at all (torchao's "rowwise with high-precision weight gradient").

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
RECIPES = ("tensorwise", "rowwise")


def _quantize(t: Tensor, dtype: torch.dtype, rows: bool = False) -> tuple[Tensor, Tensor]:
    """t in `dtype` scaled so its largest magnitude maps to the format's maximum, or with `rows`
    each row's of a (M, K) t; and the float32 scale that multiplies it back (t ≈ q.float() *
    scale): a scalar, or (M, 1) with `rows`."""
    fmax = torch.finfo(dtype).max
    magnitude = t.detach().abs()
    amax = (magnitude.amax(dim=1, keepdim=True) if rows else magnitude.amax()).float().clamp(min=1e-12)
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


def _rowwise_mm(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, out_dtype: torch.dtype) -> Tensor:
    """`_mm` with row scales sa (M, 1) and column scales sb (1, N); CUDA's row-wise `_scaled_mm`
    writes bf16 only, so the product comes in bf16 there and is then cast to `out_dtype`."""
    direct = out_dtype if a.device.type != "cuda" else torch.bfloat16
    return _mm(a, sa, b, sb, direct).to(out_dtype)


class _Float8RowwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
        xq, sx = _quantize(x, E4M3, rows=True)  # (M, K), one scale per token
        wq, sw = _quantize(weight, E4M3, rows=True)  # (N, K), one scale per output feature
        ctx.save_for_backward(x.to(out_dtype), weight)  # dW's operand, in the compute dtype
        ctx.dtypes = (x.dtype, out_dtype)
        return _rowwise_mm(xq, sx, wq.t(), sw.t(), out_dtype)  # (M, N)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x_low, weight = ctx.saved_tensors
        x_dtype, out_dtype = ctx.dtypes
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq, sg = _quantize(dy, E5M2, rows=True)  # (M, N), one scale per token
            wtq, swt = _quantize(weight.t(), E4M3, rows=True)  # (K, N), one scale per input feature
            dx = _rowwise_mm(gq, sg, wtq.t(), swt.t(), x_dtype)  # (M, K)
        if ctx.needs_input_grad[1]:
            dw = (dy.to(out_dtype).t() @ x_low).to(weight.dtype)  # (N, K) in the compute dtype
        return dx, dw, None


def float8_linear(x: Tensor, weight: Tensor, recipe: str = "tensorwise") -> Tensor:
    """x Wᵀ with FP8 operands (see the module docstring for the recipes); x (..., K), weight
    (N, K). The output takes the autocast dtype under autocast, else x's."""
    *lead, K = x.shape
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if not fp8_shapes_ok(x2.shape[0], K, N):
        return x @ weight.t()
    dev = x.device.type
    out_dtype = compute_dtype(x)
    matmul = _Float8RowwiseMatmul if recipe == "rowwise" else _Float8Matmul
    with torch.autocast(dev, enabled=False):
        y = matmul.apply(x2, weight, out_dtype)
    return y.reshape(*lead, N)


class Float8Linear(Linear):
    """A `Linear` whose matmuls run in FP8 (`float8_linear`, recipe ``fp8_recipe``); same
    parameter, same checkpoint."""

    fp8_recipe = "tensorwise"

    def forward(self, x: Tensor) -> Tensor:
        return float8_linear(x, self.weight, self.fp8_recipe)


def convert_to_float8(model: nn.Module, recipe: str = "tensorwise") -> int:
    """Turn every plain `Linear` inside `model.layers` into a `Float8Linear` with `recipe` (in
    place, the same weight tensors); the embedding and LM head stay as they are. Returns how many
    were turned."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    n = 0
    for block in getattr(model, "layers", []):
        for module in block.modules():
            if type(module) is Linear:
                module.__class__ = Float8Linear
                module.fp8_recipe = recipe
                n += 1
    return n
