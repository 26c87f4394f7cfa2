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
diagonal are skipped. A sliding ``window`` (causal only) further limits query i to the last
``window`` keys, itself included (i - window < j <= i); key tiles entirely before the window
are skipped too, and only tiles that straddle the diagonal or the window's edge are masked.

Grouped-query attention: k and v may have fewer heads than q, q (..., H, T, d) and k, v
(..., Hkv, T, d) with H a multiple of Hkv, q head h reading kv head h // (H // Hkv). The tiles
are computed on q viewed as (..., Hkv, G, T, d) against k, v viewed as (..., Hkv, 1, T, d), so
k and v are never repeated; dK and dV of a kv head sum over its group of G query heads.
"""

from __future__ import annotations

import math

import torch

__all__ = ["FlashAttentionTorch", "check_window", "naive_attention", "flash_attention_forward_torch",
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


def check_window(is_causal: bool, window: int | None) -> None:
    """Raise ValueError unless `window` is None, or a positive int with `is_causal`."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive number of keys or None, got {window!r}")
    if not is_causal:
        raise ValueError("a sliding window needs causal attention (is_causal=True)")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() < 3:
        raise ValueError(f"attention inputs must be (batch, seq, d) or (batch, heads, seq, d), got {tuple(q.shape)}")
    heads_ok = (k.shape[:-2] == q.shape[:-2] if q.dim() == 3 else
                k.shape[:-3] == q.shape[:-3] and k.shape[-3] > 0 and q.shape[-3] % k.shape[-3] == 0)
    if k.shape != v.shape or k.dim() != q.dim() or not heads_ok or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"incompatible q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}: "
                         "k and v need q's batch and head dims, with a number of heads that divides q's")


def _grouped(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, int]:
    # q (..., H, T, d) viewed as (..., Hkv, G, T, d), to meet k and v viewed as (..., Hkv, 1, T, d).
    if q.dim() == 3:
        return q.unsqueeze(-3), 1
    group = q.shape[-3] // k.shape[-3]
    return q.unflatten(-3, (k.shape[-3], group)), group


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    # float32 for half types and float32, float64 stays float64 (exact checks in tests).
    return torch.promote_types(x.dtype, torch.float32)


def _causal_tile_mask(i0: int, i1: int, j0: int, j1: int, device: torch.device,
                      window: int | None = None) -> torch.Tensor:
    rows = torch.arange(i0, i1, device=device)[:, None]
    cols = torch.arange(j0, j1, device=device)[None, :]
    allowed = cols <= rows  # True = may attend
    if window is not None:
        allowed &= cols > rows - window
    return allowed


def _tile_needs_mask(i0: int, i1: int, j0: int, j1: int, window: int | None) -> bool:
    # Under causality: the tile straddles the diagonal, or its first key is outside the window
    # of its last query.
    return j1 - 1 > i0 or (window is not None and (i1 - 1) - j0 >= window)


@torch.no_grad()
def flash_attention_forward_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  is_causal: bool = False, *, window: int | None = None,
                                  q_tile: int = DEFAULT_Q_TILE,
                                  k_tile: int = DEFAULT_K_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled forward. Returns (O like q, L of shape q.shape[:-1] in float32, float64 for float64).

    q (..., H, Tq, d); k, v (..., Hkv, Tk, d) with H a multiple of Hkv (or all (B, T, d)).
    """
    _check_inputs(q, k, v)
    check_window(is_causal, window)
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    qg, _ = _grouped(q, k)  # (..., Hkv, G, Tq, d)
    out = torch.empty_like(qg)
    acc_dtype = _accumulation_dtype(q)
    lse = torch.empty(qg.shape[:-1], dtype=acc_dtype, device=q.device)
    kf, vf = k.to(acc_dtype).unsqueeze(-3), v.to(acc_dtype).unsqueeze(-3)  # (..., Hkv, 1, Tk, d)
    for i0 in range(0, tq, q_tile):
        i1 = min(i0 + q_tile, tq)
        qi = qg[..., i0:i1, :].to(acc_dtype)
        m = torch.full(qi.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)  # (..., Bq)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qi)  # (..., Bq, d)
        # Keys past the last query row of this tile are all masked under causality, and with a
        # window so are the keys before the window of its first row.
        k_end = min(tk, i1) if is_causal else tk
        k_start = max(0, i0 - window + 1) // k_tile * k_tile if window is not None else 0
        for j0 in range(k_start, k_end, k_tile):
            j1 = min(j0 + k_tile, k_end)
            s = (qi @ kf[..., j0:j1, :].transpose(-1, -2)) * scale  # (..., Bq, Bk)
            if is_causal and _tile_needs_mask(i0, i1, j0, j1, window):
                s = s.masked_fill(~_causal_tile_mask(i0, i1, j0, j1, q.device, window), float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row may see no key of a tile before the window's edge: its maximum is still -inf,
            # and exp(-inf - (-inf)) would be NaN; measured from 0 instead, its p and alpha are 0.
            m_ref = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = torch.exp(s - m_ref[..., None])
            alpha = torch.exp(m - m_ref)  # exp(-inf) = 0 on the first tile
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ vf[..., j0:j1, :]
            m = m_new
        out[..., i0:i1, :] = (acc / l[..., None]).to(q.dtype)
        lse[..., i0:i1] = m + torch.log(l)
    return out.view(q.shape), lse.view(q.shape[:-1])


@torch.no_grad()
def flash_attention_backward_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                                   is_causal: bool = False, *, window: int | None = None,
                                   q_tile: int = DEFAULT_Q_TILE, k_tile: int = DEFAULT_K_TILE
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiled backward recomputing P from (q, k, lse). Returns (dq, dk, dv) in the input dtypes;
    dk and dv of a kv head sum over the query heads of its group."""
    check_window(is_causal, window)
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    acc_dtype = _accumulation_dtype(q)
    qf, dof, of = (_grouped(t.to(acc_dtype), k)[0] for t in (q, grad_out, out))  # (..., Hkv, G, Tq, d)
    lse = _grouped(lse.unsqueeze(-1), k)[0].squeeze(-1)  # (..., Hkv, G, Tq)
    kf, vf = (t.to(acc_dtype).unsqueeze(-3) for t in (k, v))  # (..., Hkv, 1, Tk, d)
    delta = (dof * of).sum(dim=-1)  # D = rowsum(dO * O), (..., Tq)
    dq = torch.zeros_like(qf)
    dk = torch.zeros_like(kf).squeeze(-3)
    dv = torch.zeros_like(vf).squeeze(-3)
    for j0 in range(0, tk, k_tile):
        j1 = min(j0 + k_tile, tk)
        kj, vj = kf[..., j0:j1, :], vf[..., j0:j1, :]
        dkj = torch.zeros_like(kj)
        dvj = torch.zeros_like(vj)
        # Under causality only queries i >= j0 see this key tile; with a window, only those up
        # to its last key's window, i < j1 - 1 + window.
        i_start = (j0 // q_tile) * q_tile if is_causal else 0
        i_end = min(tq, j1 - 1 + window) if window is not None else tq
        for i0 in range(i_start, i_end, q_tile):
            i1 = min(i0 + q_tile, tq)
            qi, doi = qf[..., i0:i1, :], dof[..., i0:i1, :]
            s = (qi @ kj.transpose(-1, -2)) * scale
            p = torch.exp(s - lse[..., i0:i1, None])
            if is_causal and _tile_needs_mask(i0, i1, j0, j1, window):
                p = p.masked_fill(~_causal_tile_mask(i0, i1, j0, j1, q.device, window), 0.0)
            dp = doi @ vj.transpose(-1, -2)
            ds = p * (dp - delta[..., i0:i1, None])
            dq[..., i0:i1, :] += (ds @ kj) * scale
            # summed over the group's query heads (a sum over one head when k has q's heads)
            dvj += (p.transpose(-1, -2) @ doi).sum(dim=-3, keepdim=True)
            dkj += (ds.transpose(-1, -2) @ qi).sum(dim=-3, keepdim=True) * scale
        dk[..., j0:j1, :] = dkj.squeeze(-3)
        dv[..., j0:j1, :] = dvj.squeeze(-3)
    return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionTorch(torch.autograd.Function):
    """FlashAttention-2 as an autograd.Function in plain PyTorch.

    ``FlashAttentionTorch.apply(q, k, v, is_causal=False)`` on (batch, seq, d) or
    (batch, heads, seq, d) tensors, k and v possibly with fewer heads than q (grouped-query
    attention: a number of heads that divides q's); saves q, k, v, O and one log-sum-exp tensor
    (float32) of shape q.shape[:-1]. Optional trailing arguments ``q_tile, k_tile`` set the tile
    sizes, and ``window`` (causal only) limits each query to the last `window` keys.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                q_tile: int = DEFAULT_Q_TILE, k_tile: int = DEFAULT_K_TILE,
                window: int | None = None) -> torch.Tensor:
        out, lse = flash_attention_forward_torch(q, k, v, is_causal, window=window, q_tile=q_tile, k_tile=k_tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        ctx.window = window
        ctx.tiles = (q_tile, k_tile)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        q_tile, k_tile = ctx.tiles
        dq, dk, dv = flash_attention_backward_torch(q, k, v, out, lse, grad_out, ctx.is_causal, window=ctx.window,
                                                    q_tile=q_tile, k_tile=k_tile)
        return dq, dk, dv, None, None, None, None
