"""Causal multi-head self-attention with optional RoPE, KV cache and fast kernels.

How the heads attend is the job of a backend ("math", "flash_torch", "flash_triton", ...),
chosen by name from the registry in `attention_backends.py` and built once, with the module.
Calls the backend cannot take (a KV cache or a padding mask with a flash backend, "flash_triton"
on CPU tensors) run on "math" and are logged once; `attention_backends` says why each must work.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from scratchlm.model.attention_backend import AttentionBackend
from scratchlm.model.attention_backends import MathAttention, make_attention_backend, warn_fallback
from scratchlm.model.functional import causal_mask
from scratchlm.model.layers import Linear, can_fuse, project_together
from scratchlm.model.rope import RotaryEmbedding, apply_rope


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
    With `packed_backward` and a backend with a packed q|k|v path ("flash_triton", on CUDA) that
    one output goes whole into its `attend_qkv` (`flash_attention_qkv`), whose backward hands back
    one gradient (RoPE undone in its kernels), so the projections' backward is one matmul each way
    too. `backend` names an entry of `attention_backends.ATTENTION_BACKENDS`.
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
        # Built here, not on first call: an attribute written inside a torch.compile'd forward is
        # not reliably seen by the compiled code. Calls the backend cannot take run on "math".
        self._backend = make_attention_backend(backend)
        self._fallback = self._backend if isinstance(self._backend, MathAttention) else MathAttention()
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
        if kv_cache is not None and attention_mask is not None:
            raise ValueError("with a kv_cache, padding is given to the cache, not as attention_mask")
        B, T, _ = x.shape
        backend = self._backend_for(x, kv_cache, attention_mask)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        fuse = self.fused_qkv and kv_cache is None and can_fuse(x, *projections)
        if (fuse and self.packed_backward and backend.packed_qkv and kv_cache is None
                and attention_mask is None):
            return self.output_proj(self._attend_packed(backend, x, projections, token_positions))
        if fuse:
            q, k, v = map(self._heads, project_together(x, projections))
        else:
            q, k, v = (self._heads(proj(x)) for proj in projections)
        # The flash kernels (heads_first False) take q/k/v in the projections' (B, T, H, d) layout
        # (as strided (B, H, T, d) views) and lay their gradients out the same way, so RoPE rotates
        # them there: an elementwise pass with no transpose, forward and backward. The math path
        # multiplies q and k as batched matrices, which wants them heads-first in memory: RoPE
        # then writes them so.
        if backend.heads_first:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)

        if self.rope is not None:
            cos, sin = self._rope_tables(T, token_positions, kv_cache, x.device)  # (T, d/2) or (B, T, d/2)
            if not backend.heads_first:
                cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., T, 1, d/2): over heads
            elif cos.dim() >= 3:
                cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # (B, 1, T, d/2): over heads
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        if not backend.heads_first:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d) views

        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, H, L, d)
            mask = kv_cache.attention_mask(T, k.shape[-2], device=x.device)  # (B, 1, T, L), (T, L) or None
            # A cache may bring its own kernel (the static decode cache: fused SDPA over its window).
            attend = getattr(kv_cache, "attend", backend.attend_masked)
            out = attend(q, k, v, mask)
        elif attention_mask is not None:
            mask = causal_mask(T, device=x.device) & attention_mask[:, None, None, :].bool()  # (B, 1, T, T)
            out = backend.attend_masked(q, k, v, mask)
        else:
            out = backend.attend(q, k, v, True)

        out = out.transpose(1, 2).reshape(B, T, self.d_model)  # (B, T, d_model)
        return self.output_proj(out)

    def _backend_for(self, x: Tensor, kv_cache, attention_mask: Tensor | None) -> AttentionBackend:
        # This module's backend, or "math" for a call it cannot take (logged once, outside tracing).
        backend = self._backend
        if kv_cache is not None and not backend.kv_cache:
            reason = "a KV cache"
        elif attention_mask is not None and not backend.padding_mask:
            reason = "a padding mask"
        elif not backend.runs_on(x.device):
            reason = f"{x.device.type} tensors"
        else:
            return backend
        # A cache that brings its own kernel (`attend`) runs that kernel: nothing falls back to warn of.
        if not torch.compiler.is_compiling() and not hasattr(kv_cache, "attend"):
            warn_fallback(backend.name, reason)
        return self._fallback

    def _attend_packed(self, backend: AttentionBackend, x: Tensor, projections,
                       token_positions: Tensor | None) -> Tensor:
        # q|k|v as one tensor into the backend (flash_attention_qkv), whose backward hands back one
        # gradient (RoPE undone in its kernels): the projections' backward is one matmul each way.
        B, T, _ = x.shape
        qkv = project_together(x, projections, concatenated=True)  # (B, T, 3·d_model)
        cos = sin = None
        if self.rope is not None:
            cos, sin = self._rope_tables(T, token_positions, None, x.device)
        out = backend.attend_qkv(qkv, self.num_heads, cos, sin, True)  # (B, H, T, d), laid out (B, T, H, d)
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
