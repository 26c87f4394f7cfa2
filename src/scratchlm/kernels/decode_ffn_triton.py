"""A pre-norm block's whole SwiGLU feed-forward for a few decode rows as one kernel.

``decode_ffn(x, w13, w2, norm_weight, eps)`` = x + w2(silu(w1 n(x)) · w3 n(x)), n the block's
RMSNorm, with w13 the stacked (2F, D) w1|w3 (`scratchlm.infer.stacked`) and w2 (D, F).

Two `decode_linear` kernels (the gated w1|w3, then w2 plus the residual) cost two launches and
two rounds of first-load latency; at GPT-2-small's shapes each took ~5 us for 3-6 MB of weights
(docs/benchmarks/generate.md). Here the hidden units are split between the programs, as tensor
parallelism splits them between GPUs: program p computes the gated values g of its BLOCK_H hidden
units (RMSNorm, w1|w3 rows and the gate as `decode_linear` computes them) and multiplies them with
the same columns of w2, a (rows, D) float32 share of the output. The shares are then summed
without a second kernel and without waiting: a program that finds (by an atomic counter) that it
is the last of its group of GROUP programs to finish sums the group's shares in program order; the
last group to finish sums the groups' sums in order, rounds the product to w2's dtype, adds the
residual and writes the output. The order of every sum is fixed, so the result does not depend on
which program finishes when: it is the same bit for bit from run to run.

The counters (int32) live in one zeroed buffer per device, allocated by the first call; each
kernel leaves them at zero again. A first call under CUDA graph capture is refused: warm up first
(as a compiled engine and `scratchlm.bench.timing.captured_call_seconds` do).

It is the op ``scratchlm::decode_ffn``; where Triton cannot run it, or where it does not fuse
(`ffn_blocks_for` returns None), it computes the same with `decode_linear` (two kernels) or torch.
"""

from __future__ import annotations

import math

import torch

from scratchlm.kernels.decode_linear_triton import MAX_ROWS, TILE_TERMS, decode_linear, decode_linear_reference
from scratchlm.kernels.triton_support import can_use_triton as _can_use_triton
from scratchlm.kernels.triton_support import device_of as _device
from scratchlm.kernels.triton_support import pdl_launch_options
from scratchlm.kernels.triton_support import register_op as _register
from scratchlm.kernels.triton_support import tl, triton

__all__ = ["FFN_PROGRAMS", "MAX_BLOCK_H", "decode_ffn", "decode_ffn_reference", "ffn_blocks_for", "ffn_group"]

FFN_PROGRAMS = 128  # about this many programs (hidden blocks): one an SM of an H100
MAX_BLOCK_H = 64  # at most this many hidden units a program, else two `decode_linear` kernels

if triton is not None:
    from scratchlm.kernels.decode_linear_triton import _products

    @triton.jit
    def _sum_shares(SRC, first, count, DST, rows, rows_ok, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """DST (BLOCK_M, D) = Σ over i < count, in order, of SRC[first + i] (each (BLOCK_M, D) float32)."""
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            at = rows[:, None] * D + d[None, :]
            ok = rows_ok[:, None] & (d < D)[None, :]
            total = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for i in range(0, count):
                share = SRC + (first + i) * BLOCK_M * D
                total += tl.load(share + at, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(DST + at, total, mask=ok)

    @triton.jit
    def _store_share(share, g, w2, d, rows, rows_ok, D):
        """share[:, d] = g (BLOCK_M, BLOCK_H) times the w2 tile (BLOCK_D, BLOCK_H)ᵀ, in float32."""
        y = tl.sum(g[:, None, :] * w2.to(tl.float32)[None, :, :], axis=2)
        tl.store(share + rows[:, None] * D + d[None, :], y, mask=rows_ok[:, None] & (d < D)[None, :])

    @triton.jit
    def _decode_ffn_kernel(X, W13, W2, G, O, SHARES, COUNTS, M, D, F, stride_xm, stride_w13, stride_w2, stride_om,
                           EPS: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr, GROUP: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_D: tl.constexpr):
        if PDL:  # the next kernel may start now (it waits for this one before reading what it writes)
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        rows = tl.arange(0, BLOCK_M)
        rows_ok = rows < M
        h = pid * BLOCK_H + tl.arange(0, BLOCK_H)  # this program's hidden units
        h_ok = h < F
        x_rows = X + rows[:, None].to(tl.int64) * stride_xm
        w1_rows = W13 + h[:, None].to(tl.int64) * stride_w13
        # w2's first columns h are loaded first, as they do not depend on the gate (with PDL, not
        # on the kernel before either)
        d = tl.arange(0, BLOCK_D)
        w2 = tl.load(W2 + d[:, None].to(tl.int64) * stride_w2 + h[None, :], mask=(d < D)[:, None] & h_ok[None, :],
                     other=0.0)
        gate, up = _products(X, W13, G, x_rows, rows, rows_ok, w1_rows, w1_rows + F * stride_w13, h_ok, D, X, X, X,
                             1, EPS, HAS_NORM, True, False, 1, 1, 1, PDL, BLOCK_M, BLOCK_H, BLOCK_K)
        g = (gate * tl.sigmoid(gate) * up).to(W13.dtype.element_ty).to(tl.float32)  # (BLOCK_M, BLOCK_H)
        # this program's share of the w2 product: g times columns h of w2, (BLOCK_M, D) float32
        share = SHARES + pid * BLOCK_M * D
        _store_share(share, g, w2, d, rows, rows_ok, D)
        for d0 in range(BLOCK_D, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            w2 = tl.load(W2 + d[:, None].to(tl.int64) * stride_w2 + h[None, :],
                         mask=(d < D)[:, None] & h_ok[None, :], other=0.0)
            _store_share(share, g, w2, d, rows, rows_ok, D)
        # The sums. Every thread's stores come before the counter's release (the barrier), and
        # the summing program's loads after its acquire.
        group = pid // GROUP
        first = group * GROUP
        size = tl.minimum(programs - first, GROUP)
        groups = tl.cdiv(programs, GROUP)
        tl.debug_barrier()
        finished = tl.atomic_add(COUNTS + group, 1, sem="acq_rel")
        if finished == size - 1:  # the group's last: its shares' sum goes after every program's share
            tl.debug_barrier()
            tl.store(COUNTS + group, 0)
            sums = SHARES + programs * BLOCK_M * D
            _sum_shares(SHARES, first, size, sums + group * BLOCK_M * D, rows, rows_ok, D,
                        BLOCK_M, BLOCK_D)
            tl.debug_barrier()
            finished = tl.atomic_add(COUNTS + groups, 1, sem="acq_rel")
            if finished == groups - 1:  # the last group: the output
                tl.debug_barrier()
                tl.store(COUNTS + groups, 0)
                for d0 in range(0, D, BLOCK_D):
                    d = d0 + tl.arange(0, BLOCK_D)
                    ok = rows_ok[:, None] & (d < D)[None, :]
                    total = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                    for i in range(0, groups):
                        total += tl.load(sums + i * BLOCK_M * D + rows[:, None] * D + d[None, :],
                                         mask=ok, other=0.0, cache_modifier=".cg")
                    residual = tl.load(x_rows + d[None, :], mask=ok, other=0.0).to(tl.float32)
                    out = residual + total.to(W2.dtype.element_ty).to(tl.float32)
                    tl.store(O + rows[:, None].to(tl.int64) * stride_om + d[None, :], out.to(O.dtype.element_ty),
                             mask=ok)


def decode_ffn_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, norm_weight: torch.Tensor | None,
                         eps: float) -> torch.Tensor:
    """What `decode_ffn` computes, with torch: `decode_linear_reference` with the gate, then with
    the residual."""
    return decode_linear_reference(decode_linear_reference(x, w13, norm_weight, None, eps, True), w2, None, x)


def ffn_blocks_for(rows: int, d_model: int, d_ff: int) -> tuple[int, int, int, int, int, int] | None:
    """(BLOCK_M, BLOCK_H, BLOCK_K, BLOCK_D, GROUP, num_warps) for `rows` rows of a (d_model, d_ff)
    feed-forward, or None where a program would take more than MAX_BLOCK_H hidden units. About
    FFN_PROGRAMS programs, each of the SMs reading its share of the weights at once (~72 KB at
    GPT-2-small's shapes)."""
    block_m = triton.next_power_of_2(max(rows, 1))
    block_h = max(2, triton.next_power_of_2(-(-d_ff // FFN_PROGRAMS)))
    programs = -(-d_ff // block_h)
    if rows > MAX_ROWS or block_h > MAX_BLOCK_H:
        return None
    terms = TILE_TERMS // (block_m * block_h)
    block_k = max(16, min(triton.next_power_of_2(d_model), terms))
    block_d = max(16, min(triton.next_power_of_2(d_model), terms))
    return block_m, block_h, block_k, block_d, ffn_group(programs), 4


def ffn_group(programs: int) -> int:
    """Programs a group of `decode_ffn`'s sums: the power of two at or above √programs, so that
    about as many groups as programs a group are summed, each sum short."""
    return 1 << math.isqrt(programs - 1).bit_length()


_COUNTS: dict[torch.device, torch.Tensor] = {}
_COUNT_SLOTS = 1024


def _counts(device: torch.device) -> torch.Tensor:
    """The device's zeroed int32 counters (module docstring)."""
    counts = _COUNTS.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_ffn: its first call on a device allocates its counters and cannot be "
                               "captured in a CUDA graph; call it once before capturing")
        counts = _COUNTS[device] = torch.zeros(_COUNT_SLOTS, dtype=torch.int32, device=device)
    return counts


def _check(x, w13, w2, norm_weight) -> None:
    d = x.shape[-1] if x.dim() == 2 else -1
    if (x.dim() != 2 or w13.dim() != 2 or w2.dim() != 2 or w13.shape[1] != d or w13.shape[0] % 2
            or w2.shape != (d, w13.shape[0] // 2)):
        raise ValueError(f"decode_ffn: x (M, D), w13 (2F, D), w2 (D, F); got {tuple(x.shape)}, {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    if norm_weight is not None and norm_weight.shape != (d,):
        raise ValueError(f"decode_ffn: norm_weight must be ({d},), got {tuple(norm_weight.shape)}")


def _decode_ffn_impl(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, norm_weight: torch.Tensor | None,
                     eps: float, pdl: bool) -> torch.Tensor:
    _check(x, w13, w2, norm_weight)
    (M, D), F = x.shape, w2.shape[1]
    if not (_can_use_triton(w13) and x.stride(1) == 1 and w13.stride(1) == 1 and w2.stride(1) == 1):
        return decode_ffn_reference(x, w13, w2, norm_weight, eps)
    blocks = ffn_blocks_for(M, D, F)
    if blocks is None:  # too many hidden units a program: two kernels
        gated = decode_linear(x, w13, norm_weight, None, eps, gate_up=True, pdl=pdl)
        return decode_linear(gated, w2, residual=x, pdl=pdl)
    block_m, block_h, block_k, block_d, group, num_warps = blocks
    programs = triton.cdiv(F, block_h)
    counts = _counts(w13.device)
    shares = torch.empty((programs + triton.cdiv(programs, group), block_m, D), dtype=torch.float32,
                         device=w13.device)
    out = torch.empty_like(x)
    g = x if norm_weight is None else norm_weight  # a pointer the kernel does not read without HAS_NORM
    with _device(w13):
        _decode_ffn_kernel[(programs,)](
            x, w13, w2, g, out, shares, counts, M, D, F, x.stride(0), w13.stride(0), w2.stride(0), out.stride(0),
            EPS=float(eps), HAS_NORM=norm_weight is not None, GROUP=group, BLOCK_M=block_m, BLOCK_H=block_h,
            BLOCK_K=block_k, BLOCK_D=block_d, num_warps=num_warps, **pdl_launch_options(pdl, w13))
    return out


def _decode_ffn_fake(x, w13, w2, norm_weight, eps, pdl):
    return torch.empty_like(x)


_decode_ffn_op = _register("scratchlm::decode_ffn", _decode_ffn_impl, _decode_ffn_fake, opaque=True)


def decode_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, norm_weight: torch.Tensor | None = None,
               eps: float = 1e-5, pdl: bool = False) -> torch.Tensor:
    """x (M, D) plus the SwiGLU feed-forward of its RMSNorm (`norm_weight`, or none): w13 the
    stacked (2F, D) w1|w3, w2 (D, F); see the module docstring. Returns (M, D) in x's dtype.
    `pdl` as for `scratchlm.kernels.decode_linear_triton.decode_linear`."""
    return _decode_ffn_op(x, w13, w2, norm_weight, float(eps), bool(pdl))
