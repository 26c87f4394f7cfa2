"""Softmax cross-entropy of a block of logit rows, loss and gradient in one Triton kernel.

`cross_entropy_rows(logits, targets, scale)` is the inner step of the fused LM head
(`fused_linear_cross_entropy`): for each row i of ``logits`` (c, V) it returns the summed loss
Σ_i [scale_i > 0]·(logsumexp(x_i) - x_i[t_i]) and overwrites the row with the gradient
(softmax(x_i) - onehot(t_i))·scale_i, in the logits' dtype. One program per row: a first pass
keeps a running max and sum of exponentials per lane (online softmax), a second pass writes
the gradient, so the row is read twice and written once; what torch.compile makes of the same
math reads each row three times (max, sum, gradient). Rows of at most `_ONE_BLOCK_MAX`
entries are loaded once and kept in registers.

The reference is `fused_linear_cross_entropy._chunk_loss_and_grad_eager`; the GPU tests
compare the two.
"""

from __future__ import annotations

import torch

from scratchlm.kernels.triton_support import tl, triton  # None without triton (CPU-only wheels)

__all__ = ["cross_entropy_rows", "cross_entropy_rows_supported"]

_BLOCK = 4096  # entries per step of the two-pass loop (16 per thread with 8 warps)
_SMALL_BLOCK = 2048  # the same with 4 warps, for rows that 4096-entry steps would pad badly
_ONE_BLOCK_MAX = 4096  # rows up to this length are handled in one block


def _loop_block(V: int) -> tuple[int, int]:
    """(entries per step, warps) of the two-pass loop over rows of V > _ONE_BLOCK_MAX entries.

    The last step of a row is masked, so its padding is work without data: 2048-entry steps
    are taken when they pad the row at least 5% less than 4096-entry ones (V = 10,000: 10,240
    entries instead of 12,288; on an H200, 0.37 against 0.49 ms for 26,843 bf16 rows), else
    4096 (V = 32,000: 0.39 against 0.41 ms for 8,388 rows).
    """
    padded = lambda block: -(-V // block) * block  # noqa: E731
    if padded(_BLOCK) > 1.05 * padded(_SMALL_BLOCK):
        return _SMALL_BLOCK, 4
    return _BLOCK, 8


def cross_entropy_rows_supported(logits: torch.Tensor) -> bool:
    """True when the kernel can run on ``logits``: a CUDA tensor (c, V) in float32, bfloat16 or
    float16 with unit stride along V, triton importable, and not inside a torch.compile trace."""
    return (triton is not None and logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not torch.compiler.is_compiling())


if triton is not None:

    @triton.jit
    def _cross_entropy_rows_kernel(logits_ptr, targets_ptr, scale_ptr, loss_ptr, V, stride_row,
                                   BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        target = tl.load(targets_ptr + row)
        scale = tl.load(scale_ptr + row)
        cols = tl.arange(0, BLOCK)
        if ONE_BLOCK:
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m = tl.max(x, 0)
            e = tl.exp(x - m)
            s = tl.sum(e, 0)
            lse = m + tl.log(s)
            picked = tl.sum(tl.where(cols == target, x, 0.0), 0)
            g = (e / s - tl.where(cols == target, 1.0, 0.0)) * scale
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < V)
        else:
            # V >= BLOCK: the first step fills every lane, so no lane's running max stays -inf.
            m_lane = tl.full([BLOCK], float("-inf"), tl.float32)
            s_lane = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m_lane, x)
                s_lane = s_lane * tl.exp(m_lane - m_new) + tl.exp(x - m_new)
                m_lane = m_new
            m = tl.max(m_lane, 0)
            lse = m + tl.log(tl.sum(s_lane * tl.exp(m_lane - m), 0))
            picked = tl.load(base + target).to(tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + cols
                x = tl.load(base + idx, mask=idx < V, other=0.0).to(tl.float32)
                g = (tl.exp(x - lse) - tl.where(idx == target, 1.0, 0.0)) * scale
                tl.store(base + idx, g.to(logits_ptr.dtype.element_ty), mask=idx < V)
        tl.store(loss_ptr + row, tl.where(scale > 0, lse - picked, 0.0))


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss in float32, gradient): see the module docstring. ``logits`` (c, V) is
    overwritten by the gradient and returned; ``targets`` (c,) integer ids in [0, V) (any id
    on rows of zero scale); ``scale`` (c,) float32, positive on the rows that count (1 / the
    number of counted tokens, for a mean) and 0 on ignored rows."""
    if not cross_entropy_rows_supported(logits):
        raise ValueError("cross_entropy_rows needs triton and a CUDA (c, V) float32/bfloat16/float16 tensor "
                         f"with unit stride along V, got {logits.dtype} {tuple(logits.shape)} on {logits.device}")
    c, V = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    if c == 0:
        return loss.sum(), logits
    one_block = V <= _ONE_BLOCK_MAX
    if one_block:
        block = triton.next_power_of_2(V)
        warps = 8 if block >= 2048 else 4
    else:
        block, warps = _loop_block(V)
    with torch.cuda.device(logits.device):
        _cross_entropy_rows_kernel[(c,)](logits, targets.contiguous(), scale.to(torch.float32).contiguous(), loss,
                                         V, logits.stride(0), BLOCK=block, ONE_BLOCK=one_block, num_warps=warps)
    return loss.sum(), logits
