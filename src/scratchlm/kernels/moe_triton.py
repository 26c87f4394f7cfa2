"""A mixture-of-experts FFN's grouped GEMMs with its row moves and its SwiGLU folded in.

The layout (``MoEFFN`` builds it, `scratchlm.model.moe`): the (token, choice) assignments sit in
a buffer of P rows grouped by expert, each expert's block starting at a multiple of ``ALIGN``
rows, so no tile of rows straddles two experts.

- ``offs`` (E,) int32: the blocks' ends; the last is P.
- ``row_token`` (P,) int32: the token a row holds, -1 for padding.
- ``kept`` (E,) int32: how many rows each expert holds (the first ``kept[e]`` of its block).

``grouped_swiglu(x, row_token, offs, kept, token_rows, w1, w3, w2, dtype)`` computes every
row's expert SwiGLU, y[r] = (silu(x[t] w1ᵀ) · x[t] w3ᵀ) w2ᵀ with t = row_token[r] and the row's
expert's weights (w1, w3 (E, F, D), w2 (E, D, F)), in the compute dtype. It returns (P, D), zero
on padding rows. x and the weights are cast to the compute dtype once (w1 and w3 stacked as
w13 = w1 | w3, (E, 2F, D)); its forward is then two kernels:

- up: h = x[t] w13ᵀ. The rows of x are gathered as their tiles load. The epilogue writes
  h (P, 2F), kept for the backward, and g = silu(h1) · h3 (P, F).
- down: y = g w2ᵀ.

Its backward (for grad_y (P, D)) is four:

- dh = SwiGLU'(grad_y w2) with SwiGLU's backward in the epilogue.
- dw2[e] = Σ_r grad_y[r]ᵀ g[r] and dw13[e] = Σ_r dh[r]ᵀ x[t], over the rows of e's block. The
  second gathers x's rows as it loads them and writes w1's and w3's halves apart; both write in
  the weights' own dtype (float32 masters), so no cast follows.
- dx rows = dh w13, gathered back onto their tokens and summed (no atomics).

In place of `torch._grouped_mm`, these take the dispatch gather and SwiGLU's forward and backward
(which Inductor otherwise runs as kernels of their own over the (P, 2F) projections) into the
GEMMs' loads and epilogues.

Each launch is an op (``scratchlm::moe_rows``, ``scratchlm::moe_expert_grad``), a
``triton_op`` where torch has it so torch.compile launches the kernels itself. On tensors
Triton cannot run, the same is computed with torch, one matmul per expert.
"""

from __future__ import annotations

import torch

from scratchlm.kernels.triton_support import can_use_triton as _can_use_triton
from scratchlm.kernels.triton_support import device_of as _device
from scratchlm.kernels.triton_support import interpreting as _interpreting
from scratchlm.kernels.triton_support import register_op as _register
from scratchlm.kernels.triton_support import tl, triton, wrap_triton
from scratchlm.model.functional import silu

__all__ = ["ALIGN", "EPILOGUES", "grouped_swiglu", "grouped_swiglu_reference", "moe_expert_grad", "moe_rows"]

ALIGN = 128  # rows; every block starts at a multiple of this, a multiple of every BLOCK_M below
EPILOGUES = {"store": 0, "swiglu": 1, "swiglu_backward": 2}

if triton is not None:

    @triton.jit
    def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
        # DOT_F32 (under the interpreter): operands in float32, the values they already hold;
        # Triton 3.6's interpreter returns garbage from a bf16 tl.dot.
        if DOT_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _rows_kernel(A, ROW_TOKEN, OFFS, B, C, H, P, N, K, F, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
                     NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, GATHER: tl.constexpr, EPILOGUE: tl.constexpr,
                     EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """C[r, n] = epilogue(Σ_k A[src(r), k] · B[e(r), n, k]) for one BLOCK_M x BLOCK_N tile.

        src(r) is row_token[r] with GATHER, else r; e(r) is the expert whose block holds row r
        (the number of block ends at or before the tile's first row). Padding rows give zeros.
        EPILOGUE 0 stores the product. EPILOGUE 1 (SwiGLU) also multiplies by B's rows F + n:
        H[r] gets h1 | h3, C[r, n] silu(h1) · h3. EPILOGUE 2 (SwiGLU's backward) reads h1 | h3
        from H and writes the gradients of both into C (P, 2F) from the product dg.
        """
        pid = tl.program_id(0)
        tiles_m = P // BLOCK_M
        tiles_n = tl.cdiv(N, BLOCK_N)
        # Consecutive programs take GROUP_M row tiles of one column band: B's tile stays in L2.
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ends = tl.load(OFFS + tl.arange(0, E_POW2), mask=tl.arange(0, E_POW2) < NUM_EXPERTS, other=P)
        expert = tl.minimum(tl.sum((ends <= pid_m * BLOCK_M).to(tl.int32), axis=0), NUM_EXPERTS - 1)
        token = tl.load(ROW_TOKEN + rows)
        filled = token >= 0
        src = tl.where(filled, token, 0).to(tl.int64) if GATHER else rows.to(tl.int64)
        # A tile of padding rows only multiplies nothing: its loop runs no step.
        k_end = tl.where(tl.max(filled.to(tl.int32), axis=0) > 0, K, 0)

        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_ok = cols < N
        cols_b = tl.where(cols_ok, cols, 0)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = A + src[:, None] * stride_am + offs_k[None, :]
        b_ptrs = B + expert.to(tl.int64) * stride_be + cols_b[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_end, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < K - k
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            a = a.to(B.dtype.element_ty)
            acc = _dot(a, b, acc, DOT_PRECISION, DOT_F32)
            if EPILOGUE == 1:
                if EVEN_K:
                    b3 = tl.load(b_ptrs + F * stride_bn)
                else:
                    b3 = tl.load(b_ptrs + F * stride_bn, mask=offs_k[:, None] < K - k, other=0.0)
                acc3 = _dot(a, b3, acc3, DOT_PRECISION, DOT_F32)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk

        out_ty = C.dtype.element_ty
        ok = filled[:, None] & cols_ok[None, :]
        c_ptrs = C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        if EPILOGUE == 0:
            tl.store(c_ptrs, tl.where(ok, acc, 0.0).to(out_ty), mask=cols_ok[None, :])
        elif EPILOGUE == 1:
            # Rounded as a matmul's output would be, then gated in float32 as the torch formula is.
            h1 = tl.where(ok, acc, 0.0).to(out_ty)
            h3 = tl.where(ok, acc3, 0.0).to(out_ty)
            h_ptrs = H + rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
            tl.store(h_ptrs, h1, mask=cols_ok[None, :])
            tl.store(h_ptrs + F, h3, mask=cols_ok[None, :])
            a1 = h1.to(tl.float32)
            g = a1 * tl.sigmoid(a1) * h3.to(tl.float32)
            tl.store(c_ptrs, g.to(out_ty), mask=cols_ok[None, :])
        else:
            h_ptrs = H + rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
            a1 = tl.load(h_ptrs, mask=ok, other=0.0).to(tl.float32)
            a3 = tl.load(h_ptrs + F, mask=ok, other=0.0).to(tl.float32)
            dg = tl.where(ok, acc, 0.0).to(out_ty).to(tl.float32)
            sig = tl.sigmoid(a1)
            # d silu(a)/da = sig · (1 + a · (1 - sig))
            d1 = dg * a3 * sig * (1.0 + a1 * (1.0 - sig))
            d3 = dg * a1 * sig
            d_ptrs = C + rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
            tl.store(d_ptrs, d1.to(out_ty), mask=cols_ok[None, :])
            tl.store(d_ptrs + F, d3.to(out_ty), mask=cols_ok[None, :])

    @triton.jit
    def _expert_grad_kernel(A, B, ROW_TOKEN, OFFS, KEPT, C, C2, M, N, SPLIT, stride_am, stride_bm,
                            GATHER_B: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Σ_r A[r, m] · B[src(r), n] over the kept rows r of expert e's block, into C[e, m, n] for
        m < SPLIT and C2[e, m - SPLIT, n] for the rest (w1's and w3's gradients apart).

        src(r) is row_token[r] with GATHER_B, else r. An expert with no rows gets zeros.
        """
        pid = tl.program_id(0)
        expert = tl.program_id(1)
        tiles_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // tiles_n
        pid_n = pid % tiles_n
        start = tl.where(expert > 0, tl.load(OFFS + expert - 1, mask=expert > 0, other=0), 0)
        stop = start + tl.load(KEPT + expert)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(start, stop, BLOCK_K):
            rows = r0 + tl.arange(0, BLOCK_K)
            row_ok = rows < stop
            a = tl.load(A + rows.to(tl.int64)[None, :] * stride_am + offs_m[:, None],
                        mask=row_ok[None, :] & m_ok[:, None], other=0.0)  # (BLOCK_M, BLOCK_K) = A rowsᵀ
            if GATHER_B:
                src = tl.load(ROW_TOKEN + rows, mask=row_ok, other=0)
                src = tl.where(src >= 0, src, 0).to(tl.int64)
            else:
                src = rows.to(tl.int64)
            b = tl.load(B + src[:, None] * stride_bm + offs_n[None, :], mask=row_ok[:, None] & n_ok[None, :],
                        other=0.0)
            acc = _dot(a, b.to(A.dtype.element_ty), acc, DOT_PRECISION, DOT_F32)
        first = offs_m < SPLIT
        e = expert.to(tl.int64)
        c_ptrs = tl.where(first[:, None], C + (e * SPLIT + offs_m[:, None]) * N + offs_n[None, :],
                          C2 + (e * (M - SPLIT) + offs_m[:, None] - SPLIT) * N + offs_n[None, :])
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), chosen for Hopper (H100/H200): wgmma-sized
    # tiles of 128 rows, 64 columns where the SwiGLU epilogue keeps two accumulators.
    _ROWS_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 256, 64, 8, 3),
                   (64, 128, 64, 4, 4)]
    _SWIGLU_TILES = [(128, 64, 64, 8, 3), (128, 64, 64, 8, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4),
                     (128, 128, 64, 8, 3)]
    _GRAD_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4)]
    _ROWS_KEY = ["N", "K", "EPILOGUE", "GATHER"]

    def _configs(tiles):
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
                for m, n, k, w, s in tiles]

    _rows_tuned = triton.autotune(_configs(_ROWS_TILES), key=_ROWS_KEY)(_rows_kernel)
    _swiglu_tuned = triton.autotune(_configs(_SWIGLU_TILES), key=_ROWS_KEY)(_rows_kernel)
    _grad_tuned = triton.autotune(_configs(_GRAD_TILES), key=["M", "N", "GATHER_B"])(_expert_grad_kernel)


def _autotune(t: torch.Tensor) -> bool:
    return t.is_cuda and not _interpreting() and t.dtype in (torch.bfloat16, torch.float16)


def _dot_flags(t: torch.Tensor) -> dict:
    return {"DOT_PRECISION": "ieee" if t.dtype == torch.float32 else "tf32", "DOT_F32": _interpreting()}


def _block_starts(offs: torch.Tensor) -> torch.Tensor:
    """(E,) each expert's first row: the previous block's end."""
    return torch.cat([offs.new_zeros(1), offs[:-1]])


def _expert_of_rows(offs: torch.Tensor, P: int) -> torch.Tensor:
    """(P,) the expert whose block holds each row."""
    rows = torch.arange(P, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, rows, right=True).clamp(max=offs.shape[0] - 1)


def _rows_reference(a, row_token, offs, b, h, epilogue: int, gather: bool):
    """The rows GEMM with torch; b (E, N, K). Returns (C, H or None) as the kernel writes them.

    Every expert's matmul runs over all the rows and keeps its block's (E times the FLOPs): no
    host sync, so torch.compile can trace it on any device. It is the path for tensors Triton
    cannot run, small ones (tests, CPU).
    """
    P = row_token.shape[0]
    src = (a[row_token.clamp(min=0).long()] if gather else a).to(b.dtype).float()
    expert = _expert_of_rows(offs, P)[:, None]
    prod = src.new_zeros((P, b.shape[1]))
    for e in range(b.shape[0]):
        prod = torch.where(expert == e, src @ b[e].float().t(), prod)
    prod = torch.where((row_token >= 0)[:, None], prod, 0).to(b.dtype)
    if epilogue == 0:
        return prod, None
    if epilogue == 1:
        F = b.shape[1] // 2
        return (silu(prod[:, :F].float()) * prod[:, F:].float()).to(b.dtype), prod
    F = h.shape[1] // 2
    a1, a3, dg = h[:, :F].float(), h[:, F:].float(), prod.float()
    sig = torch.sigmoid(a1)
    return torch.cat([dg * a3 * sig * (1 + a1 * (1 - sig)), dg * a1 * sig], dim=1).to(b.dtype), None


def _rows_impl(a: torch.Tensor, row_token: torch.Tensor, offs: torch.Tensor, b: torch.Tensor, h: torch.Tensor,
               epilogue: int, gather: bool, n: int) -> list[torch.Tensor]:
    """The rows GEMM (see ``moe_rows``); returns [C, H] (H empty unless epilogue 1)."""
    P, E = row_token.shape[0], offs.shape[0]
    if epilogue == 1:
        c = a.new_empty((P, n), dtype=b.dtype)
        hh = a.new_empty((P, 2 * n), dtype=b.dtype)
    else:
        c = a.new_empty((P, 2 * n if epilogue == 2 else n), dtype=b.dtype)
        hh = a.new_empty((0,), dtype=b.dtype)
    if not _can_use_triton(a):
        c0, h0 = _rows_reference(a, row_token, offs, _as_nk(b, epilogue), h, epilogue, gather)
        c.copy_(c0)
        if epilogue == 1:
            hh.copy_(h0)
        return [c, hh]
    K = a.shape[1]
    sbe, sbn, sbk = _b_strides(b, epilogue)
    F = n if epilogue else 0
    # H: written by epilogue 1, read by epilogue 2, unused by 0 (then any valid buffer)
    H = {0: c, 1: hh, 2: h}[epilogue]
    args = (a, row_token, offs, b, c, H, P, n, K, F, a.stride(0), sbe, sbn, sbk, c.stride(0))
    flags = dict(NUM_EXPERTS=E, E_POW2=triton.next_power_of_2(E), GATHER=gather, EPILOGUE=epilogue,
                 GROUP_M=8, **_dot_flags(b))
    grid = lambda meta: (P // meta["BLOCK_M"] * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    with _device(a):
        if _autotune(b) and K % 64 == 0:
            kernel = _swiglu_tuned if epilogue == 1 else _rows_tuned
            wrap_triton(kernel)[grid](*args, **flags, EVEN_K=True)
        else:
            wrap_triton(_rows_kernel)[grid](*args, **flags, EVEN_K=K % 32 == 0, BLOCK_M=64, BLOCK_N=32,
                                            BLOCK_K=32, num_warps=4, num_stages=2)
    return [c, hh]


def _b_strides(b: torch.Tensor, epilogue: int) -> tuple[int, int, int]:
    # epilogues 0 and 1 multiply by b (E, N, K) as stored (x w13ᵀ, g w2ᵀ); epilogue 2 by
    # b (E, K, N) (grad_y w2, whose weight is (E, D, F)) -- and so does the dx GEMM (dh w13),
    # which moe_rows runs as epilogue 0 with b transposed.
    if epilogue == 2:
        return b.stride(0), b.stride(2), b.stride(1)
    return b.stride(0), b.stride(1), b.stride(2)


def _as_nk(b: torch.Tensor, epilogue: int) -> torch.Tensor:
    return b.transpose(1, 2) if epilogue == 2 else b


def _rows_fake(a, row_token, offs, b, h, epilogue, gather, n):
    P = row_token.shape[0]
    width = 2 * n if epilogue == 2 else n
    return [a.new_empty((P, width), dtype=b.dtype),
            a.new_empty((P, 2 * n) if epilogue == 1 else (0,), dtype=b.dtype)]


moe_rows_op = _register("scratchlm::moe_rows", _rows_impl, _rows_fake)


def moe_rows(a: torch.Tensor, row_token: torch.Tensor, offs: torch.Tensor, b: torch.Tensor, *,
             epilogue: str = "store", gather: bool = False, h: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per-row products with each row's expert's weight; returns [C, H].

    a (rows, K): with ``gather`` the rows are x's tokens, row r reads a[row_token[r]]; else a
    has P rows. b: (E, N, K) for epilogues "store" and "swiglu" (N = 2F for "swiglu": w13),
    (E, K, N) for "swiglu_backward" (w2 (E, D, F)). "swiglu" returns [g (P, F), h (P, 2F)];
    "swiglu_backward" takes h and returns [dh (P, 2F), empty]; "store" [a b_eᵀ (P, N), empty].
    The result has b's dtype; padding rows are zeros.
    """
    code = EPILOGUES[epilogue]
    n = b.shape[1] // 2 if code == 1 else (b.shape[2] if code == 2 else b.shape[1])
    h = a.new_empty((0,), dtype=b.dtype) if h is None else h
    return moe_rows_op(a, row_token, offs, b, h, code, gather, n)


def _expert_grad_impl(a: torch.Tensor, b: torch.Tensor, row_token: torch.Tensor, offs: torch.Tensor,
                      kept: torch.Tensor, gather_b: bool, split: int, out_dtype: torch.dtype) -> list[torch.Tensor]:
    E, M, N = offs.shape[0], a.shape[1], b.shape[1]
    if not _can_use_triton(a):  # torch, without a host sync (see _rows_reference)
        P = row_token.shape[0]
        src = (b[row_token.clamp(min=0).long()] if gather_b else b[:P]).to(a.dtype).float()
        expert = _expert_of_rows(offs, P)
        place = torch.arange(P, device=a.device) - _block_starts(offs)[expert]
        mine = (expert[None, :] == torch.arange(E, device=a.device)[:, None]) & (place < kept[expert])[None, :]
        c = torch.einsum("ep,pm,pn->emn", mine.float(), a.float(), src).to(out_dtype)
        return [c[:, :split].clone(), c[:, split:].clone()]
    c = a.new_empty((E, split, N), dtype=out_dtype)
    c2 = a.new_empty((E, M - split, N), dtype=out_dtype)
    args = (a, b, row_token, offs, kept, c, c2 if split < M else c, M, N, split, a.stride(0), b.stride(0))
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), E)  # noqa: E731
    with _device(a):
        if _autotune(a):
            wrap_triton(_grad_tuned)[grid](*args, GATHER_B=gather_b, **_dot_flags(a))
        else:
            wrap_triton(_expert_grad_kernel)[grid](*args, GATHER_B=gather_b, **_dot_flags(a), BLOCK_M=32, BLOCK_N=32,
                                                   BLOCK_K=32, num_warps=4, num_stages=2)
    return [c, c2]


def _expert_grad_fake(a, b, row_token, offs, kept, gather_b, split, out_dtype):
    E, M, N = offs.shape[0], a.shape[1], b.shape[1]
    return [a.new_empty((E, split, N), dtype=out_dtype), a.new_empty((E, M - split, N), dtype=out_dtype)]


moe_expert_grad_op = _register("scratchlm::moe_expert_grad", _expert_grad_impl, _expert_grad_fake)


def moe_expert_grad(a: torch.Tensor, b: torch.Tensor, row_token: torch.Tensor, offs: torch.Tensor,
                    kept: torch.Tensor, *, gather_b: bool = False, split: int | None = None,
                    out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """For each expert e, Σ a[r]ᵀ b[src(r)] over the kept rows r of its block, where src(r) =
    row_token[r] with ``gather_b`` (b then holds x's tokens), else r; a (P, M). Returns [the
    result's first ``split`` rows of M (E, split, N), the rest (E, M - split, N)] (split
    defaults to M, the second then empty), in ``out_dtype`` (default a's); the sum runs in
    float32."""
    M = a.shape[1]
    return moe_expert_grad_op(a, b, row_token, offs, kept, gather_b, M if split is None else split,
                              a.dtype if out_dtype is None else out_dtype)


class _GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_token, offs, kept, token_rows, w1, w3, w2, dtype):
        # The operands in the compute dtype, once: the kernels then load them as they are (x's rows
        # gathered straight into the pipeline), and the backward keeps half-size copies.
        xc = x.to(dtype).contiguous()
        w13 = torch.cat([w1.to(dtype), w3.to(dtype)], dim=1)  # (E, 2F, D)
        w2c = w2.to(dtype).contiguous()
        g, h = moe_rows(xc, row_token, offs, w13, epilogue="swiglu", gather=True)
        (y, _) = moe_rows(g, row_token, offs, w2c)
        ctx.save_for_backward(xc, row_token, offs, kept, token_rows, w13, w2c, h, g)
        ctx.dtypes = (x.dtype, w1.dtype, w3.dtype, w2.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, row_token, offs, kept, token_rows, w13, w2, h, g = ctx.saved_tensors
        x_dtype, w1_dtype, w3_dtype, w2_dtype = ctx.dtypes
        grad_y = grad_y.to(w2.dtype).contiguous()
        dx_needed, dw1_needed, dw3_needed, dw2_needed = (ctx.needs_input_grad[i] for i in (0, 5, 6, 7))
        dh = dw1 = dw3 = dw2 = grad_x = None
        if dx_needed or dw1_needed or dw3_needed:
            dh, _ = moe_rows(grad_y, row_token, offs, w2, epilogue="swiglu_backward", h=h)
        if dw2_needed:
            dw2, _ = moe_expert_grad(grad_y, g, row_token, offs, kept, out_dtype=w2_dtype)
        if dw1_needed or dw3_needed:
            # straight into w1's and w3's dtype (float32 master weights): no cast pass after
            dw1, dw3 = moe_expert_grad(dh, x, row_token, offs, kept, gather_b=True, split=w13.shape[1] // 2,
                                       out_dtype=w1_dtype)
            dw3 = dw3.to(w3_dtype)
        if dx_needed:
            # dh w13 over the rows, then each token's rows gathered and summed (no atomics).
            dbuf, _ = moe_rows(dh, row_token, offs, w13.transpose(1, 2))
            picked = dbuf[token_rows.clamp(min=0)].float()  # (k, N, D)
            grad_x = torch.where((token_rows >= 0)[..., None], picked, 0.0).sum(dim=0).to(x_dtype)
        return grad_x, None, None, None, None, dw1, dw3, dw2, None


def grouped_swiglu(x: torch.Tensor, row_token: torch.Tensor, offs: torch.Tensor, kept: torch.Tensor,
                   token_rows: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """(P, D): row r's expert SwiGLU of x[row_token[r]] (zero on padding rows), computed in
    ``dtype`` (default w1's; bf16 under autocast) and returned in it.

    x (N, D) in any float dtype; w1, w3 (E, F, D) and w2 (E, D, F) the experts' weights (float32
    masters under autocast: the gradients come back in their dtypes); row_token (P,), offs and kept
    (E,) int32 as the module docstring lays out, P a multiple of ``ALIGN``, every block starting at
    a multiple of it. token_rows (k, N) int64: the row that holds each token's j-th choice, -1
    where it holds none (a dropped choice); x's gradient is the sum of those rows' gradients.
    """
    return _GroupedSwiGLU.apply(x, row_token, offs, kept, token_rows, w1, w3, w2, dtype or w1.dtype)


def grouped_swiglu_reference(x, row_token, offs, w13, w2) -> torch.Tensor:
    """The same rows from torch ops, one expert block at a time (autograd flows through it)."""
    F = w2.shape[2]
    xs = x[row_token.clamp(min=0).long()].to(w13.dtype)
    pieces = []
    for e, (s, t) in enumerate(zip(_block_starts(offs).tolist(), offs.tolist())):
        h = xs[s:t] @ w13[e].t()
        pieces.append((silu(h[:, :F]) * h[:, F:]) @ w2[e].t())
    return torch.where((row_token >= 0)[:, None], torch.cat(pieces), 0)
