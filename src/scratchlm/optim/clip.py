"""Gradient clipping by the global L2 norm over all parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_l2_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients in place so that their joint L2 norm is at most `max_l2_norm`.

    The norm is taken over the concatenation of every gradient; when it exceeds the limit each
    gradient is multiplied by `max_l2_norm / (norm + eps)`. Parameters without a gradient are
    ignored. Returns the norm before clipping as a 0-d float32 tensor (no host sync: call
    `.item()` only when logging).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    grads = [g.detach() for g in grads]
    device = grads[0].device
    if all(g.device == device and g.dtype == grads[0].dtype for g in grads):
        norms = torch._foreach_norm(grads)  # one multi-tensor kernel instead of one per grad
    else:
        norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack([n.to(device, torch.float32) for n in norms]))
    scale = torch.clamp(max_l2_norm / (total + eps), max=1.0)
    if all(g.device == device and g.dtype == torch.float32 for g in grads):
        torch._foreach_mul_(grads, scale)  # one multi-tensor kernel, no host sync
    else:
        for g in grads:
            g.mul_(scale.to(device=g.device, dtype=g.dtype))
    return total
