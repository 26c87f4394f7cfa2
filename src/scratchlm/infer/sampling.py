"""Next-token sampling: temperature, top-k and top-p (nucleus) filtering.

All functions take logits of shape (..., V) and work on the last dimension. Filters return
logits with the removed tokens set to -inf, so they compose: temperature first, then top-k,
then top-p, then a draw from the softmax of what is left.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scratchlm.model.functional import softmax


def chunked_argmax(logits: Tensor, chunks: int = 64) -> Tensor:
    """logits.argmax(dim=-1) of (b, V) logits, as two reductions: the maximum of each of `chunks`
    slices of each row, then the first slice holding the largest of those. Same index as argmax
    (the first maximal one; max returns a slice's first too). Compiled, a step's greedy pick at
    batch 1 is then two kernels of many programs each instead of one program walking the whole
    vocabulary (10.5 us of a GPT-2 step on an H100, docs/benchmarks/generate.md)."""
    b, V = logits.shape
    width = -(-V // chunks)
    padded = torch.nn.functional.pad(logits, (0, width * chunks - V), value=float("-inf"))
    top, at = padded.view(b, chunks, width).max(dim=-1)  # (b, chunks) each
    best = top.argmax(dim=-1, keepdim=True)  # (b, 1)
    return (best * width + at.gather(-1, best)).squeeze(-1)


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """logits / temperature, (..., V). temperature must be > 0 (0 means greedy: see sample_next)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 here, got {temperature}")
    return logits / temperature


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits of each row (ties with the k-th are kept too), (..., V).

    Example: top_k_filter([1., 3., 2.], 2) -> [-inf, 3., 2.].
    """
    if k <= 0:
        raise ValueError(f"top_k must be >= 1, got {k}")
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of most probable tokens whose total probability reaches p, (..., V).

    A token stays if the probability mass of the tokens strictly more probable than it is
    below p, so the most probable token always stays. Example with probabilities
    [0.5, 0.3, 0.2] and p = 0.7: mass before each is [0, 0.5, 0.8] -> keeps the first two.
    """
    if not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    if p >= 1:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V)
    probs = softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    remove_sorted = mass_before >= p
    remove_sorted[..., 0] = False  # (a p below float32's range is 0 there, which every mass reaches)
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw one token id per row from logits (B, V) -> (B,) int64.

    temperature == 0 is greedy decoding (argmax; top_k / top_p then change nothing).
    `generator` makes the draw reproducible; it must live on the logits' device.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if temperature < 1e-3:
        # The largest logit of each row is made 0 first, and the temperature kept within float32:
        # a tiny temperature then sends the other logits to -inf, as it should, instead of the
        # largest to +inf (whose softmax is NaN, from which a garbage id was drawn). Above 1e-3 no
        # finite logit of a model overflows, and the decoding step keeps its two passes fewer.
        logits = logits - logits.amax(dim=-1, keepdim=True)
        temperature = max(temperature, torch.finfo(torch.float32).tiny)
    logits = apply_temperature(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    probs = softmax(logits, dim=-1)  # (B, V)
    return draw(probs, generator)


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row of probs (B, V), drawn in proportion to them -> (B,) int64.

    argmax(p / E) with E ~ Exponential(1) i.i.d. picks index i with probability p_i (the
    exponential race); it is the algorithm `torch.multinomial(probs, 1)` runs, so the two draw
    the same ids from the same generator state, but without multinomial's validity check,
    which reads a value back to the host at every call: this one never synchronises.
    """
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)
