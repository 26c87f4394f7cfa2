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

``decode_qkv`` (op ``scratchlm::decode_qkv``) is the same kernel's loop for a stacked q|k|v weight,
with the rest of an attention layer's per-token work before attention in its epilogue: each
program computes interleaved pairs (2i, 2i + 1) of one head, rotates q's and k's by RoPE at the
row's position, returns q and writes k and v into the KV cache (its mutated arguments).

``decode_attention_linear`` (op ``scratchlm::decode_attention_linear``) is a decode step's
attention and the output projection after it (plus the residual): the split decode attention
(`scratchlm.kernels.decode_attention_triton`) leaves its splits' partial results uncombined, and
this kernel combines them as it loads its rows of x, so the combine is no kernel of its own.
"""

from __future__ import annotations

import torch

from scratchlm.kernels.decode_attention_triton import (attention_output, attention_partials, attention_splits,
                                                       decode_attention_reference, runs_on_triton)
from scratchlm.kernels.triton_support import can_use_triton as _can_use_triton
from scratchlm.kernels.triton_support import device_of as _device
from scratchlm.kernels.triton_support import pdl_launch_options
from scratchlm.kernels.triton_support import register_op as _register
from scratchlm.kernels.triton_support import tl, triton

__all__ = ["MAX_ROWS", "combines_in_projection", "decode_attention_linear", "decode_attention_linear_reference",
           "decode_linear", "decode_linear_reference", "decode_qkv", "decode_qkv_reference"]

MAX_ROWS = 8  # rows a program multiplies at once: the kernel is for decode steps of small batches

if triton is not None:

    @triton.jit
    def _x_tile(x_rows, rows, rows_ok, k, k_ok, PM, PL, PACC, num_heads, FROM_PARTS: tl.constexpr,
                SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """Columns k of the rows of x, in float32: loaded, or FROM_PARTS combined from a split
        decode attention's partial results (`attention_partials`): column k is element k % d of
        head k // d, Σ wₛ accₛ / Σ wₛ lsumₛ over its splits with wₛ = 2^(mₛ - maxₛ mₛ)."""
        ok = rows_ok[:, None] & k_ok[None, :]
        if FROM_PARTS:
            first = (rows[:, None].to(tl.int64) * num_heads + (k // HEAD_DIM)[None, :]) * SPLITS
            top = tl.load(PM + first, mask=ok, other=0.0)
            for s in tl.static_range(1, SPLITS):
                top = tl.maximum(top, tl.load(PM + first + s, mask=ok, other=0.0))
            total = tl.zeros_like(top)
            acc = tl.zeros_like(top)
            for s in tl.static_range(SPLITS):
                weight = tl.exp2(tl.load(PM + first + s, mask=ok, other=0.0) - top)  # 0 for an empty split
                total += weight * tl.load(PL + first + s, mask=ok, other=1.0)
                acc += weight * tl.load(PACC + (first + s) * BLOCK_D + (k % HEAD_DIM)[None, :], mask=ok, other=0.0)
            return acc / total
        return tl.load(x_rows + k[None, :], mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _accumulate(acc_a, acc_b, w, u, X, W, G, x_rows, rows, rows_ok, k, k_ok, inv_rms, PM, PL, PACC, num_heads,
                    HAS_NORM: tl.constexpr, TWO: tl.constexpr, FROM_PARTS: tl.constexpr, SPLITS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        """acc_a (+ acc_b with TWO) plus the products of columns k of the (normalised) rows of x
        with the weight tiles w (and u), in float32."""
        x = _x_tile(x_rows, rows, rows_ok, k, k_ok, PM, PL, PACC, num_heads, FROM_PARTS, SPLITS, HEAD_DIM, BLOCK_D)
        if HAS_NORM:
            g = tl.load(G + k, mask=k_ok, other=0.0).to(tl.float32)
            x = (x * inv_rms[:, None] * g[None, :]).to(X.dtype.element_ty)
        x = x.to(W.dtype.element_ty).to(tl.float32)  # the matmul's operand, in w's dtype
        acc_a += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        if TWO:
            acc_b += tl.sum(x[:, None, :] * u.to(tl.float32)[None, :, :], axis=2)
        return acc_a, acc_b

    @triton.jit
    def _products(X, W, G, x_rows, rows, rows_ok, a_rows, b_rows, w_ok, K, PM, PL, PACC, num_heads,
                  EPS: tl.constexpr, HAS_NORM: tl.constexpr, TWO: tl.constexpr, FROM_PARTS: tl.constexpr,
                  SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """(BLOCK_M, BLOCK_N) float32 products of the (RMS-normalised) rows of x (`_x_tile`) with
        the weight rows at `a_rows` and, with TWO, at `b_rows` (pointers to their starts), each
        rounded to w's dtype as a matmul in that dtype returns it.

        The first BLOCK_K columns of the weights are loaded first: with PDL (the kernel launched
        while the one before it still runs) that is before waiting for it, as they do not depend
        on it; x and everything else only after."""
        k = tl.arange(0, BLOCK_K)
        k_ok = k < K
        w_first = tl.load(a_rows + k[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
        u_first = w_first
        if TWO:
            u_first = tl.load(b_rows + k[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        inv_rms = tl.full([BLOCK_M], 1.0, tl.float32)
        if HAS_NORM:
            squares = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_rows + kk[None, :], mask=rows_ok[:, None] & (kk < K)[None, :], other=0.0)
                x = x.to(tl.float32)
                squares += tl.sum(x * x, axis=1)
            inv_rms = 1.0 / tl.sqrt(squares / K + EPS)
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_a, acc_b = _accumulate(acc_a, acc_b, w_first, u_first, X, W, G, x_rows, rows, rows_ok, k, k_ok, inv_rms,
                                   PM, PL, PACC, num_heads, HAS_NORM, TWO, FROM_PARTS, SPLITS, HEAD_DIM, BLOCK_D)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            tile_ok = w_ok[:, None] & k_ok[None, :]
            w = tl.load(a_rows + k[None, :], mask=tile_ok, other=0.0)
            u = w
            if TWO:
                u = tl.load(b_rows + k[None, :], mask=tile_ok, other=0.0)
            acc_a, acc_b = _accumulate(acc_a, acc_b, w, u, X, W, G, x_rows, rows, rows_ok, k, k_ok, inv_rms,
                                       PM, PL, PACC, num_heads, HAS_NORM, TWO, FROM_PARTS, SPLITS, HEAD_DIM, BLOCK_D)
        return acc_a.to(W.dtype.element_ty).to(tl.float32), acc_b.to(W.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _decode_linear_kernel(X, W, G, R, O, M, N, K, stride_xm, stride_wn, stride_rm, stride_om,
                              PM, PL, PACC, num_heads,
                              EPS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
                              GATE_UP: tl.constexpr, FROM_PARTS: tl.constexpr, SPLITS: tl.constexpr,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        if PDL:  # the next kernel may start now (it waits for this one before reading what it writes)
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.arange(0, BLOCK_M)
        rows_ok = rows < M
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # this program's outputs (of N, or of F)
        n_ok = n < N
        x_rows = X + rows[:, None].to(tl.int64) * stride_xm
        w_rows = W + n[:, None].to(tl.int64) * stride_wn
        # with GATE_UP the up projection's rows sit N (= F) rows below the gate's
        out, up = _products(X, W, G, x_rows, rows, rows_ok, w_rows, w_rows + N * stride_wn, n_ok, K, PM, PL, PACC,
                            num_heads, EPS, HAS_NORM, GATE_UP, FROM_PARTS, SPLITS, HEAD_DIM, BLOCK_D, PDL,
                            BLOCK_M, BLOCK_N, BLOCK_K)
        if GATE_UP:
            out = (out * tl.sigmoid(out) * up).to(W.dtype.element_ty).to(tl.float32)
        out_ok = rows_ok[:, None] & n_ok[None, :]
        if HAS_RES:
            r = tl.load(R + rows[:, None].to(tl.int64) * stride_rm + n[None, :], mask=out_ok, other=0.0)
            out = r.to(tl.float32) + out
        tl.store(O + rows[:, None].to(tl.int64) * stride_om + n[None, :], out.to(O.dtype.element_ty), mask=out_ok)

    @triton.jit
    def _decode_qkv_kernel(X, W, G, COS, SIN, POS, Q, KC, VC, M, K, stride_xm, stride_wn, stride_qm,
                           stride_cr, stride_ch, stride_cn, stride_table,
                           EPS: tl.constexpr, HAS_NORM: tl.constexpr, NUM_HEADS: tl.constexpr,
                           NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
        """One program: BLOCK_P interleaved pairs (2i, 2i + 1) of one head of q, k or v. Queries
        and keys are rotated by RoPE at each row's position; q goes to Q, k and v to the caches
        at slot pos[row] of row `row`."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        programs_a_head: tl.constexpr = HEAD_DIM // 2 // BLOCK_P
        head = tl.program_id(0) // programs_a_head
        pair = (tl.program_id(0) % programs_a_head) * BLOCK_P + tl.arange(0, BLOCK_P)
        rows = tl.arange(0, BLOCK_M)
        rows_ok = rows < M
        x_rows = X + rows[:, None].to(tl.int64) * stride_xm
        even = W + (head * HEAD_DIM + 2 * pair)[:, None].to(tl.int64) * stride_wn
        pair_ok = pair < HEAD_DIM // 2
        e, o = _products(X, W, G, x_rows, rows, rows_ok, even, even + stride_wn, pair_ok, K, X, X, X, 1, EPS,
                         HAS_NORM, True, False, 1, 1, 1, PDL, BLOCK_M, BLOCK_P, BLOCK_K)
        pos = tl.load(POS + rows, mask=rows_ok, other=0)
        out_ok = rows_ok[:, None] & pair_ok[None, :]
        table = pos[:, None].to(tl.int64) * stride_table + pair[None, :]
        cos = tl.load(COS + table, mask=out_ok, other=1.0).to(tl.float32)
        sin = tl.load(SIN + table, mask=out_ok, other=0.0).to(tl.float32)
        rotated = head < NUM_HEADS + NUM_KV_HEADS  # q and k; v keeps its values
        e_out = tl.where(rotated, e * cos - o * sin, e)
        o_out = tl.where(rotated, e * sin + o * cos, o)
        col = 2 * pair[None, :]
        q_at = Q + rows[:, None].to(tl.int64) * stride_qm + head * HEAD_DIM + col
        is_q = head < NUM_HEADS
        tl.store(q_at, e_out.to(Q.dtype.element_ty), mask=out_ok & is_q)
        tl.store(q_at + 1, o_out.to(Q.dtype.element_ty), mask=out_ok & is_q)
        is_k = (head >= NUM_HEADS) & rotated
        kv_head = tl.where(is_k, head - NUM_HEADS, head - NUM_HEADS - NUM_KV_HEADS)
        slot = (rows[:, None].to(tl.int64) * stride_cr + kv_head * stride_ch
                + pos[:, None].to(tl.int64) * stride_cn + col)
        tl.store(KC + slot, e_out.to(KC.dtype.element_ty), mask=out_ok & is_k)
        tl.store(KC + slot + 1, o_out.to(KC.dtype.element_ty), mask=out_ok & is_k)
        tl.store(VC + slot, e_out.to(VC.dtype.element_ty), mask=out_ok & ~rotated)
        tl.store(VC + slot + 1, o_out.to(VC.dtype.element_ty), mask=out_ok & ~rotated)


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
                        residual: torch.Tensor | None, eps: float, gate_up: bool, pdl: bool) -> torch.Tensor:
    _check(x, w, norm_weight, residual, gate_up)
    M = x.shape[0]
    runs = (_can_use_triton(w) and M <= MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1
            and (residual is None or residual.stride(1) == 1))
    if not runs:
        return decode_linear_reference(x, w, norm_weight, residual, eps, gate_up)
    return _launch(x, x.stride(0), M, x.shape[1], w, norm_weight, residual, eps, gate_up, pdl)


def _launch(x: torch.Tensor, stride_xm: int, M: int, K: int, w: torch.Tensor, norm_weight: torch.Tensor | None,
            residual: torch.Tensor | None, eps: float, gate_up: bool, pdl: bool,
            parts: tuple | None = None) -> torch.Tensor:
    """Run `_decode_linear_kernel` on M rows of K inputs: of x (row stride `stride_xm`), or with
    `parts` = (m, lsum, acc, splits, heads, head_dim) of `attention_partials` combined from those
    (x then only a pointer it does not read); with `pdl`, launched with PDL where supported.
    Returns the (M, N) result."""
    N = _out_shape(x, w, gate_up)[1]
    out = torch.empty((M, N), dtype=w.dtype if residual is None else residual.dtype, device=w.device)
    block_m, block_n, block_k, num_warps = blocks_for(M, N, K, gate_up)
    g = x if norm_weight is None else norm_weight  # a pointer the kernel does not read without HAS_NORM
    r = out if residual is None else residual
    m, lsum, acc, splits, heads, head_dim = (x, x, x, 1, 1, 1) if parts is None else parts
    with _device(w):
        _decode_linear_kernel[(triton.cdiv(N, block_n),)](
            x, w, g, r, out, M, N, K, stride_xm, w.stride(0), r.stride(0), out.stride(0), m, lsum, acc, heads,
            EPS=float(eps), HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, GATE_UP=gate_up,
            FROM_PARTS=parts is not None, SPLITS=splits, HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, **pdl_launch_options(pdl, w))
    return out


def _decode_linear_fake(x, w, norm_weight, residual, eps, gate_up, pdl):
    return torch.empty(_out_shape(x, w, gate_up), dtype=w.dtype if residual is None else residual.dtype,
                       device=w.device)


_decode_linear_op = _register("scratchlm::decode_linear", _decode_linear_impl, _decode_linear_fake, opaque=True)


def decode_linear(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, eps: float = 1e-5, gate_up: bool = False,
                  pdl: bool = False) -> torch.Tensor:
    """(RMSNorm of) x (M, K) times wᵀ, then the SwiGLU gate (`gate_up`) and/or plus `residual`:
    see the module docstring. Rows past MAX_ROWS, or tensors Triton cannot run, take torch's path.
    `pdl`: launch with programmatic dependent launch where supported
    (`scratchlm.kernels.triton_support.pdl_supported`)."""
    return _decode_linear_op(x, w, norm_weight, residual, float(eps), bool(gate_up), bool(pdl))


def decode_qkv_reference(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                         cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What `decode_qkv` computes, with torch: the projection as `decode_linear_reference`, RoPE on
    q and k as `scratchlm.model.rope.apply_rope`, k and v written to the caches."""
    from scratchlm.model.rope import apply_rope

    rows, kv_heads, d = x.shape[0], k_cache.shape[1], k_cache.shape[3]
    q, k, v = decode_linear_reference(x, w, norm_weight, None, eps).split(
        (num_heads * d, kv_heads * d, kv_heads * d), dim=-1)
    c, s = cos[pos][:, None], sin[pos][:, None]  # (rows, 1, d/2): over heads
    q = apply_rope(q.reshape(rows, num_heads, d), c, s)
    k = apply_rope(k.reshape(rows, kv_heads, d), c, s)
    at = torch.arange(rows, device=x.device)
    k_cache[at, :, pos] = k.to(k_cache.dtype)
    v_cache[at, :, pos] = v.reshape(rows, kv_heads, d).to(v_cache.dtype)
    return q.reshape(rows, num_heads * d)


def _check_qkv(x, w, cos, pos, k_cache, v_cache, num_heads) -> None:
    rows, (slots, kv_heads, _, d) = x.shape[0], k_cache.shape
    if (x.dim() != 2 or w.shape != ((num_heads + 2 * kv_heads) * d, x.shape[1]) or v_cache.shape != k_cache.shape
            or d % 2 or cos.shape[-1] != d // 2 or pos.shape != (rows,) or rows > slots):
        raise ValueError(f"decode_qkv: x (M, K), w ((H + 2·Hkv)·d, K), caches (slots >= M, Hkv, L, d), cos "
                         f"(positions, d/2), pos (M,); got x {tuple(x.shape)}, w {tuple(w.shape)}, caches "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}, cos {tuple(cos.shape)}, pos "
                         f"{tuple(pos.shape)}, H {num_heads}")


def _decode_qkv_impl(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, num_heads: int, pdl: bool) -> torch.Tensor:
    _check_qkv(x, w, cos, pos, k_cache, v_cache, num_heads)
    rows, kv_heads, d = x.shape[0], k_cache.shape[1], k_cache.shape[3]
    runs = (_can_use_triton(w) and rows <= MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and cos.stride(1) == 1
            and sin.stride() == cos.stride())
    if not runs:
        return decode_qkv_reference(x, w, norm_weight, eps, cos, sin, pos, k_cache, v_cache, num_heads)
    q = torch.empty((rows, num_heads * d), dtype=w.dtype, device=w.device)
    # a program's two tiles (even and odd rows of its pairs) as the gated projection's (gate and up rows)
    block_m, block_n, block_k, num_warps = blocks_for(rows, w.shape[0], x.shape[1], True)
    block_p = block_n // 2 if (d // 2) % (block_n // 2) == 0 else 1  # pairs a program, whole within a head
    heads = num_heads + 2 * kv_heads
    g = x if norm_weight is None else norm_weight
    with _device(w):
        _decode_qkv_kernel[(heads * (d // 2 // block_p),)](
            x, w, g, cos, sin, pos, q, k_cache, v_cache, rows, x.shape[1], x.stride(0), w.stride(0), q.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0),
            EPS=float(eps), HAS_NORM=norm_weight is not None, NUM_HEADS=num_heads, NUM_KV_HEADS=kv_heads,
            HEAD_DIM=d, BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_K=block_k, num_warps=num_warps,
            **pdl_launch_options(pdl, w))
    return q


def _decode_qkv_fake(x, w, norm_weight, eps, cos, sin, pos, k_cache, v_cache, num_heads, pdl):
    return torch.empty((x.shape[0], num_heads * k_cache.shape[3]), dtype=w.dtype, device=w.device)


_decode_qkv_op = _register("scratchlm::decode_qkv", _decode_qkv_impl, _decode_qkv_fake,
                           mutates_args=("k_cache", "v_cache"), opaque=True)


def decode_qkv(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
               sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               num_heads: int, pdl: bool = False) -> torch.Tensor:
    """A decode step's q|k|v in one kernel: (RMSNorm of) x (M, K) times the stacked q|k|v weight w
    ((H + 2·Hkv)·d, K), RoPE (interleaved pairs, `scratchlm.model.rope`) on q and k at each row's
    position pos[row] from the (positions, d/2) tables cos and sin, and k and v written to the
    caches (slots, Hkv, L, d) at [row, :, pos[row]]. Returns the rotated q, (M, H·d) in w's dtype.
    `pdl` as for `decode_linear`."""
    return _decode_qkv_op(x, w, norm_weight, float(eps), cos, sin, pos, k_cache, v_cache, int(num_heads), bool(pdl))


def decode_attention_linear_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                                      window: int, w: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """What `decode_attention_linear` computes, with torch: the decode attention's output in q's
    dtype (as `scratchlm.infer.static_cache.DecodeView.attend` returns it), its heads side by
    side, through `decode_linear_reference`."""
    b, H, _, d = q.shape
    a = decode_attention_reference(q, k, v, pos, window).to(q.dtype).reshape(b, H * d)
    return decode_linear_reference(a, w, None, residual)


def combines_in_projection(q: torch.Tensor, k: torch.Tensor, window: int) -> bool:
    """Whether `decode_attention_linear` combines the attention's splits inside the projection's
    kernel: at one row, or where the attention does not split. Every program of the projection
    combines every row's splits of every head again, in registers: at four rows of GPT-2-small
    shapes (eight splits) a layer took 538 us against 23 at one row on an H100
    (docs/benchmarks/decode_linear.md). Elsewhere the attention combines its own splits first."""
    return q.shape[0] == 1 or attention_splits(q, k, window, by_keys=True) == 1


def _decode_attention_linear_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int,
                                  w: torch.Tensor, residual: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    b, H, _, d = q.shape
    if w.dim() != 2 or w.shape[1] != H * d or (residual is not None and tuple(residual.shape) != (b, w.shape[0])):
        raise ValueError(f"decode_attention_linear: q (b, H, 1, d), w (N, H·d), residual (b, N); got q "
                         f"{tuple(q.shape)}, w {tuple(w.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}")
    runs = (_can_use_triton(w) and b <= MAX_ROWS and runs_on_triton(q, k, v) and w.stride(1) == 1
            and (residual is None or residual.stride(1) == 1))
    if not runs:
        return decode_attention_linear_reference(q, k, v, pos, window, w, residual)
    # (an opaque op: the window's length is concrete here, and the split count may follow it)
    if not combines_in_projection(q, k, window):  # the attention combines its own splits
        a = attention_output(q, k, v, pos, window, pdl=pdl, by_keys=True).reshape(b, H * d)
        return _launch(a, a.stride(0), b, H * d, w, None, residual, 0.0, False, pdl)
    m, lsum, acc, splits = attention_partials(q, k, v, pos, window, pdl=pdl, by_keys=True)
    return _launch(q, 0, b, H * d, w, None, residual, 0.0, False, pdl, parts=(m, lsum, acc, splits, H, d))


def _decode_attention_linear_fake(q, k, v, pos, window, w, residual, pdl):
    return torch.empty((q.shape[0], w.shape[0]), dtype=w.dtype if residual is None else residual.dtype,
                       device=w.device)


_decode_attention_linear_op = _register("scratchlm::decode_attention_linear", _decode_attention_linear_impl,
                                        _decode_attention_linear_fake, opaque=True)


def decode_attention_linear(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int | None,
                            w: torch.Tensor, residual: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """`scratchlm.kernels.decode_attention_triton.decode_attention(q, k, v, pos, window)` (b, H,
    1, d), its heads side by side (b, H·d), times wᵀ (w (N, H·d)), plus `residual` (b, N): the
    attention's split partial results combined inside the projection's kernel. `pdl` as for
    `decode_linear` (both kernels)."""
    return _decode_attention_linear_op(q, k, v, pos, int(window or 0), w, residual, bool(pdl))
