"""Pure tensor functions the model is built from: softmax, SiLU, cross-entropy, attention.

Each is written from elementary tensor ops so that every step of the Transformer is visible;
the tests compare them with their `torch.nn.functional` counterparts. All of them accept any
number of leading (batch) dimensions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def softmax(x: Tensor, dim: int) -> Tensor:
    """Numerically stable softmax of `x` along `dim` (same shape and dtype as `x`).

    The maximum is subtracted before exponentiating, so large logits never overflow. A slice
    that is entirely `-inf` gives NaN, as `torch.softmax` does.
    """
    m = x.amax(dim=dim, keepdim=True)
    # An all -inf slice would give (-inf) - (-inf) = NaN before the exp; shift by 0 instead so
    # the result is the same 0 / 0 that torch produces, not a different NaN path.
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    return e / e.sum(dim=dim, keepdim=True)


def silu(x: Tensor) -> Tensor:
    """SiLU (swish) activation, `x * sigmoid(x)`, elementwise."""
    return x * torch.sigmoid(x)


def log_softmax(x: Tensor, dim: int) -> Tensor:
    """Numerically stable log-softmax of `x` along `dim`: `x - logsumexp(x)`."""
    m = x.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    shifted = x - m
    return shifted - torch.log(torch.exp(shifted).sum(dim=dim, keepdim=True))


def cross_entropy(logits: Tensor, targets: Tensor, *, ignore_index: int | None = None) -> Tensor:
    """Mean negative log-likelihood of `targets` under `softmax(logits)`.

    logits: (..., V) unnormalised scores; targets: (...) integer class ids.
    Returns a float32 scalar, the mean over every leading position. Low-precision logits are
    upcast to float32 first: the log-sum-exp over a large vocabulary loses too much in bf16.
    With `ignore_index`, positions whose target equals it are left out of the mean (as in
    `torch.nn.functional.cross_entropy`); if every position is ignored the result is NaN.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} need targets of shape "
            f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}"
        )
    x = logits.float().reshape(-1, logits.shape[-1])  # (N, V)
    t = targets.reshape(-1)  # (N,)
    keep = None
    if ignore_index is not None:
        keep = t != ignore_index
        t = torch.where(keep, t, torch.zeros_like(t))
    m = x.amax(dim=-1, keepdim=True)  # (N, 1)
    lse = m.squeeze(-1) + torch.log(torch.exp(x - m).sum(dim=-1))  # (N,)
    target_logit = x.gather(-1, t.unsqueeze(-1)).squeeze(-1)  # (N,)
    nll = lse - target_logit
    if keep is None:
        return nll.mean()
    return (nll * keep).sum() / keep.sum()


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Attention `softmax(q kᵀ / sqrt(d)) v`.

    q: (..., Tq, d), k: (..., Tk, d), v: (..., Tk, d_v) -> (..., Tq, d_v).
    mask: boolean, broadcastable to (..., Tq, Tk); True means the query may attend to the key.
    A query row with no allowed key returns zeros (rather than NaN) so that padded rows stay
    harmless.
    """
    out_dtype = v.dtype
    dtype = torch.promote_types(q.dtype, torch.float32)
    # The whole computation runs in at least float32, autocast or not (like RMSNorm): bf16
    # scores of size ~30 are off by ~0.1 before the exp, which visibly moves the weights.
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (..., Tq, Tk)
        if mask is None:
            probs = softmax(scores, dim=-1)
        else:
            blocked = ~mask
            scores = scores.masked_fill(blocked, float("-inf"))
            # Softmax without softmax()'s all -inf guard: a fully masked row turns NaN here and
            # is zeroed just below (every entry of it is blocked).
            e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            probs = (e / e.sum(dim=-1, keepdim=True)).masked_fill(blocked, 0.0)
        return (probs @ v).to(out_dtype)


def causal_mask(T_q: int, T_k: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """Boolean (Tq, Tk) lower-triangular mask, True where key j may be seen by query i.

    With Tk > Tq the queries are the last Tq positions of the keys (decoding with a cache):
    query i sits at position i + Tk - Tq.
    Example: causal_mask(2, 3) -> [[True, True, False], [True, True, True]].
    """
    T_k = T_q if T_k is None else T_k
    q_pos = torch.arange(T_k - T_q, T_k, device=device).unsqueeze(-1)  # (Tq, 1)
    k_pos = torch.arange(T_k, device=device).unsqueeze(0)  # (1, Tk)
    return k_pos <= q_pos


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype a matmul with `t` runs in: the autocast dtype under autocast on t's device,
    else t's own."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype
