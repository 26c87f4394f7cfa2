"""Gradient clipping by the global L2 norm over all parameters, on one process or sharded.

Every path computes the norm the same way: `grad_norms` gives each gradient tensor's L2 norm
(one multi-tensor kernel), and the global norm is the L2 norm of that vector of norms. A
sharded run (FSDP: each rank holds a slice of some gradients) first turns its per-shard norms
back into per-tensor norms, sqrt(Σ_ranks ‖shard‖²), with one all-reduce, then takes the same
L2 norm of the vector. With one rank the all-reduce is the identity and sqrt(x²) = x holds
exactly in binary floating point, so a world of one gives the single-process norm bit for bit;
with more ranks only the per-tensor sums of squares are split.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch


def grad_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor of `grads`: a (len(grads),) float32 tensor on the first's device."""
    device = grads[0].device
    if all(g.device == device and g.dtype == grads[0].dtype for g in grads):
        norms = torch._foreach_norm(list(grads))  # one multi-tensor kernel instead of one per grad
    else:
        norms = [torch.linalg.vector_norm(g) for g in grads]
    return torch.stack([n.to(device, torch.float32) for n in norms])


def global_grad_norm(grads: Sequence[torch.Tensor], *, sharded: Sequence[bool] | None = None,
                     group=None) -> torch.Tensor:
    """The L2 norm of all of `grads` together, as a 0-d float32 tensor (no host sync).

    `sharded[i]` marks `grads[i]` as this rank's slice of a tensor split across the ranks of
    `group` (every rank passes the same list in the same order): its full norm is assembled
    with one all-reduce of squared norms. Unmarked gradients are replicated: counted once.
    """
    norms = grad_norms(grads)
    if sharded is not None and any(sharded):
        import torch.distributed as dist

        mask = _shard_mask(tuple(sharded), norms.device)
        squares = torch.where(mask, norms * norms, torch.zeros_like(norms))
        dist.all_reduce(squares, group=group)
        norms = torch.where(mask, squares.sqrt(), norms)
    return torch.linalg.vector_norm(norms)


@functools.lru_cache(maxsize=8)
def _shard_mask(sharded: tuple[bool, ...], device: torch.device) -> torch.Tensor:
    # Built once per layout: a host-to-device copy every step would wait for the GPU.
    return torch.tensor(sharded, device=device)


def scale_grads_(grads: Sequence[torch.Tensor], total: torch.Tensor, max_l2_norm: float, eps: float = 1e-6) -> None:
    """Multiply `grads` in place by min(1, max_l2_norm / (total + eps))."""
    scale = torch.clamp(max_l2_norm / (total + eps), max=1.0)
    device = total.device
    if all(g.device == device and g.dtype == torch.float32 for g in grads):
        torch._foreach_mul_(list(grads), scale)  # one multi-tensor kernel, no host sync
    else:
        for g in grads:
            g.mul_(scale.to(device=g.device, dtype=g.dtype))


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_l2_norm: float, eps: float = 1e-6, *,
                   sharded: Sequence[bool] | None = None, group=None) -> torch.Tensor:
    """Scale all gradients in place so that their joint L2 norm is at most `max_l2_norm`.

    The norm is taken over the concatenation of every gradient; when it exceeds the limit each
    gradient is multiplied by `max_l2_norm / (norm + eps)`. Parameters without a gradient are
    ignored. Returns the norm before clipping as a 0-d float32 tensor (no host sync: call
    `.item()` only when logging). `sharded` (one flag per parameter *with* a gradient) and
    `group` are for sharded runs, see `global_grad_norm`.
    """
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = global_grad_norm(grads, sharded=sharded, group=group)
    scale_grads_(grads, total, max_l2_norm, eps)
    return total
