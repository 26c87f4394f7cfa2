"""Causal multi-head self-attention with optional RoPE, KV cache and fast kernels.

Variants, all off by default:
- grouped-query attention (`num_kv_heads` < num_heads): k_proj and v_proj have num_kv_heads
  heads, and query head h reads kv head h // (num_heads / num_kv_heads), the Llama / Hugging Face
  grouping. A backend that declares `grouped_kv` gets k and v with their own heads; for any other
  the kv heads are repeated first (autograd sums the copies' gradients). KV caches store only
  the kv heads: that is what GQA saves.
- QK-norm (`qk_norm`): an RMSNorm over head_dim (weights `q_norm`, `k_norm`, shared by all
  heads) on q and k of every head, before RoPE.
- a sliding window (`sliding_window` = W): causal attention in which each query sees at most
  the last W keys, itself included. A backend without `sliding_window` attends under an
  explicit mask (`attend_masked`) when it takes masks, else on "math" (logged once).
- q/k/v biases (`qkv_bias`, Qwen2's layout): `q_proj.bias`, `k_proj.bias`, `v_proj.bias`,
  zero at init; the projections are then never fused.

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
from scratchlm.model.layers import Linear, RMSNorm, can_fuse, project_together, stacked_linear
from scratchlm.model.rope import RotaryEmbedding, apply_rope


def qkv_init_std(d_model: int, qkv_init: str = "fused", kv_dim: int | None = None) -> tuple[float, float]:
    """Init std of q_proj and of k_proj / v_proj; kv_dim = num_kv_heads · head_dim (default d_model).

    "fused": one std for all three, the Glorot scale sqrt(2 / (d_model + d_model + 2·kv_dim)) of
    the one (d_model + 2·kv_dim, d_model) map that q, k and v form, as a fused qkv Linear gets it
    (sqrt(2 / 4d) without GQA); "separate": each projection's own Glorot scale, sqrt(2 / (d + d))
    for q and sqrt(2 / (d + kv_dim)) for k and v.
    """
    kv_dim = d_model if kv_dim is None else kv_dim
    if qkv_init == "fused":
        std = math.sqrt(2.0 / (2 * d_model + 2 * kv_dim))
        return std, std
    if qkv_init == "separate":
        return math.sqrt(2.0 / (d_model + d_model)), math.sqrt(2.0 / (d_model + kv_dim))
    raise ValueError(f"unknown qkv_init {qkv_init!r}; choose 'fused' or 'separate'")


def sliding_window_mask(T_q: int, T_k: int, window: int, *, device: torch.device | str | None = None) -> Tensor:
    """Boolean (Tq, Tk) causal mask in which query i sees at most the last `window` keys, itself
    included; the queries are the last Tq positions of the keys, as in `causal_mask`.

    Example: sliding_window_mask(3, 3, 2) -> [[T, F, F], [T, T, F], [F, T, T]].
    """
    q_pos = torch.arange(T_k - T_q, T_k, device=device).unsqueeze(-1)  # (Tq, 1)
    k_pos = torch.arange(T_k, device=device).unsqueeze(0)  # (1, Tk)
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def repeat_kv(x: Tensor, groups: int) -> Tensor:
    """Each head of x (B, Hkv, T, d) repeated `groups` times in place: (B, Hkv·groups, T, d), head
    h a copy of head h // groups. The backward sums the copies' gradients."""
    if groups == 1:
        return x
    B, Hkv, T, d = x.shape
    return x[:, :, None].expand(B, Hkv, groups, T, d).reshape(B, Hkv * groups, T, d)


class BiasedLinear(Linear):
    """`Linear` plus a bias (zeros at init): y = x Wᵀ + b. Only q/k/v with `qkv_bias` use it
    (Qwen2's layout); scratchlm's modules are otherwise bias-free."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None, *,
                 init_std: float | None = None) -> None:
        super().__init__(in_features, out_features, device=device, dtype=dtype, init_std=init_std)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "bias"):
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        # F.linear, so autocast casts the bias with the weight (x Wᵀ + b would promote to float32);
        # the bias follows the weight's dtype where it is cast without autocast (FSDP's compute dtype)
        return torch.nn.functional.linear(x, self.weight, self.bias.to(self.weight.dtype))


class MultiHeadSelfAttention(nn.Module):
    """Causal self-attention: x (B, T, d_model) -> (B, T, d_model).

    Submodules q_proj, k_proj, v_proj, output_proj (d_model x d_model, bias-free; k_proj and
    v_proj are (num_kv_heads · d_k) x d_model), and q_norm, k_norm with `qk_norm`. With a
    `rope`, queries and keys are rotated per head (d_k = d_model / num_heads). `num_kv_heads`,
    `qk_norm`, `sliding_window` and `qkv_bias`: see the module docstring. `layer_idx`
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
        num_kv_heads: int | None = None,
        qk_norm: bool = False,
        sliding_window: int | None = None,
        qkv_bias: bool = False,
        norm_eps: float = 1e-5,
        layer_idx: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = d_model // num_heads
        self.kv_groups = num_heads // num_kv_heads  # query heads per kv head
        self.sliding_window = sliding_window
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
        # (docs/benchmarks/training.md). With GQA the fused map is d_model -> d_model + 2·kv_dim.
        kv_dim = num_kv_heads * self.head_dim
        q_std, kv_std = qkv_init_std(d_model, qkv_init, kv_dim)
        proj = BiasedLinear if qkv_bias else Linear
        self.q_proj = proj(d_model, d_model, device=device, dtype=dtype, init_std=q_std)
        self.k_proj = proj(d_model, kv_dim, device=device, dtype=dtype, init_std=kv_std)
        self.v_proj = proj(d_model, kv_dim, device=device, dtype=dtype, init_std=kv_std)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, eps=norm_eps, device=device, dtype=dtype)

    def _heads(self, x: Tensor) -> Tensor:
        B, T, width = x.shape
        return x.view(B, T, width // self.head_dim, self.head_dim)  # (B, T, H or Hkv, d): a view, no copy

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
        positions then default to those that follow the cached ones. The cache stores
        num_kv_heads heads and applies the same sliding window as this module.
        """
        if kv_cache is not None and attention_mask is not None:
            raise ValueError("with a kv_cache, padding is given to the cache, not as attention_mask")
        if kv_cache is not None and getattr(kv_cache, "sliding_window", None) != self.sliding_window:
            raise ValueError(f"the KV cache has sliding_window={getattr(kv_cache, 'sliding_window', None)}, "
                             f"the model {self.sliding_window}: build it with the model's (for_model)")
        B, T, _ = x.shape
        windowed = self._windowed(T, kv_cache)
        backend = self._backend_for(x, kv_cache, attention_mask, windowed)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        fuse = self.fused_qkv and kv_cache is None and can_fuse(x, *projections)
        if (fuse and self.packed_backward and backend.packed_qkv and kv_cache is None
                and attention_mask is None and not windowed and not self.qk_norm
                and (backend.grouped_kv or self.kv_groups == 1)):
            return self.output_proj(self._attend_packed(backend, x, projections, token_positions))
        # The decoding engine's view may hold q|k|v stacked as one matrix: one matmul, not three.
        stacked = kv_cache.stacked(self.layer_idx, "qkv") if hasattr(kv_cache, "stacked") else None
        if stacked is not None:
            q, k, v = self._split_qkv(stacked_linear(x, stacked))
        elif fuse:
            q, k, v = map(self._heads, project_together(x, projections))
        else:
            q, k, v = (self._heads(proj(x)) for proj in projections)
        out = self._attend_heads(backend, q, k, v, token_positions, kv_cache, attention_mask, windowed)
        return self.output_proj(out)

    def attend_projected(self, qkv: Tensor, token_positions: Tensor | None, kv_cache: Any) -> Tensor:
        """The attention of q|k|v already projected (B, T, d_model + 2·num_kv_heads·d_k), through
        `kv_cache`, before the output projection: (B, T, d_model). The decoding engine's fused
        blocks (`scratchlm.infer.fused_block`) compute q|k|v with the norm before them in one kernel."""
        backend = self._backend_for(qkv, kv_cache, None)
        q, k, v = self._split_qkv(qkv)
        return self._attend_heads(backend, q, k, v, token_positions, kv_cache, None, False)

    def _split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        kv_dim = self.num_kv_heads * self.head_dim
        q, k, v = map(self._heads, qkv.split((self.d_model, kv_dim, kv_dim), dim=-1))
        return q, k, v

    def _attend_heads(self, backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor,
                      token_positions: Tensor | None, kv_cache: Any, attention_mask: Tensor | None,
                      windowed: bool) -> Tensor:
        """q, k, v (B, T, heads, d) from the projections -> attention output (B, T, d_model), before
        the output projection: q/k norms, RoPE, the cache and the backend's kernel."""
        B, T = q.shape[:2]
        x_device = q.device
        if self.qk_norm:  # per head, over head_dim, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        # The flash kernels (heads_first False) take q/k/v in the projections' (B, T, H, d) layout
        # (as strided (B, H, T, d) views) and lay their gradients out the same way, so RoPE rotates
        # them there: an elementwise pass with no transpose, forward and backward. The math path
        # multiplies q and k as batched matrices, which wants them heads-first in memory: RoPE
        # then writes them so.
        if backend.heads_first:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)

        if self.rope is not None:
            cos, sin = self._rope_tables(T, token_positions, kv_cache, x_device)  # (T, d/2) or (B, T, d/2)
            if not backend.heads_first:
                cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., T, 1, d/2): over heads
            elif cos.dim() >= 3:
                cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # (B, 1, T, d/2): over heads
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        if not backend.heads_first:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d) views

        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, Hkv, L, d)
            # (B, 1, T, L), (T, L) or None; causal, padding-aware and windowed by the cache
            mask = kv_cache.attention_mask(T, k.shape[-2], device=x_device)
            # A cache may bring its own kernel (the static decode cache: fused SDPA over its
            # window), which takes the kv heads as stored.
            attend = getattr(kv_cache, "attend", None)
            if attend is not None:
                out = attend(q, k, v, mask)
            else:
                out = backend.attend_masked(q, *self._kv_for(backend, k, v), mask)
        elif attention_mask is not None:
            mask = causal_mask(T, device=x_device) & attention_mask[:, None, None, :].bool()  # (B, 1, T, T)
            if windowed:
                mask = mask & sliding_window_mask(T, T, self.sliding_window, device=x_device)
            out = backend.attend_masked(q, *self._kv_for(backend, k, v), mask)
        elif windowed and backend.sliding_window:
            out = backend.attend(q, *self._kv_for(backend, k, v), True, window=self.sliding_window)
        elif windowed:
            mask = sliding_window_mask(T, T, self.sliding_window, device=x_device)  # (T, T)
            out = backend.attend_masked(q, *self._kv_for(backend, k, v), mask)
        else:
            out = backend.attend(q, *self._kv_for(backend, k, v), True)

        return out.transpose(1, 2).reshape(B, T, self.d_model)  # (B, T, d_model)

    def _windowed(self, T: int, kv_cache) -> bool:
        # Whether the sliding window hides any key from a query of this call (without a cache:
        # only when the sequence is longer than the window; a cache masks it itself).
        return self.sliding_window is not None and kv_cache is None and T > self.sliding_window

    def _kv_for(self, backend: AttentionBackend, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # k, v (B, Hkv, L, d) as `backend` takes them: as they are, or repeated to num_heads.
        if backend.grouped_kv or self.kv_groups == 1:
            return k, v
        return repeat_kv(k, self.kv_groups), repeat_kv(v, self.kv_groups)

    def _backend_for(self, x: Tensor, kv_cache, attention_mask: Tensor | None,
                     windowed: bool = False) -> AttentionBackend:
        # This module's backend, or "math" for a call it cannot take (logged once, outside tracing).
        backend = self._backend
        if kv_cache is not None and not backend.kv_cache:
            reason = "a KV cache"
        elif attention_mask is not None and not backend.padding_mask:
            reason = "a padding mask"
        elif windowed and not backend.sliding_window and not backend.padding_mask:
            reason = "a sliding window"
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
        qkv = project_together(x, projections, concatenated=True)  # (B, T, (H + 2·Hkv)·d)
        cos = sin = None
        if self.rope is not None:
            cos, sin = self._rope_tables(T, token_positions, None, x.device)
        # num_kv_heads only with GQA, so a backend that predates it keeps working without it
        grouped = {} if self.kv_groups == 1 else {"num_kv_heads": self.num_kv_heads}
        out = backend.attend_qkv(qkv, self.num_heads, cos, sin, True, **grouped)  # (B, H, T, d), laid out (B, T, H, d)
        return out.transpose(1, 2).reshape(B, T, self.d_model)

    def _rope_tables(self, T: int, token_positions: Tensor | None, kv_cache, device) -> tuple[Tensor, Tensor]:
        # RoPE's cos/sin at the given positions; by default the cache's next T, else 0 .. T - 1.
        if token_positions is None and kv_cache is not None:
            token_positions = kv_cache.positions(T, layer_idx=self.layer_idx, device=device)
        elif token_positions is None:
            token_positions = torch.arange(T, device=device)
        return self.rope.tables(token_positions)

    def extra_repr(self) -> str:
        extra = f", num_kv_heads={self.num_kv_heads}" if self.kv_groups > 1 else ""
        extra += ", qk_norm=True" if self.qk_norm else ""
        extra += f", sliding_window={self.sliding_window}" if self.sliding_window is not None else ""
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}{extra}, backend={self.backend!r}"
