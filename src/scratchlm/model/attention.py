"""Causal multi-head self-attention with optional RoPE, KV cache and fast kernels.

Backends: "math" runs `functional.scaled_dot_product_attention` with an explicit boolean mask
(the reference, and the only path that handles padding masks and cached decoding);
"flash_torch" calls the tiled FlashAttention `autograd.Function` and "flash_triton" the Triton
kernels' `flash_attention` (a custom op with its autograd formula registered, which
torch.compile keeps in one graph) from `scratchlm.kernels`, imported when such a module is
built (they import without Triton). The fast
backends only know `is_causal`, so calls with a KV cache or a padding mask fall back to "math";
so do "flash_triton" calls on CPU tensors (a GPU-trained checkpoint still samples on a laptop).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable

import torch
from torch import Tensor, nn

from scratchlm.model.functional import causal_mask, scaled_dot_product_attention
from scratchlm.model.layers import Linear, can_fuse, project_together
from scratchlm.model.rope import RotaryEmbedding, apply_rope

BACKENDS: dict[str, tuple[str, str] | None] = {
    "math": None,
    "flash_torch": ("scratchlm.kernels.flash_attention_torch", "FlashAttentionTorch"),
    "flash_triton": ("scratchlm.kernels.flash_attention_triton", "flash_attention"),
}


def load_backend(name: str) -> Callable[[Tensor, Tensor, Tensor, bool], Tensor] | None:
    """The `f(q, k, v, is_causal)` of a fast backend (a function, or an autograd.Function's
    `apply`), or None for "math"."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    target = BACKENDS[name]
    if target is None:
        return None
    module, attr = target
    fn = getattr(importlib.import_module(module), attr)
    return fn.apply if isinstance(fn, type) else fn


def qkv_init_std(d_model: int, qkv_init: str = "fused") -> float:
    """Init std of each of q_proj, k_proj, v_proj.

    "fused": the Glorot scale sqrt(2 / (d + 3d)) of the one (3·d_model, d_model) map that q, k and v
    form, as a fused qkv Linear gets it; "separate": sqrt(2 / (d + d)), each projection on its own.
    """
    if qkv_init == "fused":
        return math.sqrt(2.0 / (d_model + 3 * d_model))
    if qkv_init == "separate":
        return math.sqrt(2.0 / (d_model + d_model))
    raise ValueError(f"unknown qkv_init {qkv_init!r}; choose 'fused' or 'separate'")


class MultiHeadSelfAttention(nn.Module):
    """Causal self-attention: x (B, T, d_model) -> (B, T, d_model).

    Submodules q_proj, k_proj, v_proj, output_proj (all d_model x d_model, bias-free). With a
    `rope`, queries and keys are rotated per head (d_k = d_model / num_heads). `layer_idx`
    names this layer's slot in a KV cache. `qkv_init` picks the init scale of q, k, v
    (see `qkv_init_std`). With `fused_qkv` (default), q, k and v are one matmul in mixed-precision
    training (`layers.can_fuse`, `layers.project_together`); the three parameters stay separate.
    With `packed_backward` and the "flash_triton" backend on CUDA that one output goes whole into
    `flash_attention_qkv`, whose backward hands back one gradient (RoPE undone in its kernels), so
    the projections' backward is one matmul each way too.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope: RotaryEmbedding | None = None,
        *,
        backend: str = "math",
        qkv_init: str = "fused",
        fused_qkv: bool = True,
        packed_backward: bool = True,
        layer_idx: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        if rope is not None and rope.d_k != self.head_dim:
            raise ValueError(f"rope.d_k ({rope.d_k}) must equal d_model / num_heads ({self.head_dim})")
        self.rope = rope
        self.backend = backend
        self.layer_idx = layer_idx
        self.fused_qkv = fused_qkv
        self.packed_backward = packed_backward
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(BACKENDS)}")
        # Resolved here, not on first call: an attribute written inside a torch.compile'd forward
        # is not reliably seen by the compiled code (the Triton module imports without triton).
        self._flash = load_backend(backend)
        # flash_triton also attends over the concatenated projections, RoPE inside its backward
        self._flash_qkv = (importlib.import_module(BACKENDS[backend][0]).flash_attention_qkv
                           if backend == "flash_triton" else None)
        # By default q, k and v are initialised as the three blocks of one d_model -> 3·d_model map,
        # with its Glorot std 1/sqrt(2·d_model); sqrt(2 / (d_model + d_model)) each ("separate")
        # starts the attention logits twice as large, which pretrains measurably worse
        # (docs/benchmarks/training.md).
        qkv_std = qkv_init_std(d_model, qkv_init)
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype, init_std=qkv_std)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype, init_std=qkv_std)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype, init_std=qkv_std)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)

    def _heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim)  # (B, T, H, d): a view, no copy

    def forward(
        self,
        x: Tensor,
        token_positions: Tensor | None = None,
        kv_cache: Any = None,
        *,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """x: (B, T, d_model); token_positions: (T,) or (B, T); attention_mask: (B, T) bool,
        True at real (non-padding) tokens, only without a cache (a cache keeps its own).

        With a `kv_cache` (see `scratchlm.infer.kv_cache.KVCache`), the new keys/values are
        appended to this layer's slot and the queries attend to everything cached so far;
        positions then default to those that follow the cached ones.
        """
        B, T, _ = x.shape
        projections = (self.q_proj, self.k_proj, self.v_proj)
        fuse = self.fused_qkv and kv_cache is None and can_fuse(x, *projections)
        flash = (self._flash is not None and kv_cache is None and attention_mask is None
                 and not (self.backend == "flash_triton" and not x.is_cuda))
        if fuse and flash and self.packed_backward and self._flash_qkv is not None:
            return self.output_proj(self._attend_packed(x, projections, token_positions))
        if fuse:
            q, k, v = map(self._heads, project_together(x, projections))
        else:
            q, k, v = (self._heads(proj(x)) for proj in projections)
        # The flash kernels take q/k/v in the projections' (B, T, H, d) layout (as strided
        # (B, H, T, d) views) and lay their gradients out the same way, so RoPE rotates them there:
        # an elementwise pass with no transpose, forward and backward. The math path multiplies
        # q and k as batched matrices, which wants them heads-first in memory: RoPE then writes
        # them so.
        if not flash:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)

        if self.rope is not None:
            cos, sin = self._rope_tables(T, token_positions, kv_cache, x.device)  # (T, d/2) or (B, T, d/2)
            if flash:
                cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., T, 1, d/2): over heads
            elif cos.dim() >= 3:
                cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # (B, 1, T, d/2): over heads
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        if flash:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d) views

        if kv_cache is not None:
            if attention_mask is not None:
                raise ValueError("with a kv_cache, padding is given to the cache, not as attention_mask")
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, H, L, d)
            mask = kv_cache.attention_mask(T, k.shape[-2], device=x.device)  # (B, 1, T, L), (T, L) or None
            attend = getattr(kv_cache, "attend", scaled_dot_product_attention)  # a cache may bring its own kernel
            out = attend(q, k, v, mask)
        elif attention_mask is not None:
            mask = causal_mask(T, device=x.device) & attention_mask[:, None, None, :].bool()  # (B, 1, T, T)
            out = scaled_dot_product_attention(q, k, v, mask)
        elif flash:
            out = self._flash(q, k, v, True)
        else:
            out = scaled_dot_product_attention(q, k, v, causal_mask(T, device=x.device))

        out = out.transpose(1, 2).reshape(B, T, self.d_model)  # (B, T, d_model)
        return self.output_proj(out)

    def _attend_packed(self, x: Tensor, projections, token_positions: Tensor | None) -> Tensor:
        # q|k|v as one tensor into flash_attention_qkv, whose backward hands back one gradient
        # (RoPE undone in its kernels): the projections' backward is one matmul each way.
        B, T, _ = x.shape
        qkv = project_together(x, projections, concatenated=True)  # (B, T, 3·d_model)
        cos = sin = None
        if self.rope is not None:
            cos, sin = self._rope_tables(T, token_positions, None, x.device)
        out = self._flash_qkv(qkv, self.num_heads, cos, sin, True)  # (B, H, T, d), laid out (B, T, H, d)
        return out.transpose(1, 2).reshape(B, T, self.d_model)

    def _rope_tables(self, T: int, token_positions: Tensor | None, kv_cache, device) -> tuple[Tensor, Tensor]:
        # RoPE's cos/sin at the given positions; by default the cache's next T, else 0 .. T - 1.
        if token_positions is None and kv_cache is not None:
            token_positions = kv_cache.positions(T, layer_idx=self.layer_idx, device=device)
        elif token_positions is None:
            token_positions = torch.arange(T, device=device)
        return self.rope.tables(token_positions)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, backend={self.backend!r}"
