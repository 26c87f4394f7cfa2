"""Key/value cache for incremental decoding.

Each layer gets preallocated (B, Hkv, max_len, d) key and value buffers (Hkv = the model's
num_kv_heads: with grouped-query attention the cache holds only the shared kv heads); a forward pass writes
the new keys/values at the current length and attends to the whole prefix, so decoding one
token costs O(T) instead of re-running the O(T²) prefix.

Batches of prompts of different lengths are left-padded: row b starts with `pad_lens[b]`
padding slots that no query may attend to (`key_mask`), and its token positions count from
its first real token (`positions`). With a `sliding_window` W the attention mask also hides
keys more than W - 1 slots back (within a row, slots and positions differ by a constant).
The model only calls `positions`, `update`,
`attention_mask`, `seq_len` and `min_pad`; the cache knows nothing about tokens or sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from scratchlm.model.attention import sliding_window_mask
from scratchlm.model.functional import causal_mask


class KVCache:
    """Per-layer key/value buffers of shape (batch_size, num_heads, max_len, head_dim), where
    num_heads counts the key/value heads stored (the model's num_kv_heads).

    Buffers are allocated on the first `update` of each layer, with the dtype and device of
    the keys written (so autocast or a bf16 model get a cache in the dtype they compute in),
    unless `dtype`/`device` are given.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_heads: int,
        max_len: int,
        head_dim: int,
        *,
        pad_lens: Sequence[int] | None = None,
        sliding_window: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.sliding_window = sliding_window
        self.batch_size = batch_size
        self.num_heads = num_heads
        self.max_len = max_len
        self.head_dim = head_dim
        self.device = device
        self.dtype = dtype
        self.pad_lens = [0] * batch_size if pad_lens is None else [int(p) for p in pad_lens]
        if len(self.pad_lens) != batch_size:
            raise ValueError(f"pad_lens has {len(self.pad_lens)} entries for a batch of {batch_size}")
        self.min_pad = min(self.pad_lens) if batch_size else 0
        self.lengths = [0] * num_layers
        self._k: list[Tensor | None] = [None] * num_layers
        self._v: list[Tensor | None] = [None] * num_layers
        self._key_mask: Tensor | None = None  # (B, max_len), True at real slots
        self._mask: tuple[tuple[int, int], Tensor | None] | None = None  # last attention_mask, by (T, L)

    @classmethod
    def for_model(
        cls, model: nn.Module, batch_size: int, max_len: int, *, pad_lens: Sequence[int] | None = None
    ) -> KVCache:
        """A cache sized for a TransformerLM (its layers, kv heads, head size and sliding window)."""
        attn = model.layers[0].attn
        return cls(len(model.layers), batch_size, getattr(attn, "num_kv_heads", attn.num_heads), max_len,
                   attn.head_dim, pad_lens=pad_lens, sliding_window=getattr(attn, "sliding_window", None))

    @property
    def seq_len(self) -> int:
        """Slots filled so far (padding included), counted on layer 0."""
        return self.lengths[0]

    def reset(self) -> None:
        """Forget every cached entry (buffers are kept for reuse)."""
        self.lengths = [0] * self.num_layers
        self._mask = None

    def positions(self, T: int, *, layer_idx: int = 0, device: torch.device | str | None = None) -> Tensor:
        """Positions (B, T) of the next T tokens: slot index minus the row's padding, >= 0."""
        device = device if device is not None else self._device_hint()
        start = self.lengths[layer_idx]
        slots = torch.arange(start, start + T, device=device)  # (T,)
        pad = torch.tensor(self.pad_lens, device=device).unsqueeze(-1)  # (B, 1)
        return (slots - pad).clamp(min=0)

    def key_mask(self, L: int) -> Tensor | None:
        """(B, L) bool, True where slot j of row b holds a real token; None without padding."""
        if not any(self.pad_lens):
            return None
        if self._key_mask is None:
            raise RuntimeError("key_mask called before any update")
        return self._key_mask[:, :L]

    def attention_mask(self, T: int, L: int, *, device: torch.device | str | None = None) -> Tensor | None:
        """Boolean mask for T new queries over L cached keys: causal, blind to padding and to keys
        outside the sliding window.

        (B, 1, T, L) with padding, (T, L) without, None when every key is visible (one new
        token, no padding, no key beyond the window). All layers of a step share it, so it is
        built once per (T, L).
        """
        if self._mask is not None and self._mask[0] == (T, L):
            return self._mask[1]
        key_mask = self.key_mask(L)
        device = key_mask.device if key_mask is not None else device
        window = self.sliding_window
        if window is not None and L > window:
            mask = sliding_window_mask(T, L, window, device=device)  # (T, L), causal too
        else:
            mask = None if T == 1 else causal_mask(T, L, device=device)
        if key_mask is not None:
            key_mask = key_mask[:, None, None, :]  # (B, 1, 1, L)
            mask = key_mask if mask is None else mask & key_mask
        self._mask = ((T, L), mask)
        return mask

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k, v (B, H, T, d) to layer `layer_idx`; return all its keys/values (B, H, L, d)."""
        B, H, T, d = k.shape
        if (B, H, d) != (self.batch_size, self.num_heads, self.head_dim):
            raise ValueError(
                f"KV cache is for (batch, heads, head_dim) = {(self.batch_size, self.num_heads, self.head_dim)}, "
                f"got {(B, H, d)}"
            )
        start = self.lengths[layer_idx]
        end = start + T
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {start} cached + {T} new > max_len={self.max_len}")
        if self._k[layer_idx] is None:
            self._allocate(layer_idx, k)
        k_buf, v_buf = self._k[layer_idx], self._v[layer_idx]
        k_buf[:, :, start:end] = k
        v_buf[:, :, start:end] = v
        self.lengths[layer_idx] = end
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def _allocate(self, layer_idx: int, like: Tensor) -> None:
        shape = (self.batch_size, self.num_heads, self.max_len, self.head_dim)
        device = self.device if self.device is not None else like.device
        dtype = self.dtype if self.dtype is not None else like.dtype
        self._k[layer_idx] = torch.empty(shape, device=device, dtype=dtype)
        self._v[layer_idx] = torch.empty(shape, device=device, dtype=dtype)
        if self._key_mask is None:
            pad = torch.tensor(self.pad_lens, device=device).unsqueeze(-1)  # (B, 1)
            self._key_mask = torch.arange(self.max_len, device=device) >= pad  # (B, max_len)

    def _device_hint(self) -> torch.device | str | None:
        if self.device is not None:
            return self.device
        for buf in self._k:
            if buf is not None:
                return buf.device
        return None
