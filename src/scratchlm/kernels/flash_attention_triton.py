"""FlashAttention-2 forward and backward in Triton.

The algorithm is the one written out in plain PyTorch in ``flash_attention_torch.py`` (the
reference the tests compare against); this file is the fast version:

- forward: one program per (query tile, batch*head); streams over key/value tiles with an
  online softmax in base 2 (``exp2`` with log2(e) folded into the score scale), saves the
  output and one float32 log-sum-exp per query row (natural log, same as the reference).
  Under causality, key tiles entirely above the diagonal are never visited, tiles strictly
  below it run without any mask, and only the diagonal tiles pay for ``tl.where``.
  Causal programs are launched longest-first so the tail of the grid is short work.
- backward, FA2 style and without atomics: a dQ kernel owns one query tile and streams over
  key tiles; it first computes its rows' ``D = rowsum(dO * O)`` (no separate pass over dO and
  O) and stores it for the dK/dV kernel, launched after it, which owns one key tile and streams
  over query tiles. Each output tile is written exactly once. ``set_backward_dq("atomic")`` switches
  to the five-matmul form instead: the dK/dV kernel also adds each query tile's dS·K into a
  float32 dQ with atomic adds, and no dQ kernel runs (see ``_BACKWARD_DQ``).
- grouped-query attention: k and v may have Hkv heads for q's H (H a multiple of Hkv, q head h
  reading kv head h // (H // Hkv)). The forward and dQ kernels index the kv head (k and v are
  never repeated); the dK/dV kernel runs one program per (key tile, batch * kv head) and
  streams over the query tiles of each of the G = H / Hkv query heads of its group (``GROUPED``;
  one flat loop over (head, tile) pairs per stage, which ptxas keeps from spilling where a loop
  over heads around the loop over tiles did not), summing into one dK/dV tile: no (B, H, T, d)
  temporary, no atomics, a fixed order. With G = 1 the kernel is the plain one.
- sliding window (``window``, causal only; ``WINDOWED``): query i sees keys i - window < j <= i.
  Key tiles wholly before a query tile's window are never visited, tiles inside every row's
  window run unmasked, and only the tiles on the window's edge (and the diagonal) are masked;
  the dK/dV kernel bounds its query tiles the same way.
- ``flash_attention_qkv``: attention over the concatenated q|k|v projections (B, T, (H + 2·Hkv)·d),
  q and k rotated by RoPE in one pass (``rope_triton``; with Hkv < H by ``apply_rope``). Its
  backward op, ``scratchlm::flash_attention_backward_qkv``, writes one gradient of qkv's shape:
  the dK/dV and dQ kernels rotate dk and dq back in registers (``ROPE``) and store them into
  their blocks of it (``PACKED``, offsets), so the projections behind it run their backward as
  one matmul each way.
- ragged sequence lengths (any T) are handled by bounds masks that are compiled in only
  when T is not a multiple of the tile sizes (``EVEN_*`` flags, computed by the launcher);
  head dims that are not powers of two are padded to the next power of two with masked loads.
- tile sizes are autotuned (configs chosen for H100/H200) for bf16/fp16 inputs whose length
  is a multiple of 128 and >= 1024, and fixed per (dtype, head dim) otherwise (so short test
  shapes do not pay for tuning). float32 inputs use IEEE float32 dot products, not TF32.

Composition with ``torch.compile``: the launchers are the bodies of two ops,
``scratchlm::flash_attention_forward`` / ``_backward``, with an autograd formula. Where torch
has it (>= 2.6, and not under Triton's interpreter) they are registered with
``torch.library.triton_op`` and launch every kernel through ``wrap_triton``, so that
torch.compile traces into them and Inductor launches the kernels itself (one graph, one CUDA
graph under ``mode="reduce-overhead"``); ``triton_support.set_op_registration("custom_op")``,
called before this module is imported, registers them as opaque ``torch.library.custom_op``s
with fake kernels instead. On
tensors that Triton cannot run (CPU, or no triton installed) the same
ops fall back to the tiled PyTorch reference, so the op, its autograd and its compile path
can be exercised anywhere.

Triton is imported under a guard (``triton_support``): importing this module without triton works
(the model imports this module only when the "flash_triton" backend is chosen).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Optional

import torch

from scratchlm.kernels.flash_attention_torch import (
    check_window,
    flash_attention_backward_torch,
    flash_attention_forward_torch,
)
from scratchlm.kernels.rope_triton import rope_qk_op
from scratchlm.kernels.triton_support import can_use_triton as _can_use_triton
from scratchlm.kernels.triton_support import device_of as _device
from scratchlm.kernels.triton_support import interpreting as _interpreting
from scratchlm.kernels.triton_support import register_op as _register
from scratchlm.kernels.triton_support import tl, triton, triton_available, wrap_triton
from scratchlm.model.rope import apply_rope

__all__ = ["FlashAttentionTriton", "backward_dq", "flash_attention", "flash_attention_qkv", "set_backward_dq",
           "triton_available", "using_backward_dq"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# Autotuning compiles and times every config once per (length, head dim, causal, dtype);
# below this length fixed tiles are used instead.
_AUTOTUNE_MIN_SEQ = 1024
# ... and only for lengths that are a multiple of the largest tile, so no tuned config needs masks.
_TUNE_MULTIPLE = 128


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() not in (3, 4):
        raise ValueError(f"attention inputs must be (batch, seq, d) or (batch, heads, seq, d), got {tuple(q.shape)}")
    if q.dim() == 3 and (q.shape != k.shape or q.shape != v.shape):
        raise ValueError(f"q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dim() == 4 and (k.shape != v.shape or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]
                         or k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        raise ValueError(f"k and v must be (batch, kv_heads, seq, d) with kv_heads dividing q's heads, for q "
                         f"{tuple(q.shape)}, got {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] > 256:
        raise ValueError(f"head dimension {q.shape[-1]} > 256 is not supported")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one of float16/bfloat16/float32, got {q.dtype}, {k.dtype}, {v.dtype}")


def _alloc_like(t: torch.Tensor) -> torch.Tensor:
    # Keep the caller's memory layout (e.g. (B, T, H, d) transposed to (B, H, T, d)) when the
    # last dim is unit-stride, so the model's transpose back is a view; the fake kernel uses
    # the same rule, so eager and compiled outputs agree on strides.
    if t.stride(-1) == 1:
        return torch.empty_like(t)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _alloc_out(q: torch.Tensor) -> torch.Tensor:
    # The output of (B, H, T, d) inputs, and the gradients of q, k and v, are laid out
    # (B, T, H, d) in memory, as PyTorch's SDPA kernels lay out their output, whatever the
    # inputs' layout: the model's transpose back to (B, T, H·d) is then a view, not a copy per
    # layer, and the RoPE backward and the projections' matmuls read the gradients in place.
    # The fake kernels use the same rule.
    if q.dim() == 4:
        B, H, T, D = q.shape
        return torch.empty((B, T, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    return _alloc_like(q)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.unsqueeze(1) if t.dim() == 3 else t


def _forward_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    is_causal: bool, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = _alloc_out(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    q4, k4, v4, o4 = (_as_4d(t) for t in (q, k, v, out))
    lse3 = lse.unsqueeze(1) if q.dim() == 3 else lse
    _launch_forward(q4, k4, v4, o4, lse3, is_causal, autotune=_should_autotune(q), window=window)
    return out, lse


def _backward_triton(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                     window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _alloc_out(q), _alloc_out(k), _alloc_out(v)
    tensors = [_as_4d(t) for t in (grad_out, q, k, v, out, dq, dk, dv)]
    lse3 = lse.unsqueeze(1) if q.dim() == 3 else lse
    _launch_backward(*tensors, lse3.contiguous(), is_causal, autotune=_should_autotune(q), window=window)
    return dq, dk, dv


def _packed_grads(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    # One (B, T, (H + 2·Hkv)·d) buffer, the gradient of the concatenated q|k|v projections, and its
    # three blocks as (B, H, T, d), (B, Hkv, T, d), (B, Hkv, T, d) views, into which the kernels
    # write dq, dk and dv directly.
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    dqkv = torch.empty((B, T, (H + 2 * Hkv) * D), dtype=q.dtype, device=q.device)
    blocks = dqkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    return dqkv, tuple(b.unflatten(-1, (-1, D)).transpose(1, 2) for b in blocks)


def _backward_qkv_triton(grad_out, q, k, v, out, lse, cos, sin, is_causal: bool,
                         window: int | None = None) -> torch.Tensor:
    dqkv, (dq, dk, dv) = _packed_grads(q, k)
    tensors = [_as_4d(t) for t in (grad_out, q, k, v, out)]
    rope = None if cos is None else (cos, sin)
    _launch_backward(*tensors, dq, dk, dv, lse.contiguous(), is_causal, autotune=_should_autotune(q), rope=rope,
                     packed=dqkv, window=window)
    return dqkv


def _should_autotune(q: torch.Tensor) -> bool:
    T = q.shape[-2]
    return (q.is_cuda and not _interpreting() and T >= _AUTOTUNE_MIN_SEQ and T % _TUNE_MULTIPLE == 0
            and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 128)


# --- Triton kernels ---------------------------------------------------------------------------
# Shapes inside kernels: one (batch, head) slice at a time; q/k/v/o rows are tokens with
# unit stride along the head dim; L and D are contiguous (B*H, T) float32. H counts query heads,
# `group` of them per kv head; `window` is read only under WINDOWED.

if triton is not None:

    @triton.jit
    def _window_key_bounds(start_m, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # For the query tile at start_m·BLOCK_M under a sliding window: key tiles [lo, mid) hold the
        # window's edge of some row (masked); [mid, start_m·BLOCK_M) lie inside every row's window
        # (unmasked); keys before lo are outside every row's window (never visited). Row i sees
        # keys j > i - window, so its first row sets lo and its last row sets mid.
        first = start_m * BLOCK_M
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
        mid = (tl.maximum(first + BLOCK_M - window, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        return lo, tl.minimum(mid, first)

    @triton.jit
    def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi, N_CTX, qk_scale, window,
                   offs_m, offs_n, offs_d, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL_MASK: tl.constexpr, WINDOW_MASK: tl.constexpr, EVEN_N: tl.constexpr,
                   EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            cols = start_n + offs_n
            kt_ptrs = k_base + cols[None, :] * stride_kt + offs_d[:, None]  # (D, BN)
            v_ptrs = v_base + cols[:, None] * stride_vt + offs_d[None, :]  # (BN, D)
            if EVEN_N and EVEN_D:
                kt = tl.load(kt_ptrs)
                v = tl.load(v_ptrs)
            else:
                kt = tl.load(kt_ptrs, mask=(cols[None, :] < N_CTX) & (offs_d[:, None] < HEAD_DIM), other=0.0)
                v = tl.load(v_ptrs, mask=(cols[:, None] < N_CTX) & (offs_d[None, :] < HEAD_DIM), other=0.0)
            qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
            if CAUSAL_MASK:
                qk = tl.where(offs_m[:, None] >= cols[None, :], qk, float("-inf"))
            if WINDOW_MASK:
                qk = tl.where(offs_m[:, None] - cols[None, :] < window, qk, float("-inf"))
            if not EVEN_N:
                qk = tl.where(cols[None, :] < N_CTX, qk, float("-inf"))
            # In log2 units. The scale (> 0) goes on the row maxima, and into one multiply-add
            # per score with the subtraction: one instruction less per score than scaling first.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            if WINDOW_MASK:
                # At the window's edge a row may have seen no key yet (this tile's and all before
                # are outside its window): its maximum is still -inf, and measured from it p and
                # alpha would be NaN; measured from 0 they are 0.
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_ref = m_new
            p = tl.math.exp2(qk * qk_scale - m_ref[:, None])
            alpha = tl.math.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE, sm_scale,
                    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                    H, N_CTX, group, window,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, EVEN_D: tl.constexpr,
                    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # H query heads, `group` of them per kv head (grouped-query attention; 1: one kv head each).
        if IS_CAUSAL:  # longest rows first: the grid's tail is short work
            start_m = tl.num_programs(0) - 1 - tl.program_id(0)
        else:
            start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = (off_bh // H).to(tl.int64)
        off_h = (off_bh % H).to(tl.int64)
        off_hk = off_h // group  # the kv head this query head reads
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        k_base = K + off_b * stride_kb + off_hk * stride_kh
        v_base = V + off_b * stride_vb + off_hk * stride_vh
        o_base = O + off_b * stride_ob + off_h * stride_oh

        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_d[None, :]
        row_mask = (offs_m[:, None] < N_CTX) & (offs_d[None, :] < HEAD_DIM)
        if EVEN_M and EVEN_D:
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=row_mask, other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # fp32 whatever the launcher passed (Inductor passes a Python float as fp64, which would
        # turn the whole softmax and the accumulator fp64).
        sm_scale = tl.full([], sm_scale, tl.float32)
        qk_scale = sm_scale * 1.4426950408889634

        if IS_CAUSAL:
            # Strictly below the diagonal every key < start_m*BLOCK_M < N_CTX: no bounds mask;
            # with a window, key tiles before it are skipped and those on its edge masked.
            # The diagonal stage runs to the tile end and bounds-masks unless T fills both tiles.
            if WINDOWED:
                lo, mid = _window_key_bounds(start_m, window, BLOCK_M, BLOCK_N)
                acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                           lo, mid, N_CTX, qk_scale, window, offs_m, offs_n, offs_d,
                                           HEAD_DIM, BLOCK_N, False, True, True, EVEN_D, DOT_PRECISION)
                acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                           mid, start_m * BLOCK_M, N_CTX, qk_scale, window, offs_m, offs_n, offs_d,
                                           HEAD_DIM, BLOCK_N, False, False, True, EVEN_D, DOT_PRECISION)
            else:
                acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                           0, start_m * BLOCK_M, N_CTX, qk_scale, window, offs_m, offs_n, offs_d,
                                           HEAD_DIM, BLOCK_N, False, False, True, EVEN_D, DOT_PRECISION)
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                       start_m * BLOCK_M, (start_m + 1) * BLOCK_M,
                                       N_CTX, qk_scale, window, offs_m, offs_n, offs_d,
                                       HEAD_DIM, BLOCK_N, True, WINDOWED, EVEN_M and EVEN_N, EVEN_D, DOT_PRECISION)
        else:
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                       0, N_CTX, N_CTX, qk_scale, window, offs_m, offs_n, offs_d,
                                       HEAD_DIM, BLOCK_N, False, False, EVEN_N, EVEN_D, DOT_PRECISION)

        acc = acc / l_i[:, None]
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # back to natural log
        o_ptrs = o_base + offs_m[:, None] * stride_ot + offs_d[None, :]
        lse_ptrs = LSE + off_bh.to(tl.int64) * N_CTX + offs_m
        if EVEN_M and EVEN_D:
            tl.store(o_ptrs, acc.to(O.dtype.element_ty))
        else:
            tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_mask)
        if EVEN_M:
            tl.store(lse_ptrs, lse)
        else:
            tl.store(lse_ptrs, lse, mask=offs_m < N_CTX)

    @triton.jit
    def _rope_transpose(g, COS, SIN, off_b, stride_cb, stride_ct, rows, N_CTX, HEAD_DIM: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        # The gradient of an interleaved-pair rotation by angle a at each row's position: pair
        # (g[2i], g[2i+1]) turned by -a, i.e. (c·g0 + s·g1, c·g1 - s·g0) with c, s = cos a, sin a.
        offs_i = tl.arange(0, BLOCK_D // 2)
        cs = off_b * stride_cb + rows[:, None] * stride_ct + offs_i[None, :]
        mask = (rows[:, None] < N_CTX) & (offs_i[None, :] < HEAD_DIM // 2)
        c = tl.load(COS + cs, mask=mask, other=0.0)
        s = tl.load(SIN + cs, mask=mask, other=0.0)
        g_even, g_odd = tl.split(tl.reshape(g, (BLOCK_ROWS, BLOCK_D // 2, 2)))
        return tl.reshape(tl.join(c * g_even + s * g_odd, c * g_odd - s * g_even), (BLOCK_ROWS, BLOCK_D))

    @triton.jit
    def _bwd_dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, stride_qt, stride_dot,
                       stride_dqat, start_m, N_CTX, qk_scale, window, offs_n, offs_d, HEAD_DIM: tl.constexpr,
                       BLOCK_M: tl.constexpr, CAUSAL_MASK: tl.constexpr, WINDOW_MASK: tl.constexpr,
                       EVEN_M: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       ATOMIC_DQ: tl.constexpr):
        # (dk, dv) of the key tile plus the share of the query tile at start_m of one head. With
        # ATOMIC_DQ the tile's share of dQ (dS·K times the softmax scale) is added into the float32
        # rows at dqa_base too: the fifth matmul, in place of the dQ kernel's recomputation of P and dP.
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + tl.arange(0, BLOCK_M)
        qt_ptrs = q_base + rows[None, :] * stride_qt + offs_d[:, None]  # (D, BM)
        do_ptrs = do_base + rows[:, None] * stride_dot + offs_d[None, :]  # (BM, D)
        if EVEN_M and EVEN_D:
            qt = tl.load(qt_ptrs)
            do = tl.load(do_ptrs)
        else:
            qt = tl.load(qt_ptrs, mask=(rows[None, :] < N_CTX) & (offs_d[:, None] < HEAD_DIM), other=0.0)
            do = tl.load(do_ptrs, mask=(rows[:, None] < N_CTX) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        if EVEN_M:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        else:
            lse = tl.load(lse_base + rows, mask=rows < N_CTX, other=0.0)
            delta = tl.load(delta_base + rows, mask=rows < N_CTX, other=0.0)
        qkt = tl.dot(k, qt, input_precision=DOT_PRECISION)  # (BN, BM)
        pt = tl.math.exp2(qkt * qk_scale - lse[None, :] * 1.4426950408889634)
        if CAUSAL_MASK:
            pt = tl.where(rows[None, :] >= offs_n[:, None], pt, 0.0)
        if WINDOW_MASK:
            pt = tl.where(rows[None, :] - offs_n[:, None] < window, pt, 0.0)
        if not EVEN_M:
            pt = tl.where(rows[None, :] < N_CTX, pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BN, BM)
        dst = (pt * (dpt - delta[None, :])).to(qt.dtype)
        dk = tl.dot(dst, tl.trans(qt), dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(dst), k, input_precision=DOT_PRECISION) * (qk_scale * 0.6931471805599453)
            dqa_ptrs = dqa_base + rows[:, None] * stride_dqat + offs_d[None, :]
            if EVEN_M and EVEN_D:
                tl.atomic_add(dqa_ptrs, dq, sem="relaxed")
            else:
                tl.atomic_add(dqa_ptrs, dq, mask=(rows[:, None] < N_CTX) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
        return dk, dv

    @triton.jit
    def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, stride_qh, stride_doh,
                        stride_qt, stride_dot, stride_dqah, stride_dqat, group, lo, hi, N_CTX, qk_scale, window,
                        offs_n, offs_d, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                        WINDOW_MASK: tl.constexpr, GROUPED: tl.constexpr, EVEN_M: tl.constexpr,
                        EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr):
        # The query tiles [lo, hi) of the head at the bases, or with GROUPED of each of the `group`
        # heads from it on, one after the other, as one flat loop over (head, tile): a loop over
        # heads around the loop over tiles made ptxas spill at most tile sizes.
        if GROUPED:
            n_tiles = tl.cdiv(hi - lo, BLOCK_M)
            for it in range(0, group * n_tiles):
                g = it // n_tiles
                dk, dv = _bwd_dkdv_tile(dk, dv, k, v, q_base + g * stride_qh, do_base + g * stride_doh,
                                        lse_base + g * N_CTX, delta_base + g * N_CTX, dqa_base + g * stride_dqah,
                                        stride_qt, stride_dot, stride_dqat, lo + (it - g * n_tiles) * BLOCK_M, N_CTX,
                                        qk_scale, window, offs_n, offs_d, HEAD_DIM, BLOCK_M, CAUSAL_MASK,
                                        WINDOW_MASK, EVEN_M, EVEN_D, DOT_PRECISION, ATOMIC_DQ)
        else:
            for start_m in range(lo, hi, BLOCK_M):
                dk, dv = _bwd_dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, stride_qt,
                                        stride_dot, stride_dqat, start_m, N_CTX, qk_scale, window, offs_n, offs_d,
                                        HEAD_DIM, BLOCK_M, CAUSAL_MASK, WINDOW_MASK, EVEN_M, EVEN_D, DOT_PRECISION,
                                        ATOMIC_DQ)
        return dk, dv

    @triton.jit
    def _bwd_dkdv_head(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, stride_qh, stride_doh,
                       stride_qt, stride_dot, stride_dqah, stride_dqat, group, start_n, N_CTX, qk_scale, window,
                       offs_n, offs_d, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       IS_CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, GROUPED: tl.constexpr, EVEN_M: tl.constexpr,
                       EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       ATOMIC_DQ: tl.constexpr):
        # dK/dV of the key tile at start_n, summed into (dk, dv) over the query tiles of the head
        # at the bases (with GROUPED, of the `group` heads from it on) that see it.
        if IS_CAUSAL:
            # query tiles on the diagonal need the causal mask; the ones below it do not
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, stride_qh,
                                     stride_doh, stride_qt, stride_dot, stride_dqah, stride_dqat, group, start_n,
                                     start_n + BLOCK_N, N_CTX, qk_scale, window, offs_n, offs_d, HEAD_DIM, BLOCK_M,
                                     True, WINDOWED, GROUPED, EVEN_M and EVEN_N, EVEN_D, DOT_PRECISION, ATOMIC_DQ)
            if WINDOWED:
                # Only queries i < start_n + BLOCK_N - 1 + window see this key tile: the query
                # tiles [start_n + BLOCK_N, q_mid) see all of it, [q_mid, q_end) its window's edge.
                q_end = tl.minimum(start_n + BLOCK_N - 1 + window, N_CTX)
                q_mid = tl.minimum(tl.maximum((start_n + window) // BLOCK_M * BLOCK_M, start_n + BLOCK_N), N_CTX)
                dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, stride_qh,
                                         stride_doh, stride_qt, stride_dot, stride_dqah, stride_dqat, group,
                                         start_n + BLOCK_N, q_mid, N_CTX, qk_scale, window, offs_n, offs_d, HEAD_DIM,
                                         BLOCK_M, False, False, GROUPED, EVEN_M, EVEN_D, DOT_PRECISION, ATOMIC_DQ)
                dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, stride_qh,
                                         stride_doh, stride_qt, stride_dot, stride_dqah, stride_dqat, group, q_mid,
                                         q_end, N_CTX, qk_scale, window, offs_n, offs_d, HEAD_DIM, BLOCK_M, False,
                                         True, GROUPED, EVEN_M, EVEN_D, DOT_PRECISION, ATOMIC_DQ)
            else:
                dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, stride_qh,
                                         stride_doh, stride_qt, stride_dot, stride_dqah, stride_dqat, group,
                                         start_n + BLOCK_N, N_CTX, N_CTX, qk_scale, window, offs_n, offs_d, HEAD_DIM,
                                         BLOCK_M, False, False, GROUPED, EVEN_M, EVEN_D, DOT_PRECISION, ATOMIC_DQ)
        else:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, stride_qh,
                                     stride_doh, stride_qt, stride_dot, stride_dqah, stride_dqat, group, 0, N_CTX,
                                     N_CTX, qk_scale, window, offs_n, offs_d, HEAD_DIM, BLOCK_M, False, False, GROUPED,
                                     EVEN_M, EVEN_D, DOT_PRECISION, ATOMIC_DQ)
        return dk, dv

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, sm_scale,
                         stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                         stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                         stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
                         H, N_CTX, group, window, COS, SIN, stride_cb, stride_ct, dk_offset, dv_offset,
                         DQA, stride_dqab, stride_dqah, stride_dqat,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                         GROUPED: tl.constexpr, EVEN_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr, PACKED: tl.constexpr,
                         ATOMIC_DQ: tl.constexpr):
        # One program per (key tile, batch * kv head). PACKED: dk and dv are blocks of one buffer,
        # DK; DV is then not used (see _launch_backward). GROUPED (grouped-query attention,
        # `group` > 1 query heads per kv head): the program streams over the query tiles of each
        # of its group's heads, summing into one dK/dV tile: no per-query-head copy of dK/dV, and
        # a fixed order of summation. ATOMIC_DQ: the program also adds each query tile's share of
        # dQ (dS·K) into the float32 (B, H, T, D) buffer DQA, so no dQ kernel runs (see
        # _launch_backward); the order of those additions, and so dQ's last bits, vary by run.
        # Under causality the early key tiles see the most queries; they are launched first.
        start_n = tl.program_id(0) * BLOCK_N
        off_bhk = tl.program_id(1)
        num_kv_heads = H // group
        off_b = (off_bhk // num_kv_heads).to(tl.int64)
        off_hk = (off_bhk % num_kv_heads).to(tl.int64)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        kv_mask = (offs_n[:, None] < N_CTX) & (offs_d[None, :] < HEAD_DIM)
        k_ptrs = K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
        if EVEN_N and EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        sm_scale = tl.full([], sm_scale, tl.float32)  # fp32 always: see _fwd_kernel
        qk_scale = sm_scale * 1.4426950408889634
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        # The first query head of this kv head's group; with GROUPED the next group - 1 follow it.
        off_h = off_hk * group
        dk, dv = _bwd_dkdv_head(dk, dv, k, v, Q + off_b * stride_qb + off_h * stride_qh,
                                DO + off_b * stride_dob + off_h * stride_doh,
                                LSE + (off_b * H + off_h) * N_CTX, DELTA + (off_b * H + off_h) * N_CTX,
                                DQA + off_b * stride_dqab + off_h * stride_dqah,
                                stride_qh, stride_doh, stride_qt, stride_dot, stride_dqah, stride_dqat, group, start_n,
                                N_CTX, qk_scale, window, offs_n, offs_d, HEAD_DIM, BLOCK_M, BLOCK_N, IS_CAUSAL,
                                WINDOWED, GROUPED, EVEN_M, EVEN_N, EVEN_D, DOT_PRECISION, ATOMIC_DQ)
        dk = dk * sm_scale
        if ROPE:  # k was rotated before attention: its gradient is rotated back here, in registers
            dk = _rope_transpose(dk, COS, SIN, off_b, stride_cb, stride_ct, offs_n, N_CTX, HEAD_DIM,
                                 BLOCK_N, BLOCK_D)
        dk_ptrs = DK + dk_offset + off_b * stride_dkb + off_hk * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :]
        if PACKED:
            dv_base = DK + dv_offset
        else:
            dv_base = DV + dv_offset
        dv_ptrs = dv_base + off_b * stride_dvb + off_hk * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :]
        if EVEN_N and EVEN_D:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty))
            tl.store(dv_ptrs, dv.to(DK.dtype.element_ty))
        else:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kv_mask)
            tl.store(dv_ptrs, dv.to(DK.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, lo, hi, N_CTX,
                      qk_scale, window, offs_m, offs_d, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL_MASK: tl.constexpr, WINDOW_MASK: tl.constexpr, EVEN_N: tl.constexpr,
                      EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
        offs_n0 = tl.arange(0, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            cols = start_n + offs_n0
            kt_ptrs = k_base + cols[None, :] * stride_kt + offs_d[:, None]  # (D, BN)
            vt_ptrs = v_base + cols[None, :] * stride_vt + offs_d[:, None]  # (D, BN)
            if EVEN_N and EVEN_D:
                kt = tl.load(kt_ptrs)
                vt = tl.load(vt_ptrs)
            else:
                kv_mask = (cols[None, :] < N_CTX) & (offs_d[:, None] < HEAD_DIM)
                kt = tl.load(kt_ptrs, mask=kv_mask, other=0.0)
                vt = tl.load(vt_ptrs, mask=kv_mask, other=0.0)
            qk = tl.dot(q, kt, input_precision=DOT_PRECISION)  # (BM, BN)
            p = tl.math.exp2(qk * qk_scale - lse[:, None])
            if CAUSAL_MASK:
                p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
            if WINDOW_MASK:
                p = tl.where(offs_m[:, None] - cols[None, :] < window, p, 0.0)
            if not EVEN_N:
                p = tl.where(cols[None, :] < N_CTX, p, 0.0)
            dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PRECISION)
        return dq

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, DO, O, DQ, LSE, DELTA, sm_scale,
                       stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                       stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot,
                       stride_ob, stride_oh, stride_ot, stride_dqb, stride_dqh, stride_dqt,
                       H, N_CTX, group, window, COS, SIN, stride_cb, stride_ct, dq_offset,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                       EVEN_D: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr):
        if IS_CAUSAL:
            start_m = tl.num_programs(0) - 1 - tl.program_id(0)
        else:
            start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = (off_bh // H).to(tl.int64)
        off_h = (off_bh % H).to(tl.int64)
        off_hk = off_h // group  # the kv head this query head reads
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_mask = (offs_m[:, None] < N_CTX) & (offs_d[None, :] < HEAD_DIM)
        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
        do_ptrs = DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :]
        o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
        if EVEN_M and EVEN_D:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            o = tl.load(o_ptrs)
        else:
            q = tl.load(q_ptrs, mask=row_mask, other=0.0)
            do = tl.load(do_ptrs, mask=row_mask, other=0.0)
            o = tl.load(o_ptrs, mask=row_mask, other=0.0)
        # D = rowsum(dO * O) of this tile's rows, for dq here and for the dK/dV kernel after it
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        row_ptrs = off_bh.to(tl.int64) * N_CTX + offs_m
        if EVEN_M:
            lse = tl.load(LSE + row_ptrs)
            tl.store(DELTA + row_ptrs, delta)
        else:
            lse = tl.load(LSE + row_ptrs, mask=offs_m < N_CTX, other=0.0)
            tl.store(DELTA + row_ptrs, delta, mask=offs_m < N_CTX)
        lse = lse * 1.4426950408889634
        k_base = K + off_b * stride_kb + off_hk * stride_kh
        v_base = V + off_b * stride_vb + off_hk * stride_vh
        sm_scale = tl.full([], sm_scale, tl.float32)  # fp32 always: see _fwd_kernel
        qk_scale = sm_scale * 1.4426950408889634
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if IS_CAUSAL:
            if WINDOWED:  # key tiles before the window skipped, those on its edge masked
                lo, mid = _window_key_bounds(start_m, window, BLOCK_M, BLOCK_N)
                dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt,
                                   lo, mid, N_CTX, qk_scale, window, offs_m, offs_d,
                                   HEAD_DIM, BLOCK_N, False, True, True, EVEN_D, DOT_PRECISION)
                dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt,
                                   mid, start_m * BLOCK_M, N_CTX, qk_scale, window, offs_m, offs_d,
                                   HEAD_DIM, BLOCK_N, False, False, True, EVEN_D, DOT_PRECISION)
            else:
                dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt,
                                   0, start_m * BLOCK_M, N_CTX, qk_scale, window, offs_m, offs_d,
                                   HEAD_DIM, BLOCK_N, False, False, True, EVEN_D, DOT_PRECISION)
            dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt,
                               start_m * BLOCK_M, (start_m + 1) * BLOCK_M, N_CTX,
                               qk_scale, window, offs_m, offs_d, HEAD_DIM, BLOCK_N, True, WINDOWED,
                               EVEN_M and EVEN_N, EVEN_D, DOT_PRECISION)
        else:
            dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt,
                               0, N_CTX, N_CTX, qk_scale, window, offs_m, offs_d,
                               HEAD_DIM, BLOCK_N, False, False, EVEN_N, EVEN_D, DOT_PRECISION)
        dq = dq * sm_scale
        if ROPE:
            dq = _rope_transpose(dq, COS, SIN, off_b, stride_cb, stride_ct, offs_m, N_CTX, HEAD_DIM,
                                 BLOCK_M, BLOCK_D)
        dq_ptrs = DQ + dq_offset + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :]
        if EVEN_M and EVEN_D:
            tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty))
        else:
            tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_mask)

    @triton.jit
    def _bwd_delta_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot,
                          H, N_CTX, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        # D = rowsum(dO * O) in float32 for the rows of one tile of one (batch, head): what the
        # dQ kernel computes first, for the five-matmul backward, which has no dQ kernel.
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        off_bh = tl.program_id(1)
        off_b = (off_bh // H).to(tl.int64)
        off_h = (off_bh % H).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_m[:, None] < N_CTX) & (offs_d[None, :] < HEAD_DIM)
        o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
                    mask=mask, other=0.0)
        do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                     mask=mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + off_bh.to(tl.int64) * N_CTX + offs_m, delta, mask=offs_m < N_CTX)

    # (BLOCK_M, BLOCK_N, num_warps, num_stages), chosen for Hopper (H100/H200). No tile is larger
    # than _TUNE_MULTIPLE, so on the lengths that are tuned (multiples of it) every config has
    # EVEN_M and EVEN_N, passed as plain arguments.
    _FWD_TILES = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 4)]
    _DKDV_TILES = [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4)]
    _DQ_TILES = [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)]
    _TUNE_KEY = ["N_CTX", "HEAD_DIM", "IS_CAUSAL", "WINDOWED"]

    def _tuner(kernel, tiles, divides: str, big_d: bool, key=tuple(_TUNE_KEY), reset_to_zero=None):
        # The split into masked/unmasked causal ranges needs one tile size to divide the other;
        # head dim 128 tiles of 128x128 with deep pipelines do not fit in shared memory. The
        # configs are pruned here, per head-dim class, rather than by a prune_configs_by hook,
        # and the EVEN_* flags are arguments rather than a triton.heuristics wrapper: what
        # torch.compile can trace in a wrapped kernel (configs and key only, torch 2.6) stays
        # all that is used.
        keep = [(m, n, w, s) for m, n, w, s in tiles
                if (m % n if divides == "n|m" else n % m) == 0 and not (big_d and m * n > 128 * 64 and s > 2)]
        configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                   for m, n, w, s in keep or tiles[:1]]
        return triton.autotune(configs, key=list(key), reset_to_zero=reset_to_zero)(kernel)

    _fwd_tuned = _tuner(_fwd_kernel, _FWD_TILES, "n|m", big_d=False)
    _fwd_tuned_big_d = _tuner(_fwd_kernel, _FWD_TILES, "n|m", big_d=True)
    _dkdv_tuned = _tuner(_bwd_dkdv_kernel, _DKDV_TILES, "m|n", big_d=False, key=_TUNE_KEY + ["GROUPED"])
    _dkdv_tuned_big_d = _tuner(_bwd_dkdv_kernel, _DKDV_TILES, "m|n", big_d=True, key=_TUNE_KEY + ["GROUPED"])
    # the five-matmul backward (ATOMIC_DQ): its float32 dQ buffer is zeroed before every trial
    _dkdv_atomic_tuned = _tuner(_bwd_dkdv_kernel, _DKDV_TILES, "m|n", big_d=False, key=_TUNE_KEY + ["GROUPED"],
                                reset_to_zero=["DQA"])
    _dkdv_atomic_tuned_big_d = _tuner(_bwd_dkdv_kernel, _DKDV_TILES, "m|n", big_d=True, key=_TUNE_KEY + ["GROUPED"],
                                      reset_to_zero=["DQA"])
    _dq_tuned = _tuner(_bwd_dq_kernel, _DQ_TILES, "n|m", big_d=False)
    _dq_tuned_big_d = _tuner(_bwd_dq_kernel, _DQ_TILES, "n|m", big_d=True)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _fixed_tiles(dtype: torch.dtype, block_d: int) -> dict[str, tuple[int, int, int, int]]:
    # Small fixed tiles: valid for every dtype and head dim up to 256 within shared memory.
    if dtype == torch.float32 or block_d > 128:
        return {"fwd": (64, 32, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}
    return {"fwd": (64, 64, 4, 3), "dkdv": (32, 64, 4, 3), "dq": (64, 32, 4, 3)}


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


_TUNERS = ("_fwd_tuned", "_fwd_tuned_big_d", "_dq_tuned", "_dq_tuned_big_d", "_dkdv_tuned", "_dkdv_tuned_big_d",
           "_dkdv_atomic_tuned", "_dkdv_atomic_tuned_big_d")  # the autotuned kernels (with Triton)


def config_tiles(config) -> tuple[int, int, int, int]:
    """A `triton.Config`'s (BLOCK_M, BLOCK_N, num_warps, num_stages): the form tiles take here."""
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def tuned_tiles() -> dict[str, tuple[int, int, int, int]]:
    """The tiles the autotuners chose in this process, "tuner N_CTX,HEAD_DIM,..." -> tiles (the
    integer and flag values of each key); empty without Triton or before a tuned launch."""
    chosen = {}
    for name in sorted(_TUNERS):
        for key, config in getattr(globals().get(name), "cache", {}).items():
            values = ",".join(str(x) for x in key if isinstance(x, (int, bool)))
            chosen[f"{name.strip('_')} {values}"] = config_tiles(config)
    return chosen


def _fixed_meta(tiles: tuple[int, int, int, int], T) -> dict:
    # EVEN_*: T fills every tile, so the bounds masks are compiled out (a guard under compile).
    m, n, w, s = tiles
    return {"BLOCK_M": m, "BLOCK_N": n, "EVEN_M": T % m == 0, "EVEN_N": T % n == 0,
            "num_warps": w, "num_stages": s}


# The launchers below run inside the ops' bodies. Each kernel is called as
# ``wrap_triton(kernel)[grid](...)`` with a grid that is a function of the launch metadata and
# every tl.constexpr passed by keyword: traced by torch.compile, that call becomes a
# triton_kernel_wrapper HOP that Inductor launches itself; run eagerly it is a plain launch.

# How the backward gets dQ: "recompute" (a dQ kernel streaming over key tiles recomputes P and dP:
# seven matmuls a tile pair, no atomics, a fixed order) or "atomic" (the dK/dV kernel also forms
# dS·K and adds it into a float32 buffer: five matmuls, dQ's rounding order varies by run).
# Set with `set_backward_dq`; read when a backward is launched (under torch.compile, when traced).
# "atomic" measured 0.80-1.03x "recompute" on an H100 (docs/benchmarks/attention.md), so it is opt-in.
_BACKWARD_DQ = "recompute"


def backward_dq() -> str:
    """The backward's dQ mode: "recompute" (the default) or "atomic" (see `_BACKWARD_DQ`)."""
    return _BACKWARD_DQ


def set_backward_dq(mode: str) -> str:
    """Set the backward's dQ mode to "recompute" or "atomic"; returns the mode it replaces.

    "atomic" is not bitwise reproducible: while torch.use_deterministic_algorithms(True) is on,
    backwards recompute dQ in either mode."""
    global _BACKWARD_DQ
    if mode not in ("recompute", "atomic"):
        raise ValueError(f"backward_dq mode must be 'recompute' or 'atomic', got {mode!r}")
    before, _BACKWARD_DQ = _BACKWARD_DQ, mode
    return before


@contextlib.contextmanager
def using_backward_dq(mode: str) -> Iterator[None]:
    """The backward's dQ mode set to `mode` inside the `with` block, the one before restored after."""
    before = set_backward_dq(mode)
    try:
        yield
    finally:
        set_backward_dq(before)


def _atomic_dq_selected() -> bool:
    # The atomic adds' order varies by run, so under torch.use_deterministic_algorithms(True)
    # (`trainer.deterministic`) the backward recomputes dQ whatever the mode.
    return _BACKWARD_DQ == "atomic" and not torch.are_deterministic_algorithms_enabled()


def _unrotate(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`_rope_transpose` in torch: g (B, H, T, D) rotated back (by minus the angles) by the
    (T, D/2) or (B, T, D/2) tables."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return apply_rope(g, cos, -sin)


def _launch_forward(q, k, v, o, lse, is_causal: bool, *, autotune: bool,
                    tiles: tuple[int, int, int, int] | None = None, window: int | None = None) -> None:
    # tiles: (BLOCK_M, BLOCK_N, num_warps, num_stages) to launch with instead of the tuned or
    # fixed ones (benchmarks/attention_tiles.py sweeps them).
    # q (B, H, T, D); k, v (B, Hkv, T, D), H a multiple of Hkv; window: causal sliding window.
    B, H, T, D = q.shape
    block_d = _block_d(D)
    common = dict(HEAD_DIM=D, BLOCK_D=block_d, IS_CAUSAL=is_causal, WINDOWED=window is not None, EVEN_D=D == block_d,
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    args = (q, k, v, o, lse, 1.0 / math.sqrt(D), *_strides(q), *_strides(k), *_strides(v), *_strides(o), H, T,
            H // k.shape[1], window or 0)
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)  # noqa: E731
    with _device(q):
        if autotune and tiles is None:
            kernel = _fwd_tuned_big_d if block_d > 64 else _fwd_tuned
            wrap_triton(kernel)[grid](*args, **common, EVEN_M=True, EVEN_N=True)
        else:
            meta = _fixed_meta(tiles or _fixed_tiles(q.dtype, block_d)["fwd"], T)
            wrap_triton(_fwd_kernel)[grid](*args, **common, **meta)


def _launch_backward(do, q, k, v, o, dq, dk, dv, lse, is_causal: bool, *, autotune: bool,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                     packed: torch.Tensor | None = None,
                     tiles: dict[str, tuple[int, int, int, int]] | None = None,
                     window: int | None = None, atomic_dq: bool | None = None) -> None:
    # atomic_dq: the five-matmul backward (None: the module's setting, `set_backward_dq`).
    # tiles: {"dq": ..., "dkdv": ...} (BLOCK_M, BLOCK_N, num_warps, num_stages) to launch with
    # instead of the tuned or fixed ones (benchmarks/attention_tiles.py sweeps them).
    # rope: the (cos, sin) tables, (T, D/2) or (B, T, D/2) float32, by which q and k were rotated;
    # dq and dk are then rotated back (the gradients of the unrotated q and k).
    # packed: the one buffer of which dq, dk and dv are views. The kernels then get that buffer
    # and each view's offset in it, not the views, and the dK/dV kernel gets it once (as DK;
    # PACKED): torch.compile's functional form of a launch copies each written argument on its
    # own, so two written arguments sharing storage would each get a private copy and one
    # block's gradients would be lost (and a view argument would be copied around the launch).
    # k, v, dk, dv may have fewer heads than q (grouped-query attention); window: as the forward's.
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    block_d = _block_d(D)
    sm_scale = 1.0 / math.sqrt(D)
    common = dict(HEAD_DIM=D, BLOCK_D=block_d, IS_CAUSAL=is_causal, WINDOWED=window is not None, EVEN_D=D == block_d,
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ROPE=rope is not None)
    heads = (H, T, H // Hkv, window or 0)
    dkdv_meta = dict(PACKED=packed is not None, GROUPED=H != Hkv)
    if rope is None:
        rope_args = (lse, lse, 0, 0)  # never read
    else:
        cos, sin = rope
        rope_args = (cos, sin, cos.stride(0) if cos.dim() == 3 else 0, cos.stride(-2))
    if tiles is not None:
        autotune = False
    tiles = {**_fixed_tiles(q.dtype, block_d), **(tiles or {})}
    if atomic_dq is None:
        atomic_dq = _atomic_dq_selected()
    # D = rowsum(dO·O), read by the dK/dV kernel: written by the dQ kernel, or with atomic_dq by
    # its own kernel (dQ is then summed into float32 by the dK/dV kernel)
    delta = torch.empty_like(lse)
    if atomic_dq:
        dqa = torch.zeros(B, H, T, D, device=q.device, dtype=torch.float32)
        with _device(q):
            wrap_triton(_bwd_delta_kernel)[(triton.cdiv(T, 64), B * H)](
                o, do, delta, *_strides(o), *_strides(do), H, T, HEAD_DIM=D, BLOCK_M=64, BLOCK_D=block_d)
    else:
        dqa = lse  # never read
    grads, offsets = (dq, dk, dv), (0, 0, 0)
    if packed is not None:  # DV is then a stand-in the kernel never touches
        grads = (packed, packed, q)
        offsets = tuple(t.storage_offset() - packed.storage_offset() for t in (dq, dk, dv))
    dkdv_args = (q, k, v, do, grads[1], grads[2], lse, delta, sm_scale, *_strides(q), *_strides(k), *_strides(v),
                 *_strides(do), *_strides(dk), *_strides(dv), *heads, *rope_args, offsets[1], offsets[2],
                 dqa, *(_strides(dqa) if atomic_dq else (0, 0, 0)))
    dkdv_grid = lambda meta: (triton.cdiv(T, meta["BLOCK_N"]), B * Hkv)  # noqa: E731
    if atomic_dq:
        with _device(q):
            if autotune:
                kernel = _dkdv_atomic_tuned_big_d if block_d > 64 else _dkdv_atomic_tuned
                wrap_triton(kernel)[dkdv_grid](*dkdv_args, **common, **dkdv_meta, EVEN_M=True, EVEN_N=True,
                                               ATOMIC_DQ=True)
            else:
                wrap_triton(_bwd_dkdv_kernel)[dkdv_grid](*dkdv_args, **common, **dkdv_meta,
                                                         **_fixed_meta(tiles["dkdv"], T), ATOMIC_DQ=True)
        dq.copy_(dqa if rope is None else _unrotate(dqa, *rope))
        return
    dq_args = (q, k, v, do, o, grads[0], lse, delta, sm_scale, *_strides(q), *_strides(k), *_strides(v),
               *_strides(do), *_strides(o), *_strides(dq), *heads, *rope_args, offsets[0])
    dq_grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)  # noqa: E731
    with _device(q):  # dQ first: it computes D = rowsum(dO * O), which the dK/dV kernel reads
        if autotune:
            dkdv_kernel = _dkdv_tuned_big_d if block_d > 64 else _dkdv_tuned
            dq_kernel = _dq_tuned_big_d if block_d > 64 else _dq_tuned
            wrap_triton(dq_kernel)[dq_grid](*dq_args, **common, EVEN_M=True, EVEN_N=True)
            wrap_triton(dkdv_kernel)[dkdv_grid](*dkdv_args, **common, **dkdv_meta, EVEN_M=True, EVEN_N=True,
                                                ATOMIC_DQ=False)
        else:
            wrap_triton(_bwd_dq_kernel)[dq_grid](*dq_args, **common, **_fixed_meta(tiles["dq"], T))
            wrap_triton(_bwd_dkdv_kernel)[dkdv_grid](*dkdv_args, **common, **dkdv_meta, **_fixed_meta(tiles["dkdv"], T),
                                                     ATOMIC_DQ=False)


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  is_causal: bool, window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) for (B, T, d) or (B, H, T, d) inputs (k, v (B, Hkv, T, d) with Hkv dividing H);
    L is float32 of shape q.shape[:-1]."""
    _check_inputs(q, k, v)
    check_window(is_causal, window)
    if _can_use_triton(q):
        return _forward_triton(q, k, v, is_causal, window)
    out, lse = flash_attention_forward_torch(q, k, v, is_causal, window=window)
    return _alloc_out(q).copy_(out), lse.float()


def _backward_impl(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                   window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) recomputing attention probabilities from (q, k, L)."""
    if _can_use_triton(q):
        return _backward_triton(grad_out, q, k, v, out, lse, is_causal, window)
    dq, dk, dv = flash_attention_backward_torch(q, k, v, out, lse, grad_out, is_causal, window=window)
    # ops may not return views of inputs; these are fresh, but keep the fake's layout.
    return tuple(_alloc_out(t).copy_(g) for t, g in ((q, dq), (k, dk), (v, dv)))


def _forward_fake(q, k, v, is_causal, window=None):
    _check_inputs(q, k, v)
    check_window(is_causal, window)
    return _alloc_out(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _backward_fake(grad_out, q, k, v, out, lse, is_causal, window=None):
    return _alloc_out(q), _alloc_out(k), _alloc_out(v)


flash_attention_forward_op = _register("scratchlm::flash_attention_forward", _forward_impl, _forward_fake)
flash_attention_backward_op = _register("scratchlm::flash_attention_backward", _backward_impl, _backward_fake)


def _backward_qkv_impl(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, cos: Optional[torch.Tensor],
                       sin: Optional[torch.Tensor], is_causal: bool, window: Optional[int] = None) -> torch.Tensor:
    """The gradient of the concatenated, unrotated q|k|v, (B, T, (H + 2·Hkv)·d), for q (B, H, T, d)
    and k, v (B, Hkv, T, d), of which q and k were rotated by (cos, sin) (each (T, d/2) or
    (B, T, d/2); None: no RoPE)."""
    if q.dim() != 4:
        raise ValueError(f"packed q/k/v gradients need (batch, heads, seq, d) inputs, got {tuple(q.shape)}")
    if _can_use_triton(q):
        return _backward_qkv_triton(grad_out, q, k, v, out, lse, cos, sin, is_causal, window)
    grads = list(flash_attention_backward_torch(q, k, v, out, lse, grad_out, is_causal, window=window))
    grads = [g.transpose(1, 2) for g in grads]  # (B, T, H or Hkv, d)
    if cos is not None:  # a rotation's transpose is the rotation by minus the angle
        grads[:2] = [apply_rope(g, cos.unsqueeze(-2), -sin.unsqueeze(-2)) for g in grads[:2]]
    dqkv, blocks = _packed_grads(q, k)
    for block, g in zip(blocks, grads):
        block.copy_(g.transpose(1, 2))
    return dqkv


def _backward_qkv_fake(grad_out, q, k, v, out, lse, cos, sin, is_causal, window=None):
    return _packed_grads(q, k)[0]


flash_attention_backward_qkv_op = _register("scratchlm::flash_attention_backward_qkv", _backward_qkv_impl,
                                            _backward_qkv_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal = is_causal
    ctx.window = window


def _op_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward_op(grad_out, q, k, v, out, lse, ctx.is_causal, ctx.window)
    return dq, dk, dv, None, None


flash_attention_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    is_causal: bool = False, *, window: int | None = None) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d)) v through the Triton kernels; (B, T, d) or (B, H, T, d).

    k and v may have fewer heads than q (grouped-query attention): q (B, H, T, d), k and v
    (B, Hkv, T, d) with H a multiple of Hkv, q head h reading kv head h // (H // Hkv); they are
    read in place, never repeated. `window` (causal only): each query sees at most the last
    `window` keys, itself included.
    """
    return flash_attention_forward_op(q, k, v, is_causal, window)[0]


class _FlashAttentionQKV(torch.autograd.Function):
    # Forward: rotate q and k (one pass over them, `rope_qk`, when k has q's heads), attend.
    # Backward: one op writes the gradient of the unrotated, concatenated q|k|v, so the
    # projections' backward is one matmul each way.

    @staticmethod
    def forward(ctx, qkv, cos, sin, num_heads: int, num_kv_heads: int, is_causal: bool, window: int | None):
        B, T, width = qkv.shape
        d = width // (num_heads + 2 * num_kv_heads)
        blocks = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
        q, k, v = (b.unflatten(-1, (-1, d)) for b in blocks)  # (B, T, H or Hkv, d) views
        if cos is not None and num_kv_heads == num_heads:
            q, k = rope_qk_op(qkv, cos, sin, num_heads).view(B, T, 2, num_heads, -1).unbind(2)
        elif cos is not None:  # rope_qk's one pass takes q|k|v of equal widths only
            q, k = (apply_rope(t, cos.unsqueeze(-2), sin.unsqueeze(-2)) for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H or Hkv, T, d) views
        out, lse = flash_attention_forward_op(q, k, v, is_causal, window)
        ctx.save_for_backward(q, k, v, out, lse, cos, sin)
        ctx.is_causal = is_causal
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cos, sin = ctx.saved_tensors
        dqkv = flash_attention_backward_qkv_op(grad_out, q, k, v, out, lse, cos, sin, ctx.is_causal, ctx.window)
        return dqkv, None, None, None, None, None, None


def _check_tables(qkv: torch.Tensor, d: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    B, T, _ = qkv.shape
    half = d // 2
    if cos.shape not in ((T, half), (B, T, half)) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be ({T}, {half}) or ({B}, {T}, {half}) for qkv "
                         f"{tuple(qkv.shape)}, got {tuple(cos.shape)} and {tuple(sin.shape)}")


def flash_attention_qkv(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor | None = None,
                        sin: torch.Tensor | None = None, is_causal: bool = True, num_kv_heads: int | None = None,
                        *, window: int | None = None) -> torch.Tensor:
    """Attention over the concatenated projections qkv (B, T, (H + 2·Hkv)·d) = q | k | v, each
    block (B, T, heads·d) head-major, Hkv = `num_kv_heads` (default: `num_heads`; fewer for
    grouped-query attention, a divisor of `num_heads`); with `cos`/`sin` ((T, d/2) or
    (B, T, d/2) float32, RoPE on interleaved pairs as `scratchlm.model.rope.apply_rope`), q and
    k are rotated first. `window`: as `flash_attention`'s.

    Returns (B, H, T, d), laid out (B, T, H, d) in memory like `flash_attention`'s output. Its
    backward writes the gradient of qkv as one tensor, RoPE undone inside the attention kernels,
    so the projections behind qkv can run their backward as one wide matmul each way.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads must divide num_heads, got {num_kv_heads} kv heads for {num_heads} heads")
    heads = num_heads + 2 * num_kv_heads
    if qkv.dim() != 3 or qkv.shape[-1] % heads:
        raise ValueError(f"qkv must be (batch, seq, (heads + 2·kv_heads)·d) for {num_heads} heads and "
                         f"{num_kv_heads} kv heads, got {tuple(qkv.shape)}")
    check_window(is_causal, window)
    if (cos is None) != (sin is None):
        raise ValueError("give both cos and sin, or neither")
    if cos is not None:
        if cos.dim() == 3 and cos.shape[0] == 1:  # positions shared by the batch, as (1, T)
            cos, sin = cos[0], sin[0]
        _check_tables(qkv, qkv.shape[-1] // heads, cos, sin)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    return _FlashAttentionQKV.apply(qkv, cos, sin, num_heads, num_kv_heads, is_causal, window)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 (Triton) as an autograd.Function.

    ``FlashAttentionTriton.apply(q, k, v, is_causal=False, window=None)`` on (batch, seq, d) or
    (batch, heads, seq, d) tensors of float16/bfloat16/float32 on a CUDA device, k and v
    possibly with fewer heads than q (see `flash_attention`); saves q, k, v, O and one float32
    log-sum-exp tensor of shape q.shape[:-1] for the backward.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                is_causal: bool = False, window: int | None = None) -> torch.Tensor:
        out, lse = flash_attention_forward_op(q, k, v, is_causal, window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward_op(grad_out, q, k, v, out, lse, ctx.is_causal, ctx.window)
        return dq, dk, dv, None, None
