"""What an attention backend is: the `AttentionBackend` base class.

A backend is a small object that `MultiHeadSelfAttention` builds once, by name, from the registry
in `attention_backends.py`, and then asks to attend. It says how it attends (`attend`) and what
it can take (devices, padding masks, a KV cache, the packed q|k|v form); a call it cannot take
runs on the "math" backend instead (see `attention_backends`). This module imports nothing from
scratchlm, so a backend in a file of its own subclasses it without an import cycle through the
registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import Tensor


class AttentionBackend:
    """The interface and its defaults: a backend that only knows causal attention on any device.

    Build-time work (importing a kernel module, looking up its functions) belongs in `__init__`:
    the attention module builds its backend when it is built, so a torch.compile'd forward finds
    everything resolved.
    """

    name: str = ""  # the registry key, as written in `model.attention_backend`
    # True: q and k reach `attend` heads-first in memory (RoPE writes them so), the layout that
    # batched matmuls want. False: q, k, v stay in the projections' (B, T, H, d) memory and
    # `attend` gets (B, H, T, d) views of it, with no copy (the flash kernels read any strides).
    heads_first: bool = True
    padding_mask: bool = False  # `attend_masked` takes a (B, 1, T, T) causal-and-padding mask
    kv_cache: bool = False  # `attend_masked` takes the cache's (T, L) or (B, 1, T, L) mask, or None
    packed_qkv: bool = False  # `attend_qkv` exists: attention straight from the q|k|v projections
    # True: with grouped-query attention k and v reach `attend` / `attend_masked` with their own
    # Hkv heads, (B, Hkv, T, d), query head h reading kv head h // (H / Hkv), and `attend_qkv`
    # takes a `num_kv_heads` keyword. False: the attention module repeats each kv head H / Hkv
    # times first (autograd sums their gradients back), and never takes the packed path with GQA.
    grouped_kv: bool = False
    # True: `attend(q, k, v, is_causal, window=W)` takes a sliding window: causal, each query sees
    # the last W keys, itself included. False: a model with a window attends with an explicit mask
    # through `attend_masked` when the backend takes masks (`padding_mask`), else on "math".
    sliding_window: bool = False

    def runs_on(self, device: torch.device) -> bool:
        """Whether `attend` can run on tensors on `device`."""
        return True

    def attend(self, q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
        """softmax(q kᵀ / sqrt(d)) v, causal when `is_causal`: q, k, v (B, H, T, d) -> (B, H, T, d).
        With `grouped_kv`, k and v may be (B, Hkv, T, d); with `sliding_window`, a keyword
        `window` (int) further limits each query to the last `window` keys."""
        raise NotImplementedError(f"attention backend {self.name!r} does not define attend()")

    def attend_masked(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Attention under a boolean `mask` (True = may attend), broadcast to (B, H, T, L):
        q (B, H, T, d), k and v (B, H, L, d) -> (B, H, T, d). Needed with `padding_mask` or `kv_cache`."""
        raise NotImplementedError(f"attention backend {self.name!r} does not define attend_masked()")

    def attend_qkv(self, qkv: Tensor, num_heads: int, cos: Tensor | None, sin: Tensor | None,
                   is_causal: bool) -> Tensor:
        """Attention over the concatenated projections qkv (B, T, 3·H·d), q and k rotated by RoPE
        (cos, sin) inside; -> (B, H, T, d). Needed with `packed_qkv`. A backend with `grouped_kv`
        also takes `num_kv_heads=Hkv` (qkv then (B, T, (H + 2·Hkv)·d)); it is passed only when
        Hkv differs from H."""
        raise NotImplementedError(f"attention backend {self.name!r} does not define attend_qkv()")
