"""Rotary position embedding (RoPE) on interleaved pairs.

Pair i of a d_k-vector is (x[2i], x[2i+1]); at position p it is rotated by the angle
p · theta^(-2i/d_k). This is the layout of the original RoPE paper and of Meta's Llama
(`view_as_complex` on adjacent pairs); Hugging Face's Llama instead rotates the halves
(x[i], x[i + d_k/2]), so its q/k projections are a row permutation of ours.

The cos/sin tables are non-persistent float32 buffers: they are recomputed from (theta, d_k,
max_seq_len), never stored in a checkpoint, and rebuilt in float32 whenever the module is
moved or cast (so `model.to(torch.bfloat16)` or `to_empty()` leave them exact).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rope_angles(theta: float, d_k: int, max_seq_len: int, device=None) -> Tensor:
    """Rotation angles, (max_seq_len, d_k // 2): angles[p, i] = p · theta^(-2i/d_k), in float32."""
    # Computed in float64 then rounded once: p · freq loses digits in float32 for long contexts.
    freqs = theta ** (-torch.arange(0, d_k, 2, device=device, dtype=torch.float64) / d_k)  # (d_k/2,)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)  # (max_seq_len,)
    return torch.outer(positions, freqs).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs of `x` (..., T, d_k) by angles whose cos/sin are (..., T, d_k/2).

    cos and sin broadcast against x's leading dims; the result has x's shape and dtype.
    """
    x_even = x[..., 0::2].float()  # (..., T, d_k/2)
    x_odd = x[..., 1::2].float()
    out_even = x_even * cos - x_odd * sin
    out_odd = x_even * sin + x_odd * cos
    return torch.stack((out_even, out_odd), dim=-1).flatten(-2).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE for vectors of size d_k at positions 0 .. max_seq_len - 1; has no parameters.

    forward(x: (..., T, d_k), token_positions: (..., T) integer, broadcastable to x's leading
    dims) -> (..., T, d_k). For x of shape (B, H, T, d_k) pass positions of shape (T,),
    (1, T) or (B, 1, T). Positions default to 0 .. T - 1.
    """

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None) -> None:
        super().__init__()
        if d_k % 2:
            raise ValueError(f"RotaryEmbedding needs an even d_k, got {d_k}")
        self.theta = theta
        self.d_k = d_k
        self.max_seq_len = max_seq_len
        angles = rope_angles(theta, d_k, max_seq_len, device=device)
        self.register_buffer("cos", torch.cos(angles), persistent=False)  # (max_seq_len, d_k/2)
        self.register_buffer("sin", torch.sin(angles), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        # Rebuild the tables after every .to()/.half()/.to_empty(): casting them to bf16 would
        # blur the angles of far positions, and to_empty() would leave them uninitialised.
        super()._apply(fn, recurse)
        if self.cos.device.type != "meta":
            angles = rope_angles(self.theta, self.d_k, self.max_seq_len, device=self.cos.device)
            self.cos, self.sin = torch.cos(angles), torch.sin(angles)
        return self

    def forward(self, x: Tensor, token_positions: Tensor | None = None) -> Tensor:
        if x.shape[-1] != self.d_k:
            raise ValueError(f"RotaryEmbedding expected last dimension {self.d_k}, got {x.shape[-1]}")
        if token_positions is None:
            T = x.shape[-2]
            if T > self.max_seq_len:
                raise ValueError(f"sequence of {T} positions exceeds max_seq_len={self.max_seq_len}")
            token_positions = torch.arange(T, device=x.device)
        return apply_rope(x, *self.tables(token_positions))

    def tables(self, token_positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin at the given positions, each (..., T, d_k/2): look up once, rotate q and k."""
        return self.cos[token_positions], self.sin[token_positions]

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"
