"""Muon: momentum orthogonalised by Newton-Schulz, for the weight matrices of the blocks.

For a weight matrix W (m, n) with gradient G, at each step:

    B ← μ B + G                                momentum buffer
    U ← G + μ B   (Nesterov; plain: U ← B)
    O ← newton_schulz(U)                       ≈ the orthogonal factor P Qᵀ of U = P Σ Qᵀ
    W ← W · (1 − lr · λ)                       decoupled weight decay, as AdamW's
    W ← W − lr · 0.2 · √max(m, n) · O

Why orthogonalise: the gradient of a weight matrix of a Transformer is dominated by a few
directions; replacing its singular values by 1 makes the step as large in every direction it
has, which trains faster per step and per second at the same tokens (Jordan et al., 2024, the
modded-nanogpt speedrun records).

Scale. O has all its singular values near 1, so its RMS is √(min(m, n) / (m·n)) = 1/√max(m, n).
The factor 0.2·√max(m, n) gives every matrix's update an RMS of 0.2, about what AdamW's updates
have in LM training (Liu et al., 2025, "Muon is scalable for LLM training"). So Muon can reuse
AdamW's learning rate, schedule and weight decay (`optim.muon_lr` defaults to `optim.lr`), and
a matrix's step does not depend on its shape. The other common factor, max(1, m/n)^½, keeps the
update's spectral norm near lr and needs its own, much larger, learning rate (about 0.02), tuned
apart from AdamW's: one more knob for no gain here.

Newton-Schulz: the quintic iteration X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ and
(a, b, c) = (3.4445, −4.7750, 2.0315), from X₀ = U / ‖U‖_F (every singular value ≤ 1). The
coefficients push each singular value in (0, 1] towards 1 as fast as possible rather than
converging exactly: after 5 steps they lie within about [0.7, 1.2] (the very smallest
singular values of a square matrix stay lower). The iteration runs in bfloat16: each step maps
the singular values back into the same band, so rounding does not accumulate; it works on the
transpose of a tall matrix so that A is the smaller Gram matrix.

Cost. The step runs eagerly, outside torch.compile and CUDA graphs (as AdamW's does), so at
small models its price is the number of ops it launches, not their arithmetic. Matrices whose
shapes are equal up to transposition (FFN w1 and w3 (d_ff, d) beside w2 (d, d_ff)) form one
stack, the tall ones transposed; a stack's momentum buffers are one tensor (each parameter's
``momentum_buffer`` in the state is a view of it), so the momentum, the Nesterov step and the
cast to bfloat16 are one op each per orientation, a Newton-Schulz step is three batched
products (`orthogonalise_stack`), and the weight decay is one multi-tensor op for the group. A
Transformer's blocks then cost about 25 ops per distinct shape (two at the usual sizes) rather
than about 50 per shape and orientation (benchmarks/muon_step.py: 52 ops instead of 153 at 17M).

Parameters that are not matrices of the blocks (embeddings, lm_head, RMSNorm gains, MoE expert
stacks) take AdamW steps inside the same optimizer: a group with ``muon=False`` is stepped by
`scratchlm.optim.adamw.adamw_group_step`. One optimizer, one state dict, one `step()`, so the
trainer, the checkpoints and the replicated strategies (DDP: every rank steps the same averaged
gradients) need nothing new. Sharded strategies (ZeRO-1, FSDP) give each rank slices of
matrices, and a slice cannot be orthogonalised alone: the trainer refuses that combination.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from scratchlm.optim.adamw import adamw_group_step, closure_loss, steps_to_int

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2  # the update RMS Muon's steps are scaled to (AdamW's typical one)


def newton_schulz(g: Tensor, steps: int = 5, *, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7) -> Tensor:
    """Approximate orthogonalisation of g (..., m, n): same singular vectors, singular values ≈ 1.

    Runs `steps` quintic iterations in `dtype` (see the module docstring); returns g's dtype.
    Example: newton_schulz(torch.diag(torch.tensor([1e-2, 1.0]))) ≈ diag(0.69, 0.67): a hundredfold
    spread of singular values closed in five steps.
    """
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    rows, cols = x.shape[-2:]
    x = orthogonalise_stack(x.reshape(-1, rows, cols), steps, eps=eps).reshape(x.shape)
    if tall:
        x = x.mT
    return x.to(g.dtype)


def orthogonalise_stack(x: Tensor, steps: int = 5, *, eps: float = 1e-7) -> Tensor:
    """`newton_schulz` of a stack x (k, m, n) with m <= n, in x's dtype: a new (k, m, n) stack.

    Each step is three batched matrix products: A = X·Xᵀ, then B = b·A + c·A·A and
    X ← a·X + B·X as `baddbmm` (the scaled sum rides in the product's epilogue), so a step costs
    three kernel launches rather than eight, whatever the number of matrices.
    """
    a, b, c = NS_COEFFICIENTS
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)  # Frobenius: every singular value <= 1
    for _ in range(steps):
        A = torch.bmm(x, x.mT)  # (k, m, m): the smaller Gram matrix
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        x = torch.baddbmm(x, B, x, beta=a)
    return x


def muon_scale(shape: torch.Size) -> float:
    """0.2 · √max(m, n): the factor that gives an orthogonal (m, n) update an RMS of 0.2."""
    return RMS_MATCH * math.sqrt(max(shape[-2], shape[-1]))


class _Bucket:
    """The matrices of one Muon group that share a Newton-Schulz stack: the wide (m, n) ones with
    m <= n, and the tall (n, m) ones, which join the stack transposed (the orthogonal factor of Uᵀ
    is that of U, transposed, and √max(m, n) is the same). One dtype and one device.

    The momentum buffers are two stacked tensors, one per orientation; each matrix's
    ``state["momentum_buffer"]`` is its slice, a view, so the state dict keeps one buffer per
    parameter (the layout of torch.optim.SGD) while a step updates all of them in one op. A
    buffer that is not its slice's view (from a loaded state dict) is copied into the slice at
    the next step. A step that gives only some matrices a gradient steps those alone (`picks`:
    their indices in `params`; None for all of them).
    """

    def __init__(self, params: list[Tensor], shape: tuple[int, int]) -> None:
        self.shape = shape
        self.scale = muon_scale(torch.Size(shape))
        self.wide = [p for p in params if p.size(0) <= p.size(1)]
        self.tall = [p for p in params if p.size(0) > p.size(1)]
        self.params = self.wide + self.tall
        self.buffers = [torch.zeros((len(ps), *ps[0].shape), dtype=ps[0].dtype, device=ps[0].device) if ps else None
                        for ps in (self.wide, self.tall)]
        self.views = [buf[i] for buf in self.buffers if buf is not None for i in range(buf.size(0))]

    def picks(self, states: dict) -> list[int] | None:
        """The matrices with a gradient (None: all), after making every buffer its slice's view
        (a matrix's first step starts from a zero buffer)."""
        picks, every = [], True
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            state = states.get(p)
            buf = None if state is None else state.get("momentum_buffer")
            if buf is not view:
                if buf is not None:
                    view.copy_(buf)  # a loaded buffer
                elif p.grad is not None:
                    view.zero_()  # this matrix's first step
                if buf is not None or p.grad is not None:
                    states[p]["momentum_buffer"] = view
            if p.grad is None:
                every = False
            else:
                picks.append(i)
        return None if every else picks

    def stepped(self, picks: list[int] | None) -> list[Tensor]:
        return self.params if picks is None else [self.params[i] for i in picks]

    def momentum_stack(self, picks: list[int] | None, mu: float, nesterov: bool, dtype: torch.dtype) -> Tensor:
        """B ← μ B + G for the stepped matrices, and their U (Nesterov: G + μ B; plain: B) as one
        (k, m, n) stack in `dtype`, the wide ones first: the input of `orthogonalise_stack`."""
        k = len(self.params) if picks is None else len(picks)
        device = self.params[0].device
        stack = torch.empty((k, *self.shape), dtype=dtype, device=device)
        start = 0
        for tall, offset, ps, buf in ((False, 0, self.wide, self.buffers[0]),
                                      (True, len(self.wide), self.tall, self.buffers[1])):
            index = None if picks is None else [i - offset for i in picks if offset <= i < offset + len(ps)]
            if not ps or (index is not None and not index):
                continue
            grads = torch.stack([p.grad for p in ps] if index is None else [ps[i].grad for i in index])
            if index is None:
                torch.add(grads, buf, alpha=mu, out=buf)  # B ← μ B + G
                moment = buf
            else:
                index = torch.tensor(index, device=device)
                moment = torch.add(grads, buf[index], alpha=mu)
                buf[index] = moment
            out = stack[start:start + len(grads)]
            out = out.mT if tall else out
            if nesterov:
                torch.add(grads, moment, alpha=mu, out=out)  # U = G + μ B, cast to `dtype` as it is written
            else:
                out.copy_(moment)
            start += len(grads)
        return stack

    def apply(self, picks: list[int] | None, ortho: Tensor, alpha: float) -> None:
        """W ← W + alpha · O for the stepped matrices (the tall ones' slices transposed back)."""
        stepped = self.stepped(picks)
        n_wide = len(self.wide) if picks is None else sum(i < len(self.wide) for i in picks)
        for params, part in ((stepped[:n_wide], ortho[:n_wide]), (stepped[n_wide:], ortho[n_wide:].mT)):
            if params:
                # one copy to the parameters' dtype and layout, so the multi-tensor add stays one op
                part = part.to(dtype=params[0].dtype, memory_format=torch.contiguous_format)
                torch._foreach_add_(params, list(part.unbind(0)), alpha=alpha)


class Muon(torch.optim.Optimizer):
    """Muon for the groups with ``muon=True`` (2-D parameters), AdamW for the others.

    Group keys: ``lr``, ``weight_decay`` (decoupled, both kinds), ``momentum`` and ``nesterov``
    (Muon), ``betas`` and ``eps`` (AdamW), ``ns_steps``, and ``muon`` (default True). `ns_dtype`
    is the Newton-Schulz precision (bfloat16; float32 for reference tests). Build the groups of
    a Transformer with `muon_param_groups`.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.95,
        *,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        foreach: bool | None = None,
        fused: bool | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}: must be >= 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum {momentum}: must be in [0, 1)")
        if ns_steps < 1:
            raise ValueError(f"invalid ns_steps {ns_steps}: must be >= 1")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}: must be >= 0")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay,
                        betas=tuple(betas), eps=eps, foreach=foreach, fused=fused, muon=True)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self._plans: dict[int, tuple[dict, list[Tensor], list[_Bucket]]] = {}
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon orthogonalises matrices: put parameters that are not 2-D in a group "
                                 "with muon=False (AdamW)")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter with a gradient; returns the closure's loss."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group_step(group)
            else:
                adamw_group_step(group, self.state)
        return loss

    def _muon_group_step(self, group: dict[str, Any]) -> None:
        lr, wd, mu, nesterov = group["lr"], group["weight_decay"], group["momentum"], group["nesterov"]
        # Matrices of one shape, or of its transpose, are orthogonalised together as one stack (see
        # `_Bucket`): a Transformer has a handful of shapes, so a step is a few batched Newton-Schulz
        # runs, each a fixed number of ops however many matrices it holds.
        runs = []
        for bucket in self._buckets(group):
            picks = bucket.picks(self.state)
            if picks is None or picks:
                runs.append((bucket, picks, bucket.momentum_stack(picks, mu, nesterov, self.ns_dtype)))
        if not runs:
            return
        if wd != 0.0:  # one multi-tensor op for every stepped matrix of the group
            torch._foreach_mul_([p for bucket, picks, _ in runs for p in bucket.stepped(picks)], 1.0 - lr * wd)
        for bucket, picks, stack in runs:
            bucket.apply(picks, orthogonalise_stack(stack, group["ns_steps"]), -lr * bucket.scale)

    def _buckets(self, group: dict[str, Any]) -> list[_Bucket]:
        """The group's `_Bucket`s, built at its first step and again only when its parameters change."""
        params = group["params"]
        cached = self._plans.get(id(group))
        if cached is not None and cached[0] is group and len(cached[1]) == len(params) \
                and all(a is b for a, b in zip(cached[1], params)):
            return cached[2]
        keyed: dict[tuple, list[Tensor]] = {}
        for p in params:
            rows, cols = sorted(p.shape)
            keyed.setdefault(((rows, cols), p.dtype, p.device), []).append(p)
        buckets = [_Bucket(ps, shape) for (shape, _, _), ps in keyed.items()]
        self._plans[id(group)] = (group, list(params), buckets)
        return buckets

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._plans: dict[int, tuple[dict, list[Tensor], list[_Bucket]]] = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; AdamW `step` counters saved as tensors become ints."""
        super().load_state_dict(state_dict)
        steps_to_int(self.state)


def is_muon_param(name: str, p: Tensor) -> bool:
    """Whether Muon steps this parameter of a TransformerLM: a matrix inside the blocks.

    Embeddings and lm_head are left to AdamW (a lookup table and a classifier, whose rows are
    not one linear map's directions), and so are vectors and the 3-D expert stacks of MoE.
    """
    return name.startswith("layers.") and p.ndim == 2


def muon_param_groups(model: nn.Module, weight_decay: float, *, lr: float, muon_lr: float | None = None,
                      decay_vectors: bool = False) -> list[dict[str, Any]]:
    """Groups for `Muon`: the blocks' matrices (Muon, at `muon_lr`), then AdamW's decayed and
    non-decayed groups for the rest (matrices decayed; vectors only with `decay_vectors`).

    The Muon group carries ``lr_scale = muon_lr / lr``: the trainer sets each group's rate to the
    scheduled one times its ``lr_scale``, so both follow the same schedule.
    """
    muon_lr = lr if muon_lr is None else muon_lr
    matrices, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_muon_param(name, p):
            matrices.append(p)
        else:
            (decay if p.ndim >= 2 or decay_vectors else no_decay).append(p)
    scale = muon_lr / lr if lr > 0 else 0.0
    groups = [{"params": matrices, "muon": True, "weight_decay": weight_decay, "lr": muon_lr, "lr_scale": scale},
              {"params": decay, "muon": False, "weight_decay": weight_decay},
              {"params": no_decay, "muon": False, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
