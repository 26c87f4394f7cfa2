"""A pre-norm block's decode step for a few rows in five kernels.

A Llama-style block run module by module launches, per decode step, the RMSNorm, the q|k|v
matmul, RoPE and the cache write, attention, the output projection, the residual add, the second
RMSNorm, the w1|w3 matmul, the SwiGLU gate, the w2 matmul and the second residual add: at batch
1 each costs a launch's fixed latency more than its bytes (docs/benchmarks/generate.md). With
`scratchlm.kernels.decode_linear_triton.decode_linear` the norms, the gate and the residual adds
ride in the matmuls' kernels:

    qkv = decode_linear(x, W_qkv, norm=ln1)                 # RMSNorm + q|k|v
    a   = attn.attend_projected(qkv, positions, view)       # RoPE, cache write, attention
    x   = decode_linear(a, W_o, residual=x)                 # output projection + residual
    g   = decode_linear(x, W_w1|w3, norm=ln2, gate_up=True) # RMSNorm + w1|w3 + silu(gate)·up
    x   = decode_linear(g, W_2, residual=x)                 # w2 + residual

RoPE and the cache write are then a few small kernels of their own (Inductor fuses RoPE into
one, the in-place cache write is another), and the split decode attention another two (its
splits, then their combine). So by default the first three lines are instead

    q   = decode_qkv(x, W_qkv, norm=ln1, rope, pos, caches) # RMSNorm + q|k|v + RoPE + cache write
    x   = decode_attention_linear(q, caches, W_o, residual=x)  # attention + output projection

with the cache buffers as decode_qkv's mutated arguments (torch.compile keeps the write in
place) and the attention's split results combined as the output projection's kernel reads them
(with the engine's `decode_attention="triton"`; with "sdpa", attention and the projection stay
two ops). `DecodeEngine(fused_blocks="projections")` keeps the first form, for comparison.

`fused_step(block, view, rows)` returns that step for a block whose math it reproduces, or None:
pre-norm, `RMSNorm` norms, a `SwiGLU` FFN, plain bias-free projections without hooks, the
engine's stacked q|k|v and w1|w3 copies (`scratchlm.infer.stacked`), all four weights in one
dtype, at most `MAX_ROWS` rows, and tensors Triton can run. The engine turns it on with
`DecodeEngine(fused_blocks=True)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from scratchlm.kernels.decode_linear_triton import MAX_ROWS, decode_attention_linear, decode_linear, decode_qkv
from scratchlm.kernels.triton_support import can_use_triton
from scratchlm.model.layers import Linear, RMSNorm, SwiGLU, hooked

__all__ = ["fused_step", "fused_weights"]


def _plain(module: nn.Module, kind: type) -> bool:
    return type(module) is kind and not hooked(module)


def fused_weights(block: nn.Module, view: Any, rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """(W_qkv, W_w1|w3, W_o, W_2) of a block whose decode step of `rows` rows `fused_step` can run
    (see the module docstring; whether Triton runs on them aside), or None."""
    attn, ffn = getattr(block, "attn", None), getattr(block, "ffn", None)
    if (rows > MAX_ROWS or getattr(block, "norm_position", None) != "pre" or attn is None
            or not all(_plain(m, RMSNorm) for m in (block.ln1, block.ln2)) or not _plain(block, type(block))
            or not _plain(ffn, SwiGLU) or not _plain(ffn.w2, Linear) or not _plain(attn, type(attn))
            or not _plain(getattr(attn, "output_proj", None), Linear)):
        return None
    qkv, w13 = view.stacked(attn.layer_idx, "qkv"), view.stacked(attn.layer_idx, "w13")
    if qkv is None or w13 is None or qkv[1] is not None or w13[1] is not None:
        return None
    weights = qkv[0], w13[0], attn.output_proj.weight, ffn.w2.weight
    return weights if len({w.dtype for w in weights}) == 1 else None


def fused_step(block: nn.Module, view: Any, rows: int) -> Callable[[Tensor, Tensor | None], Tensor] | None:
    """`step(x, token_positions)` -> the block's output for x (rows, 1, d_model), or None where the
    block or the step does not qualify (`fused_weights`) or Triton cannot run on its weights."""
    weights = fused_weights(block, view, rows)
    if weights is None or not can_use_triton(weights[0]):
        return None
    w_qkv, w_13, w_o, w_2 = weights
    attn = block.attn
    ln1, ln2 = block.ln1, block.ln2

    rope = attn.rope if attn.rope is not None and not attn.qk_norm else None
    rope_in_kernel = view.cache.fused_blocks != "projections"
    # the split decode attention's partial results combined by the output projection's kernel
    combine_in_projection = rope_in_kernel and view.cache.decode_attention == "triton"

    def step(x: Tensor, token_positions: Tensor | None) -> Tensor:
        b, t, d = x.shape
        # each kernel may start while the one before finishes, its first weights loaded meanwhile
        pdl = view.cache.pdl_for(b * t)
        h = x.reshape(b * t, d)
        if rope is not None and rope_in_kernel:  # RoPE and the cache write inside the q|k|v kernel
            k_buf, v_buf = view.cache.buffers(attn.layer_idx, w_qkv)
            pos = view.pos if token_positions is None else token_positions.reshape(b)
            q = decode_qkv(h, w_qkv, ln1.weight, ln1.eps, rope.cos, rope.sin, pos, k_buf, v_buf, attn.num_heads,
                           pdl=pdl)
            q = q.view(b, 1, attn.num_heads, attn.head_dim).transpose(1, 2)  # (b, H, 1, d)
            k_win, v_win = k_buf[:b, :, :view.L], v_buf[:b, :, :view.L]
            if combine_in_projection:
                h = decode_attention_linear(q, k_win, v_win, pos, view.sliding_window, w_o, residual=h, pdl=pdl)
            else:
                a = view.attend(q, k_win, v_win, view.mask).transpose(1, 2)
                h = decode_linear(a.reshape(b * t, d), w_o, residual=h, pdl=pdl)
        else:
            q_k_v = decode_linear(h, w_qkv, ln1.weight, eps=ln1.eps, pdl=pdl)
            a = attn.attend_projected(q_k_v.view(b, t, -1), token_positions, view)
            h = decode_linear(a.reshape(b * t, d), w_o, residual=h, pdl=pdl)
        g = decode_linear(h, w_13, ln2.weight, eps=ln2.eps, gate_up=True, pdl=pdl)
        return decode_linear(g, w_2, residual=h, pdl=pdl).view(b, t, d)

    return step
