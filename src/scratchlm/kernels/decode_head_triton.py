"""A decode step's LM head with the greedy pick folded in: the logits of a few rows and each
row's argmax, in two kernels.

At batch 1 GPT-2-small's LM head reads a 77 MB weight (50,304 x 768 bf16) in 32.4 us with
cuBLAS on an H100, and the greedy argmax over its 50,257 logits is one or two kernels more
(docs/benchmarks/generate.md). Here the first kernel computes BLOCK_N logits a program for all the
M (<= MAX_ROWS) rows with `decode_linear_triton`'s loop (`_products`: RMSNorm folded in, the
product rounded to w's dtype), writes them as float32 and, per row, its block's maximum and the
first index holding it to a small partials buffer (M, programs); the second kernel, one program a
row, reduces those to the row's argmax. What the head writes beyond the logits is 8 bytes a
program and row, so the argmax costs one tiny launch instead of a pass over the logits.

``decode_head(x, w, vocab, norm_weight=None, eps=1e-5, pdl=False) -> (logits, argmax)``: x (M, K),
w (V_pad, K) whose rows from `vocab` on are padding (never read); logits (M, vocab) float32 equal
to ``decode_linear_reference(x, w, norm_weight)[:, :vocab].float()``, argmax (M,) int64 exactly
``logits.argmax(-1)``: the first index of the row's maximum, or of its first NaN where it has one
(torch counts NaN as the largest value).

It is the op ``scratchlm::decode_head``; on tensors Triton cannot run, or past MAX_ROWS rows, it
computes the same with torch (`decode_head_reference`).
"""

from __future__ import annotations

import torch

from scratchlm.kernels.decode_linear_triton import MAX_ROWS, TILE_TERMS, decode_linear_reference
from scratchlm.kernels.triton_support import can_use_triton as _can_use_triton
from scratchlm.kernels.triton_support import device_of as _device
from scratchlm.kernels.triton_support import pdl_launch_options
from scratchlm.kernels.triton_support import register_op as _register
from scratchlm.kernels.triton_support import tl, triton

__all__ = ["decode_head", "decode_head_reference", "head_blocks_for"]

if triton is not None:
    from scratchlm.kernels.decode_linear_triton import _products

    # 2147483647 (int32's largest) stands for "no index" below: past any vocabulary position

    @triton.jit
    def _first_max(values, index, ok, axis: tl.constexpr):
        """(maximum, first index holding it, first index holding a NaN or 2147483647) of `values`
        along `axis` where `ok`, the int32 indices given by `index` (of the same shape)."""
        nan = values != values
        nan_at = tl.min(tl.where(ok & nan, index, 2147483647), axis=axis)
        values = tl.where(ok & ~nan, values, float("-inf"))
        top = tl.max(values, axis=axis)
        if axis == 1:
            hit = values == top[:, None]
        else:
            hit = values == top
        first = tl.min(tl.where(ok & hit, index, 2147483647), axis=axis)
        return top, first, nan_at

    @triton.jit
    def _decode_head_kernel(X, W, G, LOGITS, PV, PI, M, V, K, stride_xm, stride_wn, stride_om, stride_pm,
                            EPS: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One program: logits n of BLOCK_N outputs for every row, then per row its block's
        maximum and first index of it (the first NaN's, stored with a NaN, where there is one)."""
        if PDL:  # the argmax kernel may start now (it waits for this one before reading the partials)
            tl.extra.cuda.gdc_launch_dependents()
        program = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        rows_ok = rows < M
        n = program * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < V  # padding rows of w past the vocabulary are neither read nor counted
        x_rows = X + rows[:, None].to(tl.int64) * stride_xm
        w_rows = W + n[:, None].to(tl.int64) * stride_wn
        logits, _ = _products(X, W, G, x_rows, rows, rows_ok, w_rows, w_rows, n_ok, K, X, X, X, 1, EPS, HAS_NORM,
                              False, False, 1, 1, 1, PDL, BLOCK_M, BLOCK_N, BLOCK_K)
        out_ok = rows_ok[:, None] & n_ok[None, :]
        tl.store(LOGITS + rows[:, None].to(tl.int64) * stride_om + n[None, :], logits, mask=out_ok)
        index = tl.zeros([BLOCK_M, BLOCK_N], tl.int32) + n[None, :]
        top, first, nan_at = _first_max(logits, index, out_ok, 1)
        has_nan = nan_at < 2147483647
        top = tl.where(has_nan, float("nan"), top)
        first = tl.where(has_nan, nan_at, first)
        partial = rows.to(tl.int64) * stride_pm + program
        tl.store(PV + partial, top, mask=rows_ok)
        tl.store(PI + partial, first, mask=rows_ok)

    @triton.jit
    def _argmax_kernel(PV, PI, A, P, stride_pm, PDL: tl.constexpr, BLOCK_P: tl.constexpr):
        """One program a row: the first index of the largest of the row's P partial maxima (of
        its first NaN where one is NaN), int64 into A."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        best = tl.full([], float("-inf"), tl.float32)
        best_at = tl.full([], 2147483647, tl.int32)
        nan_at = tl.full([], 2147483647, tl.int32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            ok = p < P
            values = tl.load(PV + row * stride_pm + p, mask=ok, other=float("-inf"))
            index = tl.load(PI + row * stride_pm + p, mask=ok, other=2147483647)
            top, first, nan_first = _first_max(values, index, ok, 0)
            nan_at = tl.minimum(nan_at, nan_first)
            # chunks come in index order: an equal maximum later on is at a larger index
            take = (top > best) | (best_at == 2147483647)
            best_at = tl.where(take, first, best_at)
            best = tl.where(take, top, best)
        tl.store(A + row, tl.where(nan_at < 2147483647, nan_at, best_at).to(tl.int64))


def decode_head_reference(x: torch.Tensor, w: torch.Tensor, vocab: int, norm_weight: torch.Tensor | None = None,
                          eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """What `decode_head` computes, with torch: the product as `decode_linear_reference`, its
    first `vocab` columns as float32, and their argmax."""
    logits = decode_linear_reference(x, w, norm_weight, None, eps)[:, :vocab].float().contiguous()
    return logits, logits.argmax(dim=-1)


def _check(x, w, vocab, norm_weight) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or not 0 < vocab <= w.shape[0]:
        raise ValueError(f"decode_head: x (M, K), w (V_pad, K) and 0 < vocab <= V_pad; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, vocab {vocab}")
    if norm_weight is not None and norm_weight.shape != (x.shape[1],):
        raise ValueError(f"decode_head: norm_weight must be ({x.shape[1]},), got {tuple(norm_weight.shape)}")


def head_blocks_for(rows: int, vocab: int, inputs: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the head's logits kernel for `rows` rows, a
    vocabulary of `vocab` and `inputs` inputs a row.

    One row of at most 1,024 inputs takes the tiles a sweep found fastest on an H100
    (`benchmarks/decode_linear.py --only-head --sweep`, GPT-2's 50,257 x 768): 32 outputs a
    program and K in three tiles of 256, 2 warps, 31.9 us against 40.0 us for the first guess
    below (16 x 1024, 4 warps). Every other case keeps that guess, not yet swept: a few
    thousand programs over the vocabulary (16 outputs a program up to K = 1024, 8 beyond: 16,032
    programs at Llama-3.2-1B's 128,256 x 2048), each with as much of K in one tile as
    `TILE_TERMS` product terms allow, so that its loads are in flight at once. Fewer outputs a
    program means more partial maxima for the argmax kernel to read (8 bytes each a row)."""
    block_m = triton.next_power_of_2(max(rows, 1))
    if rows == 1 and inputs <= 1024:
        block_n, block_k = min(32, triton.next_power_of_2(vocab)), min(256, max(32, triton.next_power_of_2(inputs)))
        return block_m, block_n, block_k, 2
    block_n = 16 if inputs <= 1024 else 8
    block_n = min(block_n, triton.next_power_of_2(vocab))
    block_k = max(32, min(triton.next_power_of_2(inputs), 2048, TILE_TERMS // (block_m * block_n)))
    num_warps = 8 if block_n * block_k >= 16384 else 4  # (a whole 16 x 1024 tile at 4 warps: 221 registers)
    return block_m, block_n, block_k, num_warps


def _argmax_block(partials: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps) of the argmax kernel: the row's partials in one tile up to 4,096."""
    block_p = min(triton.next_power_of_2(partials), 4096)
    return block_p, 8 if block_p >= 2048 else 4


def _decode_head_impl(x: torch.Tensor, w: torch.Tensor, vocab: int, norm_weight: torch.Tensor | None, eps: float,
                      pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, w, vocab, norm_weight)
    M, K = x.shape
    if not (_can_use_triton(w) and 0 < M <= MAX_ROWS and x.stride(1) == 1 and w.stride(1) == 1):
        return decode_head_reference(x, w, vocab, norm_weight, eps)
    block_m, block_n, block_k, num_warps = head_blocks_for(M, vocab, K)
    programs = triton.cdiv(vocab, block_n)
    logits = torch.empty((M, vocab), dtype=torch.float32, device=w.device)
    part_max = torch.empty((M, programs), dtype=torch.float32, device=w.device)
    part_at = torch.empty((M, programs), dtype=torch.int32, device=w.device)
    argmax = torch.empty((M,), dtype=torch.int64, device=w.device)
    g = x if norm_weight is None else norm_weight  # a pointer the kernel does not read without HAS_NORM
    block_p, argmax_warps = _argmax_block(programs)
    options = pdl_launch_options(pdl, w)
    with _device(w):
        _decode_head_kernel[(programs,)](
            x, w, g, logits, part_max, part_at, M, vocab, K, x.stride(0), w.stride(0), logits.stride(0),
            part_max.stride(0), EPS=float(eps), HAS_NORM=norm_weight is not None, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **options)
        _argmax_kernel[(M,)](part_max, part_at, argmax, programs, part_max.stride(0), BLOCK_P=block_p,
                             num_warps=argmax_warps, **options)
    return logits, argmax


def _decode_head_fake(x, w, vocab, norm_weight, eps, pdl):
    return (torch.empty((x.shape[0], vocab), dtype=torch.float32, device=w.device),
            torch.empty((x.shape[0],), dtype=torch.int64, device=w.device))


_decode_head_op = _register("scratchlm::decode_head", _decode_head_impl, _decode_head_fake, opaque=True)


def decode_head(x: torch.Tensor, w: torch.Tensor, vocab: int, norm_weight: torch.Tensor | None = None,
                eps: float = 1e-5, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, argmax) of (RMSNorm of) x (M, K) times the first `vocab` rows of wᵀ (w (V_pad, K)):
    logits (M, vocab) float32, argmax (M,) int64, as `decode_head_reference`; see the module
    docstring. Rows past MAX_ROWS, or tensors Triton cannot run, take torch's path. `pdl`: launch
    both kernels with programmatic dependent launch where supported
    (`scratchlm.kernels.triton_support.pdl_supported`)."""
    return _decode_head_op(x, w, int(vocab), norm_weight, float(eps), bool(pdl))
