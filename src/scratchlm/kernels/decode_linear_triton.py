"""A projection of a few decode rows as one kernel, with the RMSNorm before it and the residual add
or SwiGLU gate after it folded in.

At batch 1 a decode step of a GPT-2-small-sized model is bound by how many kernels it runs, not
by the bytes it reads: each of its matmuls reads 1-6 MB of weights (~0.5-2 us at full bandwidth)
yet takes ~4 us, and the RMSNorm before it, the residual add after it and the SwiGLU gate each
cost a launch of their own (docs/benchmarks/generate.md). Here one program computes BLOCK_N
outputs for all the M (<= MAX_ROWS) rows: it reads its BLOCK_N weight rows once, in tiles of
BLOCK_K along K (`blocks_for`), and multiplies them with the rows of x in float32.

``decode_linear(x, w, norm_weight=None, residual=None, eps=1e-5, gate_up=False)``: x (M, K), w
(N, K), both with unit stride along K.

- ``norm_weight`` (K,): x is first RMS-normalised as `scratchlm.model.layers.RMSNorm` does
  (statistics in float32, the result in x's dtype); each program computes the M norms itself
  (K values a row, read from cache).
- The product is rounded to w's dtype, as a matmul in w's dtype (autocast) returns it.
- ``gate_up``: w stacks a SwiGLU's w1 and w3 ((2F, K), as `scratchlm.infer.stacked` keeps them),
  and the result is silu(x w1ᵀ) · (x w3ᵀ), (M, F) in w's dtype.
- ``residual`` (M, N): the result is residual + product, in residual's dtype.

It is the op ``scratchlm::decode_linear`` (a ``triton_op`` where torch has it, so torch.compile
launches the kernel from its own code and CUDA graphs capture it); on tensors Triton cannot run it
computes the same with torch (`decode_linear_reference`).
"""

from __future__ import annotations

import torch

from scratchlm.kernels.triton_support import can_use_triton as _can_use_triton
from scratchlm.kernels.triton_support import device_of as _device
from scratchlm.kernels.triton_support import register_op as _register
from scratchlm.kernels.triton_support import tl, triton, wrap_triton

__all__ = ["MAX_ROWS", "decode_linear", "decode_linear_reference"]

MAX_ROWS = 8  # rows a program multiplies at once: the kernel is for decode steps of small batches

if triton is not None:

    @triton.jit
    def _decode_linear_kernel(X, W, G, R, O, M, N, K, stride_xm, stride_wn, stride_rm, stride_om,
                              EPS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
                              GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        rows = tl.arange(0, BLOCK_M)
        rows_ok = rows < M
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's outputs (of N, or of F)
        n_ok = n < N
        x_rows = X + rows[:, None].to(tl.int64) * stride_xm
        if HAS_NORM:
            squares = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_rows + k[None, :], mask=rows_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
                squares += tl.sum(x * x, axis=1)
            inv_rms = 1.0 / tl.sqrt(squares / K + EPS)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        w_rows = W + n[:, None].to(tl.int64) * stride_wn
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            if HAS_NORM:
                g = tl.load(G + k, mask=k_ok, other=0.0).to(tl.float32)
                x = (x * inv_rms[:, None] * g[None, :]).to(X.dtype.element_ty)
            x = x.to(W.dtype.element_ty).to(tl.float32)  # the matmul's operand, in w's dtype
            tile_ok = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + k[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
            if GATE_UP:  # the up projection's rows sit N (= F) rows further down
                u = tl.load(w_rows + N * stride_wn + k[None, :], mask=tile_ok, other=0.0).to(tl.float32)
                acc_up += tl.sum(x[:, None, :] * u[None, :, :], axis=2)
        out = acc.to(W.dtype.element_ty).to(tl.float32)
        if GATE_UP:
            up = acc_up.to(W.dtype.element_ty).to(tl.float32)
            out = (out * tl.sigmoid(out) * up).to(W.dtype.element_ty).to(tl.float32)
        out_ok = rows_ok[:, None] & n_ok[None, :]
        if HAS_RES:
            r = tl.load(R + rows[:, None].to(tl.int64) * stride_rm + n[None, :], mask=out_ok, other=0.0)
            out = r.to(tl.float32) + out
        tl.store(O + rows[:, None].to(tl.int64) * stride_om + n[None, :], out.to(O.dtype.element_ty), mask=out_ok)


def decode_linear_reference(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None = None,
                            residual: torch.Tensor | None = None, eps: float = 1e-5,
                            gate_up: bool = False) -> torch.Tensor:
    """What the op computes, with torch: the model's RMSNorm, a matmul in w's dtype, then the gate
    or the residual add."""
    if norm_weight is not None:
        x32 = x.float()
        x = (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight.float()).to(x.dtype)
    y = x.to(w.dtype) @ w.t()
    if gate_up:
        gate, up = y.float().chunk(2, dim=-1)
        y = (gate * torch.sigmoid(gate) * up).to(w.dtype)
    if residual is not None:
        y = (residual.float() + y.float()).to(residual.dtype)
    return y


def _out_shape(x: torch.Tensor, w: torch.Tensor, gate_up: bool) -> tuple[int, int]:
    return x.shape[0], w.shape[0] // 2 if gate_up else w.shape[0]


def _check(x, w, norm_weight, residual, gate_up) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or (gate_up and w.shape[0] % 2):
        raise ValueError(f"decode_linear: x (M, K) and w (N, K) (N even with gate_up); got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    if norm_weight is not None and norm_weight.shape != (x.shape[1],):
        raise ValueError(f"decode_linear: norm_weight must be ({x.shape[1]},), got {tuple(norm_weight.shape)}")
    if residual is not None and tuple(residual.shape) != _out_shape(x, w, gate_up):
        raise ValueError(f"decode_linear: residual must be {_out_shape(x, w, gate_up)}, got {tuple(residual.shape)}")


# At most this many product terms (BLOCK_M x BLOCK_N x BLOCK_K) a program holds at once
TILE_TERMS = 16384


def blocks_for(rows: int, outputs: int, inputs: int, gate_up: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for `rows` rows, `outputs` outputs and `inputs`
    inputs a row. A decode projection is short of bytes in flight, not of arithmetic: with a whole
    row of K in one tile every program issues all its loads at once, and many small programs
    (2 or 4 outputs, 2 warps) spread GPT-2-small's 1-6 MB over every SM. Chosen from a sweep of
    BLOCK_N x BLOCK_K x num_warps on an H100 (docs/benchmarks/decode_linear.md)."""
    block_m = triton.next_power_of_2(max(rows, 1))
    block_n = 2 if rows == 1 and (gate_up or outputs >= 2048) else 4
    block_k = max(32, min(triton.next_power_of_2(inputs), 2048, TILE_TERMS // (block_m * block_n)))
    num_warps = 4 if block_k >= 2048 else 2
    return block_m, block_n, block_k, num_warps


def _decode_linear_impl(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None,
                        residual: torch.Tensor | None, eps: float, gate_up: bool) -> torch.Tensor:
    _check(x, w, norm_weight, residual, gate_up)
    M, N = _out_shape(x, w, gate_up)
    runs = (_can_use_triton(w) and M <= MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1
            and (residual is None or residual.stride(1) == 1))
    if not runs:
        return decode_linear_reference(x, w, norm_weight, residual, eps, gate_up)
    out = torch.empty((M, N), dtype=w.dtype if residual is None else residual.dtype, device=w.device)
    block_m, block_n, block_k, num_warps = blocks_for(M, N, x.shape[1], gate_up)
    g = x if norm_weight is None else norm_weight  # a pointer the kernel does not read without HAS_NORM
    r = out if residual is None else residual
    with _device(w):
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731 (a function of the launch metadata)
        wrap_triton(_decode_linear_kernel)[grid](
            x, w, g, r, out, M, N, x.shape[1], x.stride(0), w.stride(0), r.stride(0), out.stride(0),
            EPS=float(eps), HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, GATE_UP=gate_up,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out


def _decode_linear_fake(x, w, norm_weight, residual, eps, gate_up):
    return torch.empty(_out_shape(x, w, gate_up), dtype=w.dtype if residual is None else residual.dtype,
                       device=w.device)


_decode_linear_op = _register("scratchlm::decode_linear", _decode_linear_impl, _decode_linear_fake)


def decode_linear(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, eps: float = 1e-5, gate_up: bool = False) -> torch.Tensor:
    """(RMSNorm of) x (M, K) times wᵀ, then the SwiGLU gate (`gate_up`) and/or plus `residual`:
    see the module docstring. Rows past MAX_ROWS, or tensors Triton cannot run, take torch's path."""
    return _decode_linear_op(x, w, norm_weight, residual, float(eps), bool(gate_up))
