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

from scratchlm.optim.adamw import adamw_group_step, steps_to_int

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2  # the update RMS Muon's steps are scaled to (AdamW's typical one)


def newton_schulz(g: Tensor, steps: int = 5, *, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7) -> Tensor:
    """Approximate orthogonalisation of g (..., m, n): same singular vectors, singular values ≈ 1.

    Runs `steps` quintic iterations in `dtype` (see the module docstring); returns g's dtype.
    Example: newton_schulz(torch.diag(torch.tensor([1e-2, 1.0]))) ≈ diag(0.69, 0.67): a hundredfold
    spread of singular values closed in five steps.
    """
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)  # Frobenius: every singular value <= 1
    for _ in range(steps):
        A = x @ x.mT  # (..., min, min)
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def muon_scale(shape: torch.Size) -> float:
    """0.2 · √max(m, n): the factor that gives an orthogonal (m, n) update an RMS of 0.2."""
    return RMS_MATCH * math.sqrt(max(shape[-2], shape[-1]))


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
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon orthogonalises matrices: put parameters that are not 2-D in a group "
                                 "with muon=False (AdamW)")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter with a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group_step(group)
            else:
                adamw_group_step(group, self.state)
        return loss

    def _muon_group_step(self, group: dict[str, Any]) -> None:
        # Matrices of one shape are orthogonalised together, as one stack: a 12-layer model has a
        # handful of shapes, so a step is a few batched Newton-Schulz runs rather than one per matrix.
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        by_shape: dict[tuple, list[Tensor]] = {}
        for p in group["params"]:
            if p.grad is not None:
                by_shape.setdefault((p.shape, p.dtype, p.device), []).append(p)
        for (shape, dtype, _), params in by_shape.items():
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            torch._foreach_mul_(bufs, mu)
            torch._foreach_add_(bufs, grads)
            updates = torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs
            ortho = newton_schulz(torch.stack(updates), group["ns_steps"], dtype=self.ns_dtype).to(dtype)
            if wd != 0.0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            torch._foreach_add_(params, list(ortho.unbind(0)), alpha=-lr * muon_scale(shape))

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
