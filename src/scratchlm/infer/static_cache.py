"""A static KV cache: preallocated buffers, fixed shapes, per-row lengths on the device.

Each layer owns key and value buffers of shape (slots, num_kv_heads, max_len + 1, head_dim)
(the last position spare: see `StaticKVCache.buffers`), allocated once (with grouped-query
attention only the shared kv heads are stored). Row (slot) s holds its tokens at positions
0 .. lens[s] - 1 with no padding in front, so every row can be at its own length, and a
finished row's slot can be handed to a new prompt without touching the others. Nothing about a
step depends on host-side lengths: `lens` is a device tensor, the write of one new key per row
is an indexed store, and attention runs over a fixed window of L slots with a length mask. That
is what lets a decode step be captured once (CUDA graph, torch.compile) and replayed.

The model sees the cache through the interface its attention already calls
(`update(layer_idx, k, v) -> (k_all, v_all)`, `attention_mask(T, L, device=...)`,
`positions(T, layer_idx=..., device=...)`), via two short-lived views. Each also offers
`stacked(layer_idx, kind)`, the engine's stacked projection weights (`scratchlm.infer.stacked`), and
`attend(q, k, v, mask)`, which the attention uses when a cache has it: torch's fused
`F.scaled_dot_product_attention` (flash / memory-efficient kernels) in the cache's dtype,
where the model's reference path computes in float32:

- `PrefillView`: T prompt tokens of some slots, right-padded, at positions 0 .. T - 1; their
  keys/values go to slots 0 .. T - 1 of those rows and attention is plainly causal (a real
  token never sees the padding after it; what padding slots hold is masked later).
- `DecodeView`: one token per row for the first b slots, at each row's own position `pos`;
  attention covers slots 0 .. L - 1 with key j visible iff j <= pos.
With a sliding window W, key j is further hidden from the query at position p when j <= p - W.

Grouped-query attention: q has H heads, the cache Hkv. A decode step folds the H / Hkv query
heads of each kv head into query rows of one (b, Hkv, H / Hkv, d) attention (one query per row
and head, so they share the row's mask): no copy of the cache. Prefill uses SDPA's `enable_gqa`
(torch >= 2.5), else repeats the kv heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.model.attention import repeat_kv, sliding_window_mask

_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *, is_causal: bool = False) -> Tensor:
    """torch's fused attention with k, v of Hkv heads dividing q's H (query head h reads kv head
    h // (H / Hkv)): q (B, H, T, d), k and v (B, Hkv, L, d), mask broadcast to (B, H, T, L)."""
    H, Hkv = q.shape[1], k.shape[1]
    if H == Hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    B, _, T, d = q.shape
    if T == 1 and not is_causal and (mask is None or (mask.dim() == 4 and mask.shape[1] == 1)):
        # One query per head: the group's heads become query rows over their shared kv head.
        out = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv, d), k, v, attn_mask=mask)
        return out.reshape(B, H, 1, d)
    if _SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    groups = H // Hkv
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask,
                                          is_causal=is_causal)


class StaticKVCache:
    """Per-layer key/value buffers (slots, num_heads, max_len + 1, head_dim), zero-filled on creation;
    num_heads counts the key/value heads stored (the model's num_kv_heads).

    Buffers are allocated on the first write, in the dtype of the keys written (a bf16 model, or
    autocast, gives a bf16 cache), unless `dtype` is given. They are allocated outside inference
    mode even when the first write runs inside it: a normal tensor may be written in place under
    `torch.inference_mode` or outside it, an inference tensor only inside, so one cache serves
    runs under `inference_mode` and under `no_grad` alike.
    """

    def __init__(self, num_layers: int, slots: int, num_heads: int, max_len: int, head_dim: int, *,
                 device: torch.device | str, dtype: torch.dtype | None = None,
                 sliding_window: int | None = None) -> None:
        self.num_layers = num_layers
        self.sliding_window = sliding_window
        self.slots = slots
        self.num_heads = num_heads
        self.max_len = max_len
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.dtype = dtype
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers
        # stacked q|k|v and w1|w3 weights the views offer the model (`scratchlm.infer.stacked`);
        # the engine sets and refreshes them
        self.projections = None
        # decode steps' attention: "sdpa" (torch's fused kernel over the masked window) or
        # "triton" (`scratchlm.kernels.decode_attention_triton`: each row reads only its own keys)
        self.decode_attention = "sdpa"
        # decode steps of up to MAX_ROWS rows through `scratchlm.infer.fused_block` (the engine's
        # `fused_blocks`): the norms, the SwiGLU gate and the residual adds inside the matmul kernels,
        # and RoPE and the cache write too unless it is "projections"
        self.fused_blocks: bool | str = False
        # whether the fused blocks' kernels launch with programmatic dependent launch (the engine's `pdl`)
        self.pdl = False

    def pdl_for(self, rows: int) -> bool:
        """Whether a fused step of `rows` rows launches its kernels with PDL: with the engine's
        `pdl`, at one row only (on an H100 a 16-layer 1B-shape step took 0.94x the time with it at
        one row, 1.27x at four: docs/benchmarks/decode_linear.md)."""
        return self.pdl and rows == 1

    def stacked(self, layer_idx: int, kind: str) -> tuple[Tensor, Tensor | None] | None:
        """Layer `layer_idx`'s stacked weights of `kind` ("qkv" or "w13"), or None."""
        return None if self.projections is None else self.projections.get(layer_idx, kind)

    @classmethod
    def for_model(cls, model: nn.Module, slots: int, max_len: int, *, device: torch.device | str,
                  dtype: torch.dtype | None = None) -> StaticKVCache:
        """A cache sized for a TransformerLM (its layers, kv heads, head size and sliding window)."""
        attn = model.layers[0].attn
        return cls(len(model.layers), slots, getattr(attn, "num_kv_heads", attn.num_heads), max_len, attn.head_dim,
                   device=device, dtype=dtype, sliding_window=getattr(attn, "sliding_window", None))

    def buffers(self, layer_idx: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """This layer's (k, v) buffers, allocated on first use with `like`'s dtype.

        They hold max_len + 1 positions, the last never written or read: a decode step's window
        of L <= max_len slots (`DecodeView.update`) is then never a whole buffer, so whether it is
        contiguous does not change with L. torch.compile would otherwise specialise the compiled
        step on whether L equals the buffer's length: one more recompilation."""
        if self.k[layer_idx] is None:
            shape = (self.slots, self.num_heads, self.max_len + 1, self.head_dim)
            dtype = self.dtype if self.dtype is not None else like.dtype
            with torch.inference_mode(False):  # normal tensors: see the class docstring
                self.k[layer_idx] = torch.zeros(shape, device=self.device, dtype=dtype)
                self.v[layer_idx] = torch.zeros(shape, device=self.device, dtype=dtype)
        return self.k[layer_idx], self.v[layer_idx]

    def move_rows(self, dst: int, src: Tensor, length: int) -> None:
        """Copy rows `src` (n,) into slots dst .. dst + n - 1, first `length` positions only."""
        n = src.numel()
        for bufs in (self.k, self.v):
            for buf in bufs:
                if buf is not None:
                    buf[dst:dst + n, :, :length] = buf[src, :, :length]


class PrefillView:
    """The cache as the model sees it while prefilling rows `rows` (n,) with T tokens each."""

    def __init__(self, cache: StaticKVCache, rows: Tensor, T: int) -> None:
        if T > cache.max_len:
            raise ValueError(f"prompt of {T} tokens exceeds the cache's max_len={cache.max_len}")
        self.cache, self.rows, self.T = cache, rows, T
        self.seq_len, self.min_pad = 0, 0
        self.sliding_window = window = cache.sliding_window
        # (T, T) when the window hides keys, built once for all layers; else causal by itself
        self.mask = sliding_window_mask(T, T, window, device=rows.device) if window is not None and T > window else None

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (n, Hkv, T, d) at slots 0 .. T - 1 of the rows; attention needs only these."""
        k_buf, v_buf = self.cache.buffers(layer_idx, k)
        k_buf[self.rows, :, :self.T] = k.to(k_buf.dtype)
        v_buf[self.rows, :, :self.T] = v.to(v_buf.dtype)
        return k, v

    def attention_mask(self, T: int, L: int, *, device=None) -> Tensor | None:
        return self.mask  # None: `attend` is causal by itself, no (T, T) mask to build in every layer

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Causal (and windowed) attention of the prompt tokens, q (n, H, T, d) over k, v
        (n, Hkv, T, d), by torch's fused kernel."""
        return grouped_sdpa(q, k.to(q.dtype), v.to(q.dtype), mask, is_causal=mask is None)

    def positions(self, T: int, *, layer_idx: int = 0, device=None) -> Tensor:
        return torch.arange(T, device=device)

    def stacked(self, layer_idx: int, kind: str) -> tuple[Tensor, Tensor | None] | None:
        return self.cache.stacked(layer_idx, kind)


class DecodeView:
    """The cache as the model sees it for one decode step of the first b slots.

    pos: (b,) int64, the slot (= position) each row's new token is written to. L: how many
    slots attention reads; must exceed every live row's pos. mask: (b, 1, 1, L) bool, built
    once per step and shared by all layers.
    """

    def __init__(self, cache: StaticKVCache, pos: Tensor, L: int) -> None:
        self.cache, self.pos, self.L = cache, pos, L
        b = pos.shape[0]
        self.rows = torch.arange(b, device=pos.device)
        slot = torch.arange(L, device=pos.device)
        visible = slot <= pos[:, None]  # (b, L)
        self.sliding_window = window = cache.sliding_window
        if window is not None:
            visible = visible & (slot > pos[:, None] - window)
        self.mask = visible[:, None, None, :]  # (b, 1, 1, L)
        self.seq_len, self.min_pad = 0, 0

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (b, Hkv, 1, d) at each row's pos; return the window (b, Hkv, L, d) of each."""
        k_buf, v_buf = self.cache.buffers(layer_idx, k)
        b = self.pos.shape[0]
        k_buf[self.rows, :, self.pos] = k[:, :, 0].to(k_buf.dtype)
        v_buf[self.rows, :, self.pos] = v[:, :, 0].to(v_buf.dtype)
        return k_buf[:b, :, :self.L], v_buf[:b, :, :self.L]

    def attention_mask(self, T: int, L: int, *, device=None) -> Tensor:
        return self.mask

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """q (b, H, 1, d) over the window k, v (b, Hkv, L, d) by torch's fused kernel, in the cache's
        dtype: the math path would first copy the whole window to float32, the bulk of a
        batched step's memory traffic. With the cache's ``decode_attention="triton"``, by the
        Triton kernel that reads each row's keys up to its own position only."""
        if self.cache.decode_attention == "triton":
            from scratchlm.kernels.decode_attention_triton import decode_attention

            return decode_attention(q, k, v, self.pos, self.sliding_window).to(q.dtype)
        return grouped_sdpa(q.to(k.dtype), k, v, mask).to(q.dtype)

    def positions(self, T: int, *, layer_idx: int = 0, device=None) -> Tensor:
        return self.pos[:, None]

    def stacked(self, layer_idx: int, kind: str) -> tuple[Tensor, Tensor | None] | None:
        return self.cache.stacked(layer_idx, kind)

    def fused_block(self, block: nn.Module, x: Tensor):
        """The block's decode step in fused kernels (`scratchlm.infer.fused_block.fused_step`) for
        x (b, 1, d_model), or None: the cache's `fused_blocks` is off, or the block does not qualify."""
        if not self.cache.fused_blocks or x.shape[1] != 1:
            return None
        from scratchlm.infer.fused_block import fused_step

        return fused_step(block, self, x.shape[0])
