"""The attention backends, and the one registry that names them.

- "math": `functional.scaled_dot_product_attention` with an explicit boolean mask. The reference,
  and the only backend that takes padding masks and a KV cache.
- "flash_torch": the tiled FlashAttention-2 `autograd.Function` in plain PyTorch
  (`kernels.flash_attention_torch.FlashAttentionTorch`), on any device.
- "flash_triton": the Triton kernels' `flash_attention` (a custom op with its autograd formula
  registered, which torch.compile keeps in one graph) on CUDA tensors, and `flash_attention_qkv`,
  which attends straight from the concatenated q|k|v projections and hands back their gradient
  as one tensor (RoPE undone in its kernels). How its ops are registered is chosen with
  `scratchlm.kernels.triton_support.set_op_registration`, before the first one is.

All three take grouped-query k and v (`grouped_kv`): q (B, H, T, d) with k and v (B, Hkv, T, d),
H a multiple of Hkv, q head h reading kv head h // (H // Hkv), without repeating k and v; and a
causal sliding window (`sliding_window`): `attend(q, k, v, is_causal, window=None)`, each query
seeing at most the last `window` keys, itself included.

`ATTENTION_BACKENDS` maps each name to its class; `attention_backend_names()` lists them for
config validation and command-line choices, and `make_attention_backend(name)` builds one.
`MultiHeadSelfAttention` builds its backend once, when it is built (an attribute resolved inside
a torch.compile'd forward is not reliably seen), and the kernel modules are imported then, by
the backend's `__init__`: never at import of this module, which imports no torch.

Calls a backend cannot take run on "math", and say so once per process and reason (a `logging`
warning on the "scratchlm.model.attention_backends" logger, not under torch.compile tracing, where
a logging call would break the graph). Each of them is a case that must keep working:
- a KV cache with a flash backend: decoding a model trained with one (the flash kernels only
  know `is_causal`, not a cache's rectangular, padding-aware mask);
- a padding mask with a flash backend: uncached decoding of left-padded prompts;
- "flash_triton" on CPU tensors: sampling a GPU-trained checkpoint on a laptop.
Errors are raised instead for an unknown backend name, and for a padding mask given together
with a KV cache (the cache keeps its own padding).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scratchlm.model.attention_backend import AttentionBackend

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "attention_backend_names", "make_attention_backend",
           "warn_fallback"]

log = logging.getLogger(__name__)


class MathAttention(AttentionBackend):
    """softmax(q kᵀ / sqrt(d)) v as batched matmuls, under an explicit boolean mask.

    With k and v of fewer heads than q, q is viewed as (B, Hkv, G, T, d) against k and v viewed as
    (B, Hkv, 1, L, d): the matmuls broadcast over the group, no copy of k or v."""

    name = "math"
    heads_first = True
    padding_mask = True
    kv_cache = True
    grouped_kv = True
    sliding_window = True

    def __init__(self) -> None:
        from scratchlm.kernels.flash_attention_torch import check_window
        from scratchlm.model.functional import causal_mask, scaled_dot_product_attention

        self._causal_mask = causal_mask
        self._attention = scaled_dot_product_attention
        self._check_window = check_window

    def _grouped(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        if q.shape[-3] == k.shape[-3]:
            return self._attention(q, k, v, mask)
        group = q.shape[-3] // k.shape[-3]
        if mask is not None and mask.dim() >= 3:  # (B, 1 or H, T, L): one more dim for the group
            mask = mask.unflatten(-3, (-1, group if mask.shape[-3] > 1 else 1))
        out = self._attention(q.unflatten(-3, (k.shape[-3], group)), k.unsqueeze(-3), v.unsqueeze(-3), mask)
        return out.flatten(-4, -3)  # (B, Hkv, G, T, d) -> (B, H, T, d)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, window: int | None = None) -> Tensor:
        self._check_window(is_causal, window)
        mask = self._causal_mask(q.shape[-2], k.shape[-2], device=q.device) if is_causal else None
        if window is not None:  # query i sits at key position i + L - T and sees keys j > that - window
            mask = mask & ~mask.tril(k.shape[-2] - q.shape[-2] - window)
        return self._grouped(q, k, v, mask)

    def attend_masked(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        return self._grouped(q, k, v, mask)


class FlashTorchAttention(AttentionBackend):
    """FlashAttention-2 tiling in plain PyTorch: the readable reference of the Triton kernels."""

    name = "flash_torch"
    heads_first = False
    grouped_kv = True
    sliding_window = True

    def __init__(self) -> None:
        from scratchlm.kernels.flash_attention_torch import DEFAULT_K_TILE, DEFAULT_Q_TILE, FlashAttentionTorch

        self._apply = FlashAttentionTorch.apply
        self._tiles = (DEFAULT_Q_TILE, DEFAULT_K_TILE)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, window: int | None = None) -> Tensor:
        if window is None:
            return self._apply(q, k, v, is_causal)
        return self._apply(q, k, v, is_causal, *self._tiles, window)


class FlashTritonAttention(AttentionBackend):
    """FlashAttention-2 in Triton, on CUDA tensors; also attends from the packed q|k|v."""

    name = "flash_triton"
    heads_first = False
    packed_qkv = True
    grouped_kv = True
    sliding_window = True

    def __init__(self) -> None:
        # Imports without triton installed (CPU wheels): only running it needs CUDA.
        from scratchlm.kernels.flash_attention_triton import flash_attention, flash_attention_qkv

        self._attention = flash_attention
        self._attention_qkv = flash_attention_qkv

    def runs_on(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def attend(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool, window: int | None = None) -> Tensor:
        return self._attention(q, k, v, is_causal, window=window)

    def attend_qkv(self, qkv: Tensor, num_heads: int, cos: Tensor | None, sin: Tensor | None,
                   is_causal: bool, num_kv_heads: int | None = None, *, window: int | None = None) -> Tensor:
        """As `AttentionBackend.attend_qkv`, qkv (B, T, (H + 2·Hkv)·d) with Hkv = `num_kv_heads`
        (default H)."""
        return self._attention_qkv(qkv, num_heads, cos, sin, is_causal, num_kv_heads, window=window)


# The registry: one line per backend.
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {backend.name: backend for backend in (
    MathAttention,
    FlashTorchAttention,
    FlashTritonAttention,
)}


def attention_backend_names() -> tuple[str, ...]:
    """The registered backend names, "math" first: the values `model.attention_backend` takes."""
    return tuple(ATTENTION_BACKENDS)


def make_attention_backend(name: str) -> AttentionBackend:
    """The backend registered as `name`, built (its kernel module imported)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(attention_backend_names())}")
    return ATTENTION_BACKENDS[name]()


_warned: set[tuple[str, str]] = set()


def warn_fallback(backend: str, reason: str) -> None:
    """Log, once per process for each (backend, reason), that a call ran on "math" instead.

    Call it outside torch.compile tracing (`torch.compiler.is_compiling()`): a logging call
    there breaks the graph.
    """
    if (backend, reason) in _warned:
        return
    _warned.add((backend, reason))
    log.warning("attention backend %r cannot take %s; such calls attend with 'math' instead", backend, reason)
