"""The peer of scratchlm's model in the benchmarks: the Llama-style LM a PyTorch user writes with torch.nn.

Same architecture as scratchlm's `TransformerLM` (pre-norm RMSNorm, RoPE, SwiGLU, untied head,
no biases, the same truncated-normal initialisation), built only from ``nn.Embedding``,
``nn.RMSNorm``, ``nn.Linear`` (one fused q|k|v projection, as such models are usually written)
and ``F.scaled_dot_product_attention``. It imports nothing from scratchlm, so a benchmark that
times it against scratchlm compares two independent implementations of one model.

Besides the model: the AdamW parameter groups of the reference trainer (decay on matrices only)
and its batch of random windows from a token file. The training loop itself is the script
``benchmarks/reference_trainer.py``; ``benchmarks/train_step.py``, ``step_breakdown.py`` and
``train_loop.py`` time steps of this model.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

__all__ = ["ReferenceLM", "ReferenceBlock", "rope_tables", "rotate_interleaved", "rotate_halves",
           "reference_adamw", "window_batch"]


def rope_tables(d_head: int, max_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position · theta^(-2i/d_head), each (max_len, d_head / 2), float32."""
    inv = theta ** (-torch.arange(0, d_head, 2, device=device, dtype=torch.float32) / d_head)
    angles = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return angles.cos(), angles.sin()


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) (scratchlm's RoPE); x: (B, H, T, d), cos/sin (T, d/2)."""
    x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) (the "rotate-half" RoPE of Hugging Face's Llama); shapes as
    `rotate_interleaved`. The same rotation with the features of each head permuted."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


_ROTATIONS = {"interleaved": rotate_interleaved, "halves": rotate_halves}


class ReferenceBlock(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + w2(silu(w1 h) * w3 h) with h = ln2(x)."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, rope_pairs: str = "interleaved"):
        super().__init__()
        self.num_heads = num_heads
        self.rotate = _ROTATIONS[rope_pairs]
        self.ln1 = nn.RMSNorm(d_model, eps=1e-5)
        self.ln2 = nn.RMSNorm(d_model, eps=1e-5)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape  # cos, sin: (T, d/2)
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.num_heads, D // self.num_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, D))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ReferenceLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size), for T <= context_length.

    ``rope_pairs``: "interleaved" (scratchlm's pairs, the default) or "halves" (rotate-half, the
    form the train-step benchmark's reference uses). ``checkpoint_every``: 0, or k to run every
    k-th block under ``torch.utils.checkpoint`` (the long-context step). Submodules ``embed``,
    ``blocks``, ``ln_f``, ``head`` (a torch.nn user's names, not scratchlm's state_dict layout).
    """

    def __init__(self, vocab_size: int, context_length: int, d_model: int, num_layers: int, num_heads: int,
                 d_ff: int, rope_theta: float = 10_000.0, *, rope_pairs: str = "interleaved",
                 checkpoint_every: int = 0):
        super().__init__()
        if rope_pairs not in _ROTATIONS:
            raise ValueError(f"rope_pairs must be one of {sorted(_ROTATIONS)}, got {rope_pairs!r}")
        self.d_model = d_model
        self.checkpoint_every = checkpoint_every
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(ReferenceBlock(d_model, num_heads, d_ff, rope_pairs=rope_pairs)
                                    for _ in range(num_layers))
        self.ln_f = nn.RMSNorm(d_model, eps=1e-5)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        cos, sin = rope_tables(d_model // num_heads, context_length, rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # scratchlm's initialisation. qkv is one (3d, d) Linear, so q, k and v each get std
        # sqrt(2 / (d + 3d)), which scratchlm's attention gives its q_proj, k_proj and v_proj.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                fan_out, fan_in = module.weight.shape
                std = math.sqrt(2.0 / (fan_in + fan_out))
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
            elif isinstance(module, nn.Embedding):
                nn.init.trunc_normal_(module.weight, std=1.0, a=-3.0, b=3.0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            if self.checkpoint_every and i % self.checkpoint_every == 0:
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.head(self.ln_f(x))


def reference_adamw(model: nn.Module, *, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                    weight_decay: float = 0.1, fused: bool | None = None) -> torch.optim.AdamW:
    """torch's AdamW with weight decay on matrices only (norm gains undecayed), eps 1e-8; fused
    by default where the parameters live on CUDA."""
    params = list(model.parameters())
    if fused is None:
        fused = params[0].is_cuda
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=betas, eps=1e-8, fused=fused)


def window_batch(tokens: np.ndarray, starts: np.ndarray, context_length: int,
                 device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each (len(starts), context_length) int64, from the windows of
    ``tokens`` that begin at ``starts``; copied through pinned memory on CUDA."""
    T = context_length
    rows = np.stack([tokens[s:s + T + 1] for s in starts]).astype(np.int64)
    t = torch.from_numpy(rows)
    if torch.device(device).type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    return t[:, :-1], t[:, 1:]
