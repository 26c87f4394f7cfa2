"""SwiGLU's gate, silu(a) · b, over the concatenated projections a | b, with a Triton backward.

``swiglu(gate_up)`` takes (..., 2F) = w1 x | w3 x, the one output of the fused projection
(``scratchlm.model.layers.project_together(..., concatenated=True)``), and returns (..., F). Its
forward is plain torch (torch.compile fuses it with whatever surrounds it). Its backward is one
kernel that reads a, b and the output gradient once and writes the gradients of a and b side by
side, as the one (..., 2F) gradient the projections' single backward matmul wants: built from
torch ops, that gradient is a concatenation, which Inductor computes by loading every input
once per half.

The backward is the op ``scratchlm::swiglu_backward`` (a ``torch.library.triton_op`` where
torch has it, so torch.compile launches the kernel from its own code); on tensors Triton cannot
run it computes the same formula with torch ops.
"""

from __future__ import annotations

import torch

from scratchlm.kernels.triton_support import can_use_triton as _can_use_triton
from scratchlm.kernels.triton_support import device_of as _device
from scratchlm.kernels.triton_support import register_op as _register
from scratchlm.kernels.triton_support import tl, triton, wrap_triton
from scratchlm.model.functional import silu

__all__ = ["swiglu"]

if triton is not None:

    @triton.jit
    def _swiglu_backward_kernel(GU, G, DGU, n_elements, F, BLOCK: tl.constexpr):
        # One element (row, j) of the output gradient per lane: a = GU[row, j], b = GU[row, F + j].
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n_elements
        row = idx // F
        col = idx - row * F
        a_off = row * (2 * F) + col
        a = tl.load(GU + a_off, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(GU + a_off + F, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + idx, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        # d silu(a)/da = sig · (1 + a · (1 - sig))
        da = g * b * sig * (1.0 + a * (1.0 - sig))
        db = g * a * sig
        tl.store(DGU + a_off, da.to(DGU.dtype.element_ty), mask=mask)
        tl.store(DGU + a_off + F, db.to(DGU.dtype.element_ty), mask=mask)


def _swiglu_backward_impl(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d(gate_up) (..., 2F) of silu(a) · b for the output gradient `grad` (..., F)."""
    if _can_use_triton(gate_up):
        gate_up, grad = gate_up.contiguous(), grad.contiguous()
        dgu = torch.empty_like(gate_up)
        n, F = grad.numel(), grad.shape[-1]
        block = 1024
        with _device(gate_up):
            wrap_triton(_swiglu_backward_kernel)[(triton.cdiv(n, block),)](gate_up, grad, dgu, n, F, BLOCK=block)
        return dgu
    a, b = gate_up.float().chunk(2, dim=-1)
    g = grad.float()
    sig = torch.sigmoid(a)
    return torch.cat([g * b * sig * (1 + a * (1 - sig)), g * a * sig], dim=-1).to(gate_up.dtype)


def _swiglu_backward_fake(gate_up, grad):
    return torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)


swiglu_backward_op = _register("scratchlm::swiglu_backward", _swiglu_backward_impl, _swiglu_backward_fake)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        a, b = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return silu(a) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        return swiglu_backward_op(gate_up, grad)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(a) · b for gate_up = a | b along the last dimension: (..., 2F) -> (..., F)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dimension (a | b), got {tuple(gate_up.shape)}")
    return _SwiGLU.apply(gate_up)
