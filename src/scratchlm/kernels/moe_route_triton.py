"""A mixture-of-experts layer's routing and buffer layout in two kernels.

``route_and_layout(logits, top_k, renormalize, capacity, align)`` does what
`scratchlm.model.moe.route` and `scratchlm.model.moe.block_layout` do in torch ops (about fifteen
small kernels in a compiled step: softmax, top-k, the one-hot running counts, the block
arithmetic, the scatter of rows), for the layout of `scratchlm.kernels.moe_triton`:

- route: each program takes BLOCK_T tokens' logits, computes the softmax in float32, picks the
  top_k experts (the largest probability first, the lower expert on a tie), renormalises the
  chosen probabilities when asked, and counts how many of its tokens each choice sends to each
  expert.
- layout: with those counts summed in priority order (every first choice in token order, then
  every second choice, ...), each program places its tokens' j-th choices: an assignment's rank
  is the count of earlier assignments of its expert, it is kept when the rank is below the
  expert's capacity, and its row is its expert's block start plus the rank. Block starts come
  from the totals, each block rounded up to ``align`` rows, the last running to the end of the
  buffer of ``P = ceil(A / align) · align + E · align`` rows (A = N · top_k).

The probabilities and gates keep their gradient: the backward is torch's (softmax's backward
through the gathered, renormalised gates). On tensors Triton cannot run, the same comes from the
torch functions; the two agree except on exact ties between probabilities, which torch.topk
orders its own way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from scratchlm.kernels.triton_support import can_use_triton as _can_use_triton
from scratchlm.kernels.triton_support import device_of as _device
from scratchlm.kernels.triton_support import register_op as _register
from scratchlm.kernels.triton_support import tl, triton, wrap_triton
from scratchlm.model.moe import block_layout, buffer_rows, count_per_expert, route

__all__ = ["Routing", "route_and_layout"]

BLOCK_T = 128  # tokens a program routes

if triton is not None:

    @triton.jit
    def _route_kernel(LOGITS, PROBS, GATES, EXPERTS, COUNTS, N, NUM_BLOCKS, stride_l, NUM_EXPERTS: tl.constexpr,
                      E_POW2: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr,
                      BLOCK_T: tl.constexpr):
        pid = tl.program_id(0)
        tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, E_POW2)
        t_ok = tokens < N
        e_ok = experts < NUM_EXPERTS
        ok = t_ok[:, None] & e_ok[None, :]
        logits = tl.load(LOGITS + tokens[:, None].to(tl.int64) * stride_l + experts[None, :], mask=ok,
                         other=float("-inf")).to(tl.float32)
        logits = tl.where(e_ok[None, :], logits, float("-inf"))
        top = tl.max(logits, axis=1)
        top = tl.where(t_ok, top, 0.0)
        ex = tl.exp(logits - top[:, None])
        probs = ex / tl.sum(ex, axis=1)[:, None]
        tl.store(PROBS + tokens[:, None].to(tl.int64) * NUM_EXPERTS + experts[None, :], probs, mask=ok)
        left = tl.where(e_ok[None, :], probs, -1.0)
        slots = tl.arange(0, K_POW2)
        gates = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
        picks = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(left, axis=1)
            # the lowest expert holding the maximum
            pick = tl.min(tl.where(left == best[:, None], experts[None, :], E_POW2), axis=1)
            gates = tl.where(slots[None, :] == j, best[:, None], gates)
            picks = tl.where(slots[None, :] == j, pick[:, None], picks)
            chosen = (experts[None, :] == pick[:, None]) & t_ok[:, None]
            tl.store(COUNTS + (j * NUM_BLOCKS + pid) * E_POW2 + experts, tl.sum(chosen.to(tl.int32), axis=0))
            left = tl.where(experts[None, :] == pick[:, None], -1.0, left)
        if RENORMALIZE:
            gates = gates / tl.sum(gates, axis=1)[:, None]
        out = tokens[:, None].to(tl.int64) * TOP_K + slots[None, :]
        out_ok = t_ok[:, None] & (slots[None, :] < TOP_K)
        tl.store(GATES + out, gates, mask=out_ok)
        tl.store(EXPERTS + out, picks.to(tl.int64), mask=out_ok)

    @triton.jit
    def _layout_kernel(EXPERTS, BEFORE, TOTALS, OFFS, KEPT, KEEP, ROW, TOKEN_ROWS, ASSIGN_OF, ROW_TOKEN, N, NUM_BLOCKS,
                       P, CAPACITY, ALIGN, NUM_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, TOP_K: tl.constexpr,
                       BLOCK_T: tl.constexpr):
        pid = tl.program_id(0)
        j = tl.program_id(1)
        experts = tl.arange(0, E_POW2)
        e_ok = experts < NUM_EXPERTS
        totals = tl.load(TOTALS + experts, mask=e_ok, other=0)
        kept = tl.where(CAPACITY >= 0, tl.minimum(totals, CAPACITY), totals)
        blocks = (kept + ALIGN - 1) // ALIGN * ALIGN
        ends = tl.cumsum(blocks, axis=0)
        starts = ends - blocks
        if (pid == 0) & (j == 0):
            tl.store(OFFS + experts, tl.where(experts == NUM_EXPERTS - 1, P, ends).to(tl.int32), mask=e_ok)
            tl.store(KEPT + experts, kept, mask=e_ok)

        tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = tokens < N
        pick = tl.load(EXPERTS + tokens.to(tl.int64) * TOP_K + j, mask=t_ok, other=0)
        one_hot = ((experts[None, :] == pick[:, None]) & t_ok[:, None]).to(tl.int32)  # (BLOCK_T, E_POW2)
        earlier = tl.cumsum(one_hot, axis=0) - one_hot  # this block's assignments of each expert before each token
        before = tl.load(BEFORE + (j * NUM_BLOCKS + pid) * E_POW2 + experts)  # earlier blocks' and choices'
        rank = tl.sum(one_hot * (earlier + before[None, :]), axis=1)
        mine = one_hot.to(tl.int1)
        limit = tl.sum(tl.where(mine, kept[None, :], 0), axis=1)
        start = tl.sum(tl.where(mine, starts[None, :], 0), axis=1)
        keep = (rank < limit) & t_ok
        row = start + rank
        a = (j * N + tokens).to(tl.int64)
        tl.store(KEEP + a, keep, mask=t_ok)
        tl.store(ROW + a, tl.where(keep, row, P - 1).to(tl.int64), mask=t_ok)
        tl.store(TOKEN_ROWS + a, tl.where(keep, row, -1).to(tl.int64), mask=t_ok)
        tl.store(ASSIGN_OF + row.to(tl.int64), a, mask=keep)
        tl.store(ROW_TOKEN + row.to(tl.int64), tokens.to(tl.int32), mask=keep)


class Routing(NamedTuple):
    """What `route_and_layout` returns. A = N · top_k assignments in priority order (choice j of
    token n is assignment j · N + n); P rows of the grouped GEMMs' buffer."""

    probs: Tensor  # (N, E) softmax of the logits in float32 (float64 logits: float64), with its gradient
    gates: Tensor  # (N, k) weight of each choice, as probs, with its gradient
    experts: Tensor  # (N, k) int64 the chosen experts, most probable first
    counts: Tensor  # (E,) assignments each expert was chosen for, before capacity
    offs: Tensor  # (E,) int32 block ends; the last is P
    kept: Tensor  # (E,) rows each expert holds
    keep: Tensor  # (A,) bool: kept (not dropped for lack of capacity)
    row: Tensor  # (A,) its buffer row (P - 1 when dropped)
    token_rows: Tensor  # (k, N) the row of each choice, -1 when dropped
    assign_of: Tensor  # (P,) the assignment a row holds, A for padding
    row_token: Tensor  # (P,) int32 the token a row holds, -1 for padding


def _prob_dtype(logits: Tensor) -> torch.dtype:
    """Probabilities and gates: float32, or float64 for float64 logits (as `scratchlm.model.moe.route`)."""
    return torch.promote_types(logits.dtype, torch.float32)


def _torch_route(logits: Tensor, top_k: int, renormalize: bool, capacity: int, align: int) -> list[Tensor]:
    N, E = logits.shape
    probs, gates, experts = route(logits, top_k, renormalize)
    flat_expert = experts.t().reshape(-1)
    lay = block_layout(flat_expert, E, None if capacity < 0 else capacity, align)
    A = N * top_k
    token_rows = torch.where(lay.keep, lay.row, -1).view(top_k, N)
    row_token = torch.where(lay.filled, lay.assign_of % N, -1).to(torch.int32)
    return [probs, gates, experts, count_per_expert(flat_expert, E), lay.offs, lay.kept, lay.keep,
            lay.row, token_rows, lay.assign_of.clamp(max=A), row_token]


def _route_impl(logits: Tensor, top_k: int, renormalize: bool, capacity: int, align: int) -> list[Tensor]:
    """The routing and layout (see `Routing`); capacity -1 for dropless."""
    if not _can_use_triton(logits) or logits.dtype == torch.float64:
        with torch.no_grad():
            return [t.detach() for t in _torch_route(logits, top_k, renormalize, capacity, align)]
    N, E = logits.shape
    A = N * top_k
    P = buffer_rows(A, E, align)
    e_pow2 = triton.next_power_of_2(E)
    num_blocks = triton.cdiv(N, BLOCK_T)
    dev = logits.device
    probs = torch.empty((N, E), device=dev, dtype=torch.float32)
    gates = torch.empty((N, top_k), device=dev, dtype=torch.float32)
    experts = torch.empty((N, top_k), device=dev, dtype=torch.int64)
    counts = torch.empty((top_k * num_blocks, e_pow2), device=dev, dtype=torch.int32)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    flags = dict(NUM_EXPERTS=E, E_POW2=e_pow2, TOP_K=top_k, BLOCK_T=BLOCK_T)
    with _device(logits):
        wrap_triton(_route_kernel)[(num_blocks,)](logits, probs, gates, experts, counts, N, num_blocks,
                                                   logits.stride(0), K_POW2=triton.next_power_of_2(top_k),
                                                   RENORMALIZE=renormalize, **flags)
    before = torch.cumsum(counts, dim=0, dtype=torch.int32) - counts  # exclusive, in priority order
    totals = counts.sum(dim=0, dtype=torch.int32)
    offs = torch.empty((E,), device=dev, dtype=torch.int32)
    kept = torch.empty((E,), device=dev, dtype=torch.int32)
    keep = torch.empty((A,), device=dev, dtype=torch.bool)
    row = torch.empty((A,), device=dev, dtype=torch.int64)
    token_rows = torch.empty((top_k, N), device=dev, dtype=torch.int64)
    assign_of = torch.full((P,), A, device=dev, dtype=torch.int64)
    row_token = torch.full((P,), -1, device=dev, dtype=torch.int32)
    with _device(logits):
        wrap_triton(_layout_kernel)[(num_blocks, top_k)](experts, before, totals, offs, kept, keep, row, token_rows,
                                                          assign_of, row_token, N, num_blocks, P, capacity, align,
                                                          **flags)
    return [probs, gates, experts, totals[:E].to(torch.int64), offs, kept, keep, row, token_rows, assign_of,
            row_token]


def _route_fake(logits, top_k, renormalize, capacity, align):
    N, E = logits.shape
    A = N * top_k
    P = buffer_rows(A, E, align)
    new = logits.new_empty
    fp = _prob_dtype(logits)
    return [new((N, E), dtype=fp), new((N, top_k), dtype=fp),
            new((N, top_k), dtype=torch.int64), new((E,), dtype=torch.int64), new((E,), dtype=torch.int32),
            new((E,), dtype=torch.int32), new((A,), dtype=torch.bool), new((A,), dtype=torch.int64),
            new((top_k, N), dtype=torch.int64), new((P,), dtype=torch.int64), new((P,), dtype=torch.int32)]


route_op = _register("scratchlm::moe_route", _route_impl, _route_fake)


class _Route(torch.autograd.Function):
    """probs and gates from the op, their gradient to the logits from torch's formulas."""

    @staticmethod
    def forward(ctx, logits, top_k, renormalize, capacity, align):
        out = route_op(logits, top_k, renormalize, capacity, align)
        probs, gates, experts = out[0], out[1], out[2]
        ctx.save_for_backward(probs, gates, experts)
        ctx.renormalize, ctx.logits_dtype = renormalize, logits.dtype
        ctx.mark_non_differentiable(*out[2:])
        return tuple(out)

    @staticmethod
    def backward(ctx, grad_probs, grad_gates, *_):
        probs, gates, experts = ctx.saved_tensors
        grad_p = torch.zeros_like(probs) if grad_probs is None else grad_probs.to(probs.dtype)
        if grad_gates is not None:
            grad_gates = grad_gates.to(probs.dtype)
            if ctx.renormalize:
                # gate_i = p_i / S over the chosen: dL/dp_i = (dL/dg_i - Σ_j dL/dg_j g_j) / S
                chosen = probs.gather(1, experts)
                total = chosen.sum(dim=1, keepdim=True)
                grad_gates = (grad_gates - (grad_gates * gates).sum(dim=1, keepdim=True)) / total
            grad_p = grad_p.scatter_add(1, experts, grad_gates)
        grad_logits = probs * (grad_p - (grad_p * probs).sum(dim=1, keepdim=True))
        return grad_logits.to(ctx.logits_dtype), None, None, None, None


def route_and_layout(logits: Tensor, top_k: int, renormalize: bool, capacity: int | None, align: int) -> Routing:
    """Routing of logits (N, E) to top_k experts and the buffer layout of the assignments; see
    `Routing`. capacity: the most assignments an expert keeps (None: dropless)."""
    out = _Route.apply(logits, top_k, renormalize, -1 if capacity is None else capacity, align)
    return Routing(*out)
