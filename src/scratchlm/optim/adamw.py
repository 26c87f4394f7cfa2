"""AdamW with decoupled weight decay (Loshchilov & Hutter, 2019), from tensor primitives.

For each parameter θ with gradient g at step t (counted from 1):

    θ ← θ · (1 − lr · λ)                      decoupled decay, before the Adam update
    m ← β₁ m + (1 − β₁) g
    v ← β₂ v + (1 − β₂) g²
    θ ← θ − lr / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)

This is the order and the placement of ε that `torch.optim.AdamW` uses, so the two agree to
float rounding and their state dicts share a layout (`step`, `exp_avg`, `exp_avg_sq`).

Three code paths compute the same update: `_step_single` is the readable per-parameter loop;
`_step_foreach` does it with `torch._foreach_*` multi-tensor ops (one kernel launch per op for
a whole group instead of one per parameter), used by default when every parameter of a group
lives on the same CUDA device, where launch overhead dominates small parameters; `fused=True`
runs `scratchlm.kernels.adamw_triton`, one Triton kernel per group that reads and writes each
tensor once (float32 parameters on one CUDA device; other groups take the foreach path).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class AdamW(torch.optim.Optimizer):
    """AdamW: Adam with weight decay applied to the weights, not added to the gradient.

    `foreach=None` picks the multi-tensor path on CUDA and the per-parameter loop elsewhere;
    pass True or False to force one. `fused=True` asks for the Triton kernel where a group
    qualifies (see the module docstring); `fused=None` (the default) leaves it off.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if eps < 0.0:
            raise ValueError(f"invalid eps {eps}: must be >= 0")
        if weight_decay < 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}: must be >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=foreach,
                        fused=fused)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one update to every parameter that has a gradient; returns the closure's loss."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            adamw_group_step(group, self.state)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; `step` counters saved as tensors (by torch.optim) become ints."""
        super().load_state_dict(state_dict)
        steps_to_int(self.state)


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """The loss `closure` returns, computed with gradients on (an optimizer's `step` runs under
    no_grad); None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def steps_to_int(states: dict) -> None:
    """`step` counters saved as tensors (by torch.optim) as ints, in place."""
    for state in states.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = int(state["step"].item())


def adamw_group_step(group: dict[str, Any], states: dict) -> None:
    """One AdamW update of the parameters of `group` that have a gradient (state in `states`)."""
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    for p in params:
        if p.grad.is_sparse:
            raise RuntimeError("AdamW does not support sparse gradients")
        state = states[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
    if group.get("fused") and _step_fused(group, params, states):
        return
    use_foreach = group["foreach"]
    if use_foreach is None:
        use_foreach = _same_cuda_device(params)
    (_step_foreach if use_foreach else _step_single)(group, params, states)


def _same_cuda_device(params: list[torch.Tensor]) -> bool:
    device = params[0].device
    return device.type == "cuda" and all(p.device == device for p in params)


def _step_single(group: dict[str, Any], params: list[torch.Tensor], states: dict) -> None:
    """Per-parameter update: the formula of the module docstring, one tensor at a time."""
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    for p in params:
        state = states[p]
        grad, m, v, t = p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        m.lerp_(grad, 1.0 - beta1)  # m = β₁ m + (1 − β₁) g
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias_correction1 = 1.0 - beta1**t
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**t)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bias_correction1)


def _step_fused(group: dict[str, Any], params: list[torch.Tensor], states: dict) -> bool:
    """The update as one Triton kernel; False (nothing done) when the group does not qualify."""
    from scratchlm.kernels.adamw_triton import fused_adamw_step, fused_adamw_supported

    steps = {states[p]["step"] for p in params}
    if len(steps) != 1 or not fused_adamw_supported(params):
        return False
    (beta1, beta2) = group["betas"]
    fused_adamw_step(params, [states[p]["exp_avg"] for p in params], [states[p]["exp_avg_sq"] for p in params],
                     lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"], step=steps.pop())
    return True


def _step_foreach(group: dict[str, Any], params: list[torch.Tensor], states: dict) -> None:
    """The same update as `_step_single`, as multi-tensor ops over the whole group."""
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    grads = [p.grad for p in params]
    ms = [states[p]["exp_avg"] for p in params]
    vs = [states[p]["exp_avg_sq"] for p in params]
    steps = [states[p]["step"] for p in params]  # may differ when some params skipped steps
    if wd != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * wd)
    torch._foreach_lerp_(ms, grads, 1.0 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, grads, grads, value=1.0 - beta2)
    step_sizes = [-lr / (1.0 - beta1**t) for t in steps]
    bias_correction2_sqrt = [math.sqrt(1.0 - beta2**t) for t in steps]
    denoms = torch._foreach_sqrt(vs)
    torch._foreach_div_(denoms, bias_correction2_sqrt)
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, ms, denoms, step_sizes)


def param_groups(
    model: torch.nn.Module, weight_decay: float, *, decay_vectors: bool = False
) -> list[dict[str, Any]]:
    """Split a model's trainable parameters into a decayed and a non-decayed group.

    Matrices (embeddings, projections) are decayed; vectors (RMSNorm gains) are not unless
    `decay_vectors`, the usual choice for Transformers since shrinking a gain towards zero is
    not regularisation. Tied parameters appear once (`named_parameters` deduplicates).
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 or decay_vectors else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
