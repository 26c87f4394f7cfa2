"""FlashAttention-2 tiling written in plain PyTorch.

This is the readable reference for the Triton kernel in ``flash_attention_triton.py``: the
same algorithm, the same saved state, expressed with tensor slices instead of program ids.

Forward (per tile of queries): stream over key/value tiles keeping a running row maximum
``m``, a running softmax denominator ``l`` and an unnormalised output accumulator; rescale
both by ``exp(m_old - m_new)`` whenever the maximum grows. The only thing saved for the
backward besides the inputs and the output is the row log-sum-exp ``L = m + log(l)`` (one
float32 value per query row), from which the backward recomputes ``P = exp(S - L)`` tile by
tile instead of storing the (T x T) attention matrix.

Backward: ``D = rowsum(dO * O)`` once, then for each key tile accumulate ``dV += Pᵀ dO``,
``dK += dSᵀ Q`` and scatter ``dQ += dS K`` where ``dS = P * (dO Vᵀ - D)``.

Causal masking is top-left aligned (query i may attend keys j <= i), as in
``F.scaled_dot_product_attention(..., is_causal=True)``; key tiles entirely above the
diagonal are skipped.
"""

from __future__ import annotations

import math

import torch

__all__ = ["FlashAttentionTorch", "naive_attention", "flash_attention_forward_torch",
           "flash_attention_backward_torch"]

DEFAULT_Q_TILE = 64
DEFAULT_K_TILE = 64


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    is_causal: bool = False) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d)) v with the full score matrix; (..., T, d) inputs."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2)) * scale
    if is_causal:
        tq, tk = q.shape[-2], k.shape[-2]
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() < 3:
        raise ValueError(f"attention inputs must be (batch, seq, d) or (batch, heads, seq, d), got {tuple(q.shape)}")
    if k.shape != v.shape or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"incompatible q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    # float32 for half types and float32, float64 stays float64 (exact checks in tests).
    return torch.promote_types(x.dtype, torch.float32)


def _causal_tile_mask(i0: int, i1: int, j0: int, j1: int, device: torch.device) -> torch.Tensor:
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(j0, j1, device=device)[None, :]
    return cols <= rows  # True = may attend


@torch.no_grad()
def flash_attention_forward_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  is_causal: bool = False, *, q_tile: int = DEFAULT_Q_TILE,
                                  k_tile: int = DEFAULT_K_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward. Returns (O like q, L of shape q.shape[:-1] in float32, float64 for float64)."""
    _check_inputs(q, k, v)
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    acc_dtype = _accumulation_dtype(q)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    kf, vf = k.to(acc_dtype), v.to(acc_dtype)
    for i0 in range(0, tq, q_tile):
        i1 = min(i0 + q_tile, tq)
        qi = q[..., i0:i1, :].to(acc_dtype)
        m = torch.full(qi.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)  # (..., Bq)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qi)  # (..., Bq, d)
        # Keys past the last query row of this tile are all masked under causality.
        k_end = min(tk, i1) if is_causal else tk
        for j0 in range(0, k_end, k_tile):
            j1 = min(j0 + k_tile, k_end)
            s = (qi @ kf[..., j0:j1, :].transpose(-1, -2)) * scale  # (..., Bq, Bk)
            if is_causal and j1 - 1 > i0:  # only tiles that straddle the diagonal need a mask
                s = s.masked_fill(~_causal_tile_mask(i0, i1, j0, j1, q.device), float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)  # exp(-inf) = 0 on the first tile
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ vf[..., j0:j1, :]
            m = m_new
        out[..., i0:i1, :] = (acc / l[..., None]).to(q.dtype)
        lse[..., i0:i1] = m + torch.log(l)
    return out, lse


@torch.no_grad()
def flash_attention_backward_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                                   is_causal: bool = False, *, q_tile: int = DEFAULT_Q_TILE,
                                   k_tile: int = DEFAULT_K_TILE
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled backward recomputing P from (q, k, lse). Returns (dq, dk, dv) in the input dtypes."""
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    acc_dtype = _accumulation_dtype(q)
    qf, kf, vf, dof = (t.to(acc_dtype) for t in (q, k, v, grad_out))
    delta = (dof * out.to(acc_dtype)).sum(dim=-1)  # D = rowsum(dO * O), (..., Tq)
    dq = torch.zeros_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    for j0 in range(0, tk, k_tile):
        j1 = min(j0 + k_tile, tk)
        kj, vj = kf[..., j0:j1, :], vf[..., j0:j1, :]
        dkj = torch.zeros_like(kj)
        dvj = torch.zeros_like(vj)
        # Under causality only queries i >= j0 see this key tile.
        i_start = (j0 // q_tile) * q_tile if is_causal else 0
        for i0 in range(i_start, tq, q_tile):
            i1 = min(i0 + q_tile, tq)
            qi, doi = qf[..., i0:i1, :], dof[..., i0:i1, :]
            s = (qi @ kj.transpose(-1, -2)) * scale
            p = torch.exp(s - lse[..., i0:i1, None])
            if is_causal and j1 - 1 > i0:
                p = p.masked_fill(~_causal_tile_mask(i0, i1, j0, j1, q.device), 0.0)
            dvj += p.transpose(-1, -2) @ doi
            dp = doi @ vj.transpose(-1, -2)
            ds = p * (dp - delta[..., i0:i1, None])
            dq[..., i0:i1, :] += (ds @ kj) * scale
            dkj += (ds.transpose(-1, -2) @ qi) * scale
        dk[..., j0:j1, :] = dkj
        dv[..., j0:j1, :] = dvj
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionTorch(torch.autograd.Function):
    """FlashAttention-2 as an autograd.Function in plain PyTorch.

    ``FlashAttentionTorch.apply(q, k, v, is_causal=False)`` on (batch, seq, d) or
    (batch, heads, seq, d) tensors; saves q, k, v, O and one log-sum-exp tensor (float32) of
    shape q.shape[:-1]. Optional trailing arguments ``q_tile, k_tile`` set the tile sizes.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                q_tile: int = DEFAULT_Q_TILE, k_tile: int = DEFAULT_K_TILE) -> torch.Tensor:
        out, lse = flash_attention_forward_torch(q, k, v, is_causal, q_tile=q_tile, k_tile=k_tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        ctx.tiles = (q_tile, k_tile)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        q_tile, k_tile = ctx.tiles
        dq, dk, dv = flash_attention_backward_torch(q, k, v, out, lse, grad_out, ctx.is_causal,
                                                    q_tile=q_tile, k_tile=k_tile)
        return dq, dk, dv, None, None, None
