"""Mixture-of-experts feed-forward layer: top-k routing over SwiGLU experts.

A linear router scores each token against ``E`` experts; softmax turns the scores into
probabilities and each token goes to its ``top_k`` most probable experts, weighted by those
probabilities (renormalised to sum to 1 over the chosen ones when ``renormalize``, by default
for top-k > 1; for top-1 the default is the raw probability, as in Switch Transformer, since a
renormalised top-1 gate is always 1 and the router would then learn from the auxiliary losses
alone).
Shared experts, when present, see every token with weight 1.

Dispatch never loops over tokens. The (token, choice) assignments are grouped by expert (a
stable sort, or a running count for the grouped GEMM) so each expert's tokens are one
contiguous block, and each block is one matrix multiply:

- with a capacity factor, every expert takes at most ``C = ceil(capacity_factor · N · k / E)``
  assignments; blocks are padded to ``C`` and all experts run as one batched ``torch.bmm``
  of shape (E, C, ·). ``C`` depends only on the input shape, and dispatch and combine are
  fixed-shape gathers, so this path never synchronises with the host. Assignments beyond an
  expert's capacity are dropped: they add nothing, and a token whose every choice was
  dropped passes through the block by the residual connection alone. First choices have
  priority over second choices, then earlier tokens over later ones (the order of Switch
  Transformer / GShard).
- dropless (``capacity_factor=None``): no assignment is dropped; the experts run one matmul
  each over their contiguous slice (no padding, so skewed routing costs no extra FLOPs; the
  slice sizes cost one host synchronisation per layer).
- grouped GEMM (``gemm="grouped_mm"``; by default on CUDA whenever the experts compute in
  bf16, as under autocast): both modes become two ``torch._grouped_mm`` calls (w1 and w3 as one
  stacked matrix, then w2) over the expert blocks laid end to end, each block padded to a
  multiple of 16 rows (the kernel's alignment) and cut to its capacity when there is one. No
  sort: an assignment's place in its expert's block is its rank among that expert's
  assignments in priority order, a cumulative sum over one-hot (assignment, expert) rows. The
  block offsets stay on the device, so neither mode synchronises with the host, and capacity
  costs only the FLOPs of the kept assignments, not ``E · C`` rows.
- ``gemm="triton"``: the same layout with blocks of multiples of 128 rows, routed and laid out
  by two kernels (`scratchlm.kernels.moe_route_triton`), and scratchlm's grouped GEMM kernels
  (`scratchlm.kernels.moe_triton`) in place of ``torch._grouped_mm``: they gather x's rows as
  they load them and apply SwiGLU, and its backward, in their epilogues.

Every path uses gathers only (no scatter-add in the forward), so results do not depend on
atomics' order.

After each forward ``self.last_aux`` holds the router statistics and the two auxiliary
losses, so the block API stays ``ffn(x) -> y``; ``moe_aux_loss(model, ...)`` adds them up over
a model. ``z_loss`` is ST-MoE's mean squared log-sum-exp of the router logits, which keeps
them small. ``load_balance`` is the Switch Transformer loss

    load_balance = E · Σ_e f_e · P_e,   f_e = (assignments routed to e) / (N · k),
                                        P_e = (1 / N) · Σ_tokens p_e(token),

over the N tokens of the forward, counting assignments before capacity drops. f sums to 1
(normalised by N · k, not N), so the loss is 1 for perfectly uniform routing whatever k is.
transformers' Mixtral/Qwen2-MoE ``load_balancing_loss_func`` normalises the counts by N
alone, so for the same routing it is k times this loss. Its scope is a choice
(``aux_scope``, the config's ``moe_aux_scope``):

- "layer" (default): each layer's loss from its own f and P; ``moe_aux_loss`` sums them over
  the layers (a model of L balanced layers has a loss of L).
- "model": one loss from f and P pooled over every layer's routing, as transformers computes
  it from all layers' router logits: exactly its ``load_balancing_loss_func(...) / k``. A
  layer that favours expert 1 and another that favours expert 2 then balance each other out.

``moe_reference`` is a naive per-expert loop over the same parameters that the tests compare
with.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from scratchlm.errors import UserError
from scratchlm.model.accounting import moe_shape
from scratchlm.model.functional import silu
from scratchlm.model.layers import Linear, SwiGLU


AUX_SCOPES = ("layer", "model")


def _check(num_experts: int, top_k: int, capacity_factor: float | None, num_shared_experts: int,
           aux_scope: str = "layer") -> None:
    if aux_scope not in AUX_SCOPES:
        raise UserError(f"moe: aux_scope must be 'layer' or 'model', got {aux_scope!r}")
    if num_experts < 1:
        raise UserError(f"moe: num_experts must be at least 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise UserError(f"moe: top_k must be between 1 and num_experts ({num_experts}), got {top_k}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise UserError(f"moe: capacity_factor must be positive (or none for dropless), got {capacity_factor}")
    if num_shared_experts < 0:
        raise UserError(f"moe: num_shared_experts must be >= 0, got {num_shared_experts}")


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Assignments each expert accepts: ceil(capacity_factor · tokens · top_k / experts)."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def count_per_expert(expert_ids: Tensor, num_experts: int) -> Tensor:
    """How many entries of ``expert_ids`` (any shape) name each expert: (num_experts,) int64.

    A comparison against every expert id rather than ``bincount``, which syncs with the host
    on CUDA to size its output.
    """
    ids = expert_ids.reshape(-1, 1)
    return (ids == torch.arange(num_experts, device=ids.device)).sum(dim=0)


def _upcast(t: Tensor) -> Tensor:
    """bf16/fp16 -> fp32 (router softmax and log-sum-exp lose too much below fp32); else as is."""
    return t.float() if t.element_size() < 4 else t


def renormalizes(top_k: int, renormalize: bool | None) -> bool:
    """Whether the chosen probabilities are renormalised: ``renormalize``, or when it is None,
    ``top_k > 1`` (a renormalised top-1 gate is always 1)."""
    return top_k > 1 if renormalize is None else bool(renormalize)


def route(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Router logits (N, E) -> (probs (N, E) in at least fp32, gates (N, k), expert ids (N, k))."""
    probs = torch.softmax(_upcast(logits), dim=-1)
    gates, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return probs, gates, experts


def router_stats(logits: Tensor, probs: Tensor, experts: Tensor, dropped: Tensor,
                 counts: Tensor | None = None) -> dict[str, Tensor]:
    """Auxiliary losses and statistics of one routing; logits/probs (N, E), experts (N, k).

    ``dropped``: number of assignments dropped for lack of capacity (a scalar tensor).
    ``counts``: assignments per expert (before capacity) where the caller has them already.
    """
    num_experts = probs.shape[-1]
    counts = count_per_expert(experts.reshape(-1), num_experts) if counts is None else counts
    fraction = counts.to(probs.dtype) / experts.numel()
    mean_prob = probs.mean(dim=0)
    return {
        "load_balance": num_experts * (fraction * mean_prob).sum(),
        "z_loss": torch.logsumexp(_upcast(logits), dim=-1).pow(2).mean(),
        "expert_fraction": fraction,
        "router_prob": mean_prob,
        "dropped_fraction": dropped.to(probs.dtype) / experts.numel(),
        "router_entropy": -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1).mean().detach(),
    }


GROUP_ALIGN = 16  # rows; each expert's block in the grouped GEMM starts at a multiple of this
GEMMS = ("auto", "grouped_mm", "triton", "portable")


def grouped_mm_supported() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (PyTorch 2.8 and later)."""
    return hasattr(torch, "_grouped_mm")


def _swiglu_bmm(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """Batched SwiGLU: x (E, C, D), w1/w3 (E, F, D), w2 (E, D, F) -> (E, C, D)."""
    h = silu(torch.bmm(x, w1.transpose(1, 2))) * torch.bmm(x, w3.transpose(1, 2))
    return torch.bmm(h, w2.transpose(1, 2))


class MoEFFN(nn.Module):
    """Top-k mixture of SwiGLU experts; x: (..., d_model) -> (..., d_model).

    Parameters: ``router`` (a Linear d_model -> num_experts), stacked expert weights ``w1``,
    ``w3`` (E, d_ff, d_model) and ``w2`` (E, d_model, d_ff), and ``shared`` (one SwiGLU of
    width num_shared_experts · d_ff, which equals the sum of that many d_ff-wide experts).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool | None = None,
        num_shared_experts: int = 0,
        capacity_factor: float | None = None,
        gemm: str = "auto",
        aux_scope: str = "layer",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _check(num_experts, top_k, capacity_factor, num_shared_experts, aux_scope)
        if gemm not in GEMMS:
            raise UserError(f"moe: gemm must be one of {', '.join(GEMMS)}, got {gemm!r}")
        # "auto": the grouped GEMM on CUDA when the experts compute in bf16, else the portable
        # matmul/bmm path; "grouped_mm" forces the grouped GEMM (fp32 too; CPU included);
        # "triton" the grouped GEMM of scratchlm's kernels (torch's formula where Triton cannot run).
        self.gemm = gemm
        self.d_model = d_model
        self.d_ff = d_ff
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalizes(top_k, renormalize)
        self.num_shared_experts = num_shared_experts
        self.capacity_factor = capacity_factor
        self.aux_scope = aux_scope  # read by moe_aux_loss
        self.router = Linear(d_model, num_experts, device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(num_experts, d_ff, d_model, device=device, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_ff, d_model, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, d_ff, device=device, dtype=dtype))
        self.shared = (
            SwiGLU(d_model, num_shared_experts * d_ff, device=device, dtype=dtype) if num_shared_experts else None
        )
        self.last_aux: dict[str, Tensor] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The same truncated normal as Linear, per expert matrix.
        std = math.sqrt(2.0 / (self.d_model + self.d_ff))
        for w in (self.w1, self.w3, self.w2):
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"shared={self.num_shared_experts}, capacity_factor={self.capacity_factor}, "
            f"renormalize={self.renormalize}"
        )

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.d_model)  # (N, D)
        N, E, k = x2.shape[0], self.num_experts, self.top_k
        logits = self.router(x2)  # (N, E)
        if self.gemm == "triton":
            return self._triton_forward(x2, logits, shape)
        probs, gates, experts = route(logits, k, self.renormalize)

        # Assignments in priority order: all first choices (token order), then all second ones.
        flat_expert = experts.t().reshape(-1)  # (k·N,)
        flat_gate = gates.t().reshape(-1).to(x.dtype)  # (k·N,)
        if self._use_grouped_mm(x2, logits.dtype):
            out, dropped = self._grouped_experts(x2, flat_expert, flat_gate, logits.dtype)
            return self._finish(out, x2, logits, probs, experts, dropped, shape)
        counts = count_per_expert(flat_expert, E)  # (E,)

        # ys: (A, D) expert output per sorted assignment, zero where dropped. Its dtype is the
        # experts' (bf16 under autocast), not necessarily x's.
        flat_token = torch.arange(N, device=x.device).repeat(k)  # (k·N,)
        A = k * N
        order = torch.sort(flat_expert, stable=True).indices  # sorted position -> assignment
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(A, device=x.device)  # assignment -> sorted position
        if self.capacity_factor is None:
            xs = x2[flat_token[order]]  # (A, D), grouped by expert
            dropped = torch.zeros((), device=x.device, dtype=torch.long)
            # unbind, not w[e]: indexing would give each expert's backward a zero-filled full
            # (E, ·, ·) gradient to add up; unbind's backward is one stack.
            experts_w = zip(self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0))
            pieces = [
                (silu(xe @ w1.t()) * (xe @ w3.t())) @ w2.t()
                for (w1, w3, w2), xe in zip(experts_w, torch.split(xs, counts.tolist()))  # one host sync
            ]
            ys = torch.cat(pieces)
        else:
            # Everything below is gathers of fixed shape: no host sync, no scatter.
            xs = x2[flat_token[order]]  # (A, D), grouped by expert
            C = expert_capacity(N, E, k, self.capacity_factor)
            starts = torch.cumsum(counts, 0) - counts  # (E,) first sorted position of each expert
            c = torch.arange(C, device=x.device)
            source = (starts[:, None] + c).clamp(max=A - 1)  # (E, C) sorted position of each slot
            filled = c < counts[:, None]  # (E, C) false for padding
            buf = torch.where(filled[..., None], xs[source], xs.new_zeros(()))  # (E, C, D)
            ys_buf = _swiglu_bmm(buf, self.w1, self.w3, self.w2).reshape(E * C, self.d_model)
            sorted_expert = flat_expert[order]
            slot = torch.arange(A, device=x.device) - starts[sorted_expert]  # place within its expert
            keep = slot < C
            dropped = (~keep).sum()
            # Dropped assignments read an extra all-zero row.
            rows = torch.where(keep, sorted_expert * C + slot, E * C)
            ys = torch.cat([ys_buf, ys_buf.new_zeros(1, self.d_model)])[rows]
        routed = ys[inverse]  # (A, D) back in priority order

        # Weighted sum over each token's k choices; dropped assignments contribute zero.
        out = (routed * flat_gate[:, None]).view(k, N, self.d_model).sum(dim=0)
        return self._finish(out, x2, logits, probs, experts, dropped, shape)

    def _finish(self, out: Tensor, x2: Tensor, logits: Tensor, probs: Tensor, experts: Tensor, dropped: Tensor,
                shape: torch.Size, counts: Tensor | None = None) -> Tensor:
        if self.shared is not None:
            out = out + self.shared(x2)
        self.last_aux = router_stats(logits, probs, experts, dropped, counts)
        return out.view(shape)

    def _use_grouped_mm(self, x2: Tensor, compute_dtype: torch.dtype) -> bool:
        if self.gemm == "grouped_mm":
            return True
        # The router's logits have the dtype the experts' matmuls will have (bf16 under autocast).
        return (self.gemm == "auto" and x2.is_cuda and compute_dtype == torch.bfloat16 and grouped_mm_supported()
                and self.d_model % 8 == 0 and self.d_ff % 8 == 0)  # 16-byte row strides

    def _grouped_experts(self, x2: Tensor, flat_expert: Tensor, flat_gate: Tensor,
                         dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Routed output (N, D) and dropped count through two grouped GEMMs.

        The assignments are laid out by expert in a buffer of static size (``block_layout``),
        padding rows are zeros. Kept assignments and buffer rows are in one-to-one
        correspondence, so moving rows either way is a gather in the forward *and* in the
        backward (``_Dispatch`` / ``_Combine``): no scatter-add, no atomics.

        Blocks aligned to 16 rows, two ``torch._grouped_mm`` calls (``gemm="triton"`` takes
        `_triton_forward` instead).
        """
        N, E, k = x2.shape[0], self.num_experts, self.top_k
        capacity = None if self.capacity_factor is None else expert_capacity(N, E, k, self.capacity_factor)
        lay = block_layout(flat_expert, E, capacity, GROUP_ALIGN)
        gate = flat_gate * lay.keep  # dropped assignments add nothing
        buf = _Dispatch.apply(x2, lay.assign_of % N, lay.filled, lay.row, lay.keep, k, dtype)  # (P, D)
        w13 = torch.cat([self.w1.to(dtype), self.w3.to(dtype)], dim=1)  # (E, 2F, D)
        h = torch._grouped_mm(buf, w13.transpose(1, 2), offs=lay.offs)  # (P, 2F)
        h1, h3 = h.split(self.d_ff, dim=-1)
        y = torch._grouped_mm(silu(h1) * h3, self.w2.to(dtype).transpose(1, 2), offs=lay.offs)  # (P, D)
        out = _Combine.apply(y, gate, lay.row, lay.assign_of, lay.filled, k)
        return out, flat_expert.numel() - lay.keep.sum()

    def _triton_forward(self, x2: Tensor, logits: Tensor, shape: torch.Size) -> Tensor:
        """``gemm="triton"``: routing and layout in two kernels (`scratchlm.kernels.moe_route_triton`,
        blocks of multiples of 128 rows), then the grouped GEMMs of `scratchlm.kernels.moe_triton`,
        which gather x's rows as they load them and apply SwiGLU, and its backward, in their
        epilogues. Where Triton cannot run, both compute the same with torch."""
        from scratchlm.kernels.moe_route_triton import route_and_layout
        from scratchlm.kernels.moe_triton import ALIGN, grouped_swiglu

        N, E, k = x2.shape[0], self.num_experts, self.top_k
        capacity = None if self.capacity_factor is None else expert_capacity(N, E, k, self.capacity_factor)
        r = route_and_layout(logits, k, self.renormalize, capacity, ALIGN)
        # in the experts' compute dtype: the router's (bf16 under autocast)
        y = grouped_swiglu(x2, r.row_token, r.offs, r.kept, r.token_rows, self.w1, self.w3, self.w2,
                           logits.dtype)  # (P, D)
        gate = r.gates.t().reshape(-1).to(x2.dtype) * r.keep  # (k·N,) priority order; dropped ones add nothing
        A = N * k
        out = _Combine.apply(y, gate, r.row, r.assign_of, r.assign_of < A, k)
        return self._finish(out, x2, logits, r.probs, r.experts, A - r.keep.sum(), shape, counts=r.counts)


class BlockLayout(NamedTuple):
    """Where each (token, choice) assignment sits in the grouped GEMMs' buffer of ``P`` rows."""

    offs: Tensor  # (E,) int32 block ends; the last is P
    kept: Tensor  # (E,) rows each expert holds, at the start of its block
    keep: Tensor  # (A,) bool: the assignment was kept (not dropped for lack of capacity)
    row: Tensor  # (A,) its buffer row (any valid row when dropped)
    assign_of: Tensor  # (P,) the assignment a row holds, A for padding
    filled: Tensor  # (P,) bool: the row holds an assignment


def buffer_rows(num_assignments: int, num_experts: int, align: int) -> int:
    """P: the grouped GEMMs' buffer rows for `num_assignments` in blocks aligned to `align` rows, a
    bound that does not depend on the routing (each block wastes fewer than `align` rows)."""
    return (num_assignments + align - 1) // align * align + num_experts * align


def block_layout(flat_expert: Tensor, num_experts: int, capacity: int | None, align: int) -> BlockLayout:
    """The buffer layout of assignments ``flat_expert`` (A,) (priority order) grouped by expert.

    Assignment ``a`` of expert ``e`` goes to row ``block_start[e] + rank``, where ``rank``
    counts the assignments of ``e`` before ``a`` (a cumulative sum over one-hot rows, no sort);
    those with ``rank >= capacity`` are dropped. Each block starts at a multiple of ``align``
    rows, and ``P`` is a bound of static size (shapes never depend on the routing): the last
    block runs to the end of the buffer, so every row belongs to a block.
    """
    E, A = num_experts, flat_expert.numel()
    device = flat_expert.device
    one_hot = (flat_expert[:, None] == torch.arange(E, device=device)).to(torch.int32)  # (A, E)
    seen = torch.cumsum(one_hot, 0, dtype=torch.int32)  # (A, E) assignments of e up to a
    rank = seen.gather(1, flat_expert[:, None]).squeeze(1) - 1  # (A,) place within its expert
    counts = seen[-1]  # (E,)
    kept = counts if capacity is None else counts.clamp(max=capacity)
    blocks = (kept + align - 1) // align * align
    ends = torch.cumsum(blocks, 0)
    P = buffer_rows(A, E, align)
    offs = torch.cat([ends[:-1], ends.new_full((1,), P)]).to(torch.int32)

    keep = rank < kept[flat_expert]
    row_of = torch.where(keep, (ends - blocks)[flat_expert] + rank, P)  # (A,) buffer row, or P when dropped
    assign_of = torch.full((P + 1,), A, device=device, dtype=row_of.dtype)
    assign_of[row_of] = torch.arange(A, device=device)  # dropped ones all land on the extra entry P
    assign_of = assign_of[:P]
    return BlockLayout(offs, kept, keep, row_of.clamp(max=P - 1), assign_of, assign_of < A)


class _Dispatch(torch.autograd.Function):
    """buf[r] = x[token[r]] (zero where not filled); backward sums each token's k rows back."""

    @staticmethod
    def forward(ctx, x, token, filled, row, keep, k, dtype):
        ctx.save_for_backward(row, keep)
        ctx.k, ctx.x_dtype = k, x.dtype
        return torch.where(filled[:, None], x[token].to(dtype), x.new_zeros((), dtype=dtype))

    @staticmethod
    def backward(ctx, grad_buf):
        row, keep = ctx.saved_tensors
        picked = torch.where(keep[:, None], grad_buf[row], grad_buf.new_zeros(()))  # (A, D)
        grad_x = picked.to(ctx.x_dtype).view(ctx.k, -1, grad_buf.shape[1]).sum(dim=0)
        return grad_x, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    """out[n] = sum_j gate[j·N+n] · y[row[j·N+n]]; every gradient is a gather too."""

    @staticmethod
    def forward(ctx, y, gate, row, assign_of, filled, k):
        ctx.save_for_backward(y, gate, row, assign_of, filled)
        ctx.k = k
        picked = y[row]  # (A, D); dropped ones have gate 0
        return (picked * gate[:, None]).view(k, -1, y.shape[1]).sum(dim=0)

    @staticmethod
    def backward(ctx, grad_out):
        y, gate, row, assign_of, filled = ctx.saved_tensors
        A, N = gate.shape[0], grad_out.shape[0]
        grad_y = grad_gate = None
        if ctx.needs_input_grad[0]:
            a = assign_of.clamp(max=A - 1)
            row_gate = torch.where(filled, gate[a], gate.new_zeros(()))  # (P,)
            grad_y = (grad_out[a % N] * row_gate[:, None]).to(y.dtype)
        if ctx.needs_input_grad[1]:
            picked = y[row].view(ctx.k, N, -1)
            grad_gate = (picked * grad_out).sum(dim=-1).reshape(A).to(gate.dtype)
        return grad_y, grad_gate, None, None, None, None


def moe_reference(module: MoEFFN, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Naive MoE forward with ``module``'s weights: one masked pass per expert, no sorting.

    Capacity uses a running count per expert over the assignments in priority order (a
    cumulative sum of one-hot rows) instead of the sorted slots of ``MoEFFN.forward``'s
    portable paths.
    Returns (y like x, router stats as in ``MoEFFN.last_aux``).
    """
    shape = x.shape
    x2 = x.reshape(-1, module.d_model)
    N, E, k = x2.shape[0], module.num_experts, module.top_k
    logits = x2 @ module.router.weight.t()
    probs, gates, experts = route(logits, k, module.renormalize)
    choice_expert = experts.t()  # (k, N): row j holds every token's j-th choice
    one_hot = torch.nn.functional.one_hot(choice_expert.reshape(-1), E)  # (k·N, E)
    position = (torch.cumsum(one_hot, dim=0) * one_hot).sum(dim=-1).view(k, N) - 1
    if module.capacity_factor is None:
        keep = torch.ones_like(position, dtype=torch.bool)
    else:
        keep = position < expert_capacity(N, E, k, module.capacity_factor)
    out = torch.zeros_like(x2)
    for e in range(E):
        for j in range(k):
            mask = (choice_expert[j] == e) & keep[j]  # (N,)
            h = silu(x2 @ module.w1[e].t()) * (x2 @ module.w3[e].t())
            y = h @ module.w2[e].t()
            out = out + torch.where(mask[:, None], y * gates[:, j, None].to(x.dtype), torch.zeros_like(y))
    if module.shared is not None:
        sw = module.shared
        out = out + (silu(x2 @ sw.w1.weight.t()) * (x2 @ sw.w3.weight.t())) @ sw.w2.weight.t()
    stats = router_stats(logits, probs, experts, (~keep).sum())
    return out.view(shape), stats


def moe_aux_loss(model: nn.Module | list[MoEFFN], load_balance_coef: float, z_loss_coef: float, *,
                 scope: str | None = None) -> Tensor | None:
    """``load_balance_coef · LB + z_loss_coef · Σ_layers z_loss`` of the last forward.

    ``LB`` is ``Σ_layers load_balance`` for scope "layer" and ``model_load_balance(layers)``
    for "model"; ``scope`` defaults to the layers' own ``aux_scope`` (the config's
    ``moe_aux_scope``). ``model`` is a module to search for MoE layers, or the list of them
    (``moe_layers``). None when there is no MoE layer (so dense training adds nothing to its
    graph).
    """
    layers = [m for m in (model if isinstance(model, list) else moe_layers(model)) if m.last_aux]
    if not layers:
        return None
    if scope is None:
        scopes = {m.aux_scope for m in layers}
        if len(scopes) > 1:
            raise ValueError(f"MoE layers disagree on aux_scope: {sorted(scopes)}")
        scope = scopes.pop()
    if scope not in AUX_SCOPES:
        raise ValueError(f"scope must be 'layer' or 'model', got {scope!r}")
    total = load_balance_coef * model_load_balance(layers) if scope == "model" else None
    for module in layers:
        term = z_loss_coef * module.last_aux["z_loss"]
        if scope == "layer":
            term = load_balance_coef * module.last_aux["load_balance"] + term
        total = term if total is None else total + term
    return total


def model_load_balance(layers: list[MoEFFN]) -> Tensor:
    """The load-balancing loss of a whole model's last forward: ``E · Σ_e f_e · P_e`` with f
    (assignments per expert / (L · N · k)) and P (mean router probability) pooled over the L
    layers' routings. Every layer routes the same N tokens, so pooling is the mean of the
    layers' ``expert_fraction`` and ``router_prob``. Equals transformers'
    ``load_balancing_loss_func(all_router_logits, E, k) / k``."""
    fraction = torch.stack([m.last_aux["expert_fraction"] for m in layers]).mean(dim=0)  # (E,)
    prob = torch.stack([m.last_aux["router_prob"] for m in layers]).mean(dim=0)  # (E,)
    return fraction.numel() * (fraction * prob).sum()


def moe_layers(model: nn.Module) -> list[MoEFFN]:
    """The MoE FFNs of ``model`` in module order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoEFFN)]


STAT_NAMES = ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_router_entropy")


def moe_stats(layers: list[MoEFFN]) -> Tensor:
    """Router statistics of the last forward as one detached fp32 vector, without a host sync.

    Layout: the four ``STAT_NAMES`` (load-balance loss, z-loss, dropped-assignment fraction,
    router entropy in nats), each the mean over layers, then every layer's per-expert share of
    the assignments (``num_layers · num_experts`` values, layer-major). Vectors of several
    forwards average elementwise, so a training loop sums them on the device and reads one
    tensor when it logs; ``moe_record`` turns it into named values.
    """
    rows = [m.last_aux for m in layers]
    scalars = torch.stack([
        torch.stack([r["load_balance"] for r in rows]).float().mean(),
        torch.stack([r["z_loss"] for r in rows]).float().mean(),
        torch.stack([r["dropped_fraction"] for r in rows]).float().mean(),
        torch.stack([r["router_entropy"] for r in rows]).float().mean(),
    ])
    return torch.cat([scalars, *(r["expert_fraction"].float() for r in rows)]).detach()


def moe_record(values: list[float], num_experts: int) -> dict[str, object]:
    """Named metrics from a (possibly averaged) ``moe_stats`` vector read to the host.

    ``moe_expert_util`` is per layer: a list of ``num_experts`` shares per MoE layer (each row
    sums to 1; ``1 / num_experts`` everywhere is perfect balance), kept per layer because an
    average over layers can hide layers that each favour a different expert.
    ``moe_max_expert_util`` is the busiest expert's share over all layers.
    """
    record: dict[str, object] = dict(zip(STAT_NAMES, values[: len(STAT_NAMES)]))
    util = values[len(STAT_NAMES):]
    rows = [util[i: i + num_experts] for i in range(0, len(util), num_experts)]
    record["moe_expert_util"] = rows
    record["moe_max_expert_util"] = max(max(r) for r in rows)
    return record


def build_moe_ffn(
    d_model: int,
    d_ff: int,
    *,
    num_experts: int = 8,
    top_k: int = 2,
    capacity_factor: float | None = None,
    shared_experts: int = 0,
    renormalize: bool | None = None,
    gemm: str = "auto",
    aux_scope: str = "layer",
    device=None,
    dtype=None,
) -> MoEFFN:
    """The FFN of a ``ffn="moe"`` TransformerBlock; option names are ModelConfig's ``moe_*``
    fields without the prefix (each expert, routed or shared, is a SwiGLU of width d_ff)."""
    return MoEFFN(
        d_model,
        d_ff,
        num_experts,
        top_k,
        renormalize=renormalize,
        num_shared_experts=shared_experts,
        capacity_factor=capacity_factor,
        gemm=gemm,
        aux_scope=aux_scope,
        device=device,
        dtype=dtype,
    )


def moe_options(cfg: object) -> dict[str, object]:
    """``build_moe_ffn`` keyword options from a ModelConfig's ``moe_*`` fields (defaults if absent)."""
    shape = moe_shape(cfg)
    return {
        "num_experts": shape["num_experts"],
        "top_k": shape["top_k"],
        "capacity_factor": shape["capacity_factor"],
        "shared_experts": shape["shared"],
        "gemm": getattr(cfg, "moe_gemm", "auto"),
        "renormalize": getattr(cfg, "moe_renormalize", None),
        "aux_scope": getattr(cfg, "moe_aux_scope", "layer"),
    }
