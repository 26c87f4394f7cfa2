"""A fused multi-tensor AdamW step in Triton: one kernel launch updates a whole parameter group.

The update is the one of `scratchlm.optim.adamw` (decoupled decay, then the Adam step):

    p ← p · (1 − lr·λ);  m ← m + (1 − β₁)(g − m);  v ← β₂ v + (1 − β₂) g²
    p ← p − (lr / (1 − β₁ᵗ)) · m / (√v / √(1 − β₂ᵗ) + ε)

The multi-tensor `torch._foreach_*` path makes about ten passes over memory per step (one per
op, several tensors each); this kernel reads p, g, m, v once and writes p, m, v once. Every
tensor of the group is cut into tiles of BLOCK elements; program i looks up its tensor and the
tile's start in two small tables, and the four tensors' addresses in a pointer table, so one
launch covers tensors of any sizes. The tile tables depend only on the tensors' sizes and are
cached; the pointer table is rebuilt every step (gradients are new tensors after
`zero_grad(set_to_none=True)`) and copied to the device without a host synchronisation.

Float32 parameters, gradients and states on one CUDA device only; `fused_adamw_supported`
says whether a group qualifies, and `scratchlm.optim.adamw.AdamW` falls back to its foreach
path otherwise.
"""

from __future__ import annotations

import math

import torch

from scratchlm.kernels.triton_support import tl, triton  # None without triton (CPU-only wheels)

__all__ = ["fused_adamw_step", "fused_adamw_supported"]

BLOCK = 2048
_tile_cache: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def fused_adamw_supported(params: list[torch.Tensor]) -> bool:
    """True when triton is importable and every parameter and its gradient is a contiguous
    float32 CUDA tensor on the same device."""
    if triton is None or not params:
        return False
    device = params[0].device
    return device.type == "cuda" and all(
        p.device == device and p.dtype == torch.float32 and p.is_contiguous()
        and p.grad is not None and p.grad.dtype == torch.float32 and p.grad.is_contiguous()
        for p in params)


if triton is not None:

    @triton.jit
    def _adamw_kernel(ptrs, numels, tile_tensor, tile_start, num_tensors,
                      beta1, beta2, eps, decay, step_size, bias_correction2_sqrt,
                      BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        i = tl.load(tile_tensor + pid)
        start = tl.load(tile_start + pid)
        n = tl.load(numels + i)
        p_ptr = tl.load(ptrs + i).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(ptrs + num_tensors + i).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(ptrs + 2 * num_tensors + i).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(ptrs + 3 * num_tensors + i).to(tl.pointer_type(tl.float32))
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        p = p * decay
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * g * g
        denom = tl.sqrt(v) / bias_correction2_sqrt + eps
        p = p - step_size * (m / denom)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def _tiles(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = (device.index or 0, *numels)
    if key not in _tile_cache:
        counts = [math.ceil(n / BLOCK) for n in numels]
        tensor_of_tile = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32),
                                                 torch.tensor(counts))
        start_of_tile = torch.cat([torch.arange(c, dtype=torch.int64) * BLOCK for c in counts])
        _tile_cache[key] = (torch.tensor(numels, dtype=torch.int64, device=device),
                            tensor_of_tile.to(device), start_of_tile.to(device))
    return _tile_cache[key]


def fused_adamw_step(params: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                     *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One AdamW update of `params` (all at optimizer step `step`, counted from 1), in place."""
    device = params[0].device
    numels, tile_tensor, tile_start = _tiles(tuple(p.numel() for p in params), device)
    addresses = [t.data_ptr() for group in (params, [p.grad for p in params], exp_avgs, exp_avg_sqs)
                 for t in group]
    ptrs = torch.tensor(addresses, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    grid = (tile_tensor.numel(),)
    _adamw_kernel[grid](ptrs, numels, tile_tensor, tile_start, len(params),
                        beta1, beta2, eps, 1.0 - lr * weight_decay, lr / (1.0 - beta1**step),
                        math.sqrt(1.0 - beta2**step), BLOCK=BLOCK, num_warps=8)
