"""RoPE on the q and k blocks of concatenated projections, in one Triton pass.

``rope_qk(qkv, cos, sin, num_heads)`` takes qkv (B, T, 3·H·d) = q | k | v (each block head-major,
as ``flash_attention_qkv`` takes it) and returns q | k rotated, (B, T, 2·H·d), contiguous: the
rotation of ``scratchlm.model.rope.apply_rope`` (interleaved pairs, float32 arithmetic, rounded
once to qkv's dtype), with cos/sin (T, d/2) shared by the batch or (B, T, d/2) per sequence.

The kernel (bfloat16; other dtypes take the torch formula) loads and stores each pair of q and
k as one 32-bit word. On an H200 at GPT-2-small size it moves its 200 MB in 55 us (3.6 TB/s,
three quarters of the memory bandwidth) where Inductor's kernel for the same torch ops took
100 us (docs/benchmarks/train_step.md).

It is the op ``scratchlm::rope_qk`` (a triton_op where torch has it: Inductor launches the
kernel itself); it has no autograd formula of its own, being used inside
``flash_attention_qkv``'s forward, whose backward undoes RoPE in the attention kernels. On
tensors Triton cannot run it computes ``apply_rope`` with torch ops.
"""

from __future__ import annotations

import torch

from scratchlm.kernels.triton_support import can_use_triton, device_of, register_op, tl, triton, wrap_triton
from scratchlm.model.rope import apply_rope

__all__ = ["rope_qk"]

if triton is not None:

    @triton.jit
    def _rope_qk_bf16_kernel(QKV, COS, SIN, OUT, n_rows, T, stride_row, stride_cb, stride_ct,
                             PAIRS: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_P: tl.constexpr):
        # Program (r, p): BLOCK_R tokens (rows of the flattened (B, T)) x BLOCK_P of the PAIRS = H·d
        # pairs of q | k. A bf16 pair is one 32-bit word (the even element in its low half), so
        # each pair is loaded and stored whole, in plain contiguous rows: no register shuffles.
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        pairs = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        mask = (rows < n_rows)[:, None] & (pairs < PAIRS)[None, :]
        rows64 = rows.to(tl.int64)
        src = QKV.to(tl.pointer_type(tl.int32))
        w = tl.load(src + rows64[:, None] * stride_row + pairs[None, :], mask=mask, other=0)
        x0 = (w << 16).to(tl.float32, bitcast=True)  # a bf16's bits are a float32's upper half
        x1 = (w & -65536).to(tl.float32, bitcast=True)
        b = rows64 // T
        cs = (b * stride_cb + (rows64 - b * T) * stride_ct)[:, None] + (pairs % HALF)[None, :]
        c = tl.load(COS + cs, mask=mask, other=0.0)
        s = tl.load(SIN + cs, mask=mask, other=0.0)
        y0 = (x0 * c - x1 * s).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 65535
        y1 = (x0 * s + x1 * c).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
        dst = OUT.to(tl.pointer_type(tl.int32))
        tl.store(dst + rows64[:, None] * PAIRS + pairs[None, :], y0 | (y1 << 16), mask=mask)


def _rope_qk_impl(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q | k of qkv (B, T, 3·H·d), each rotated by (cos, sin): (B, T, 2·H·d)."""
    B, T, width = qkv.shape
    d = width // (3 * num_heads)
    if can_use_triton(qkv) and qkv.dtype == torch.bfloat16:
        aligned = qkv.stride(1) % 2 == 0 and qkv.storage_offset() % 2 == 0  # pairs are whole words
        if qkv.stride(2) != 1 or qkv.stride(0) != T * qkv.stride(1) or not aligned:
            qkv = qkv.clone(memory_format=torch.contiguous_format)
        out = qkv.new_empty(B, T, 2 * num_heads * d)
        stride_cb = cos.stride(0) if cos.dim() == 3 else 0
        block_r, block_p = 8, 256
        grid = (triton.cdiv(B * T, block_r), triton.cdiv(num_heads * d, block_p))
        with device_of(qkv):
            wrap_triton(_rope_qk_bf16_kernel)[grid](
                qkv, cos, sin, out, B * T, T, qkv.stride(1) // 2, stride_cb, cos.stride(-2),
                PAIRS=num_heads * d, HALF=d // 2, BLOCK_R=block_r, BLOCK_P=block_p)
        return out
    q, k = qkv[..., : 2 * num_heads * d].unflatten(-1, (2, num_heads, d)).unbind(2)  # (B, T, H, d)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return torch.cat([apply_rope(t, c, s).flatten(-2) for t in (q, k)], dim=-1)


def _rope_qk_fake(qkv, cos, sin, num_heads):
    B, T, width = qkv.shape
    return qkv.new_empty(B, T, 2 * width // 3)


rope_qk_op = register_op("scratchlm::rope_qk", _rope_qk_impl, _rope_qk_fake)


def check_tables(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise ValueError unless cos and sin are both (T, d/2) or (B, T, d/2) for qkv (B, T, 3·H·d)."""
    B, T, width = qkv.shape
    half = width // (6 * num_heads)
    if cos.shape not in ((T, half), (B, T, half)) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be ({T}, {half}) or ({B}, {T}, {half}) for qkv "
                         f"{tuple(qkv.shape)}, got {tuple(cos.shape)} and {tuple(sin.shape)}")


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q | k of qkv (B, T, 3·H·d) rotated by RoPE: (B, T, 2·H·d); cos, sin float32 (T, d/2) or
    (B, T, d/2), contiguous. Not differentiable (see the module docstring)."""
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * num_heads) or (qkv.shape[-1] // (3 * num_heads)) % 2:
        raise ValueError(f"qkv must be (batch, seq, 3·heads·d) with even d for {num_heads} heads, "
                         f"got {tuple(qkv.shape)}")
    check_tables(qkv, num_heads, cos, sin)
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin must be contiguous float32 tables")
    return rope_qk_op(qkv, cos, sin, num_heads)
