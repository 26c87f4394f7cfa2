"""Autoregressive decoding of a batch of prompts, with or without a KV cache.

Prompts of different lengths are left-padded into one batch. Padding slots are masked out of
attention and each row's positions count from its own first token, so every row decodes
exactly as it would alone. Finished rows (end-of-sequence, or their budget used up) stay in
the batch until all rows are done: their samples are discarded, and the random stream is the
same whichever path (cached or not) is taken.

Context limit: the model never sees more than `context_length` tokens of a row. Without the
cache the window is cropped to the last `context_length` tokens, so decoding can go on for
`max_new_tokens`. With the cache a row stops when it reaches `context_length` tokens
(prompt + completion); a prompt that does not leave room for one new token is an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from scratchlm.infer.kv_cache import KVCache
from scratchlm.infer.sampling import sample_next


def left_pad(rows: Sequence[Sequence[int]], device: torch.device, pad_id: int = 0) -> tuple[Tensor, list[int]]:
    """Token ids (B, max_len) with each row right-aligned, and each row's padding length.

    Example: left_pad([[5, 6], [7]]) -> tensor([[5, 6], [0, 7]]), [0, 1].
    """
    width = max(len(r) for r in rows)
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[pad_id] * p + list(r) for p, r in zip(pads, rows)], dtype=torch.long, device=device)
    return ids, pads


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token (e.g. an end-of-text id)")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")


def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    use_kv_cache: bool = True,
    seed: int | None = None,
) -> list[list[int]]:
    """Continue each prompt by up to `max_new_tokens` tokens; returns the new tokens of each.

    A row stops after emitting `eos_id` (which is kept as its last token). temperature=0 is
    greedy. With `seed`, sampling uses its own generator (same seed, same output); without
    one it draws from torch's global RNG. The model is put in eval mode for the call and
    restored afterwards.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not prompts:
        return []
    _check_prompts(prompts, model.vocab_size)
    device = next(model.parameters()).device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            decode = _decode_cached if use_kv_cache else _decode_uncached
            return decode(model, prompts, max_new_tokens, device, eos_id, (temperature, top_k, top_p, generator))
    finally:
        model.train(was_training)


def _record(outs: list[list[int]], done: list[bool], budgets: list[int], ids: list[int], eos_id: int | None) -> None:
    """Append this step's token to every unfinished row and mark rows that finish."""
    for b, t in enumerate(ids):
        if done[b]:
            continue
        outs[b].append(t)
        if t == eos_id or len(outs[b]) >= budgets[b]:
            done[b] = True


def _decode_cached(model, prompts, max_new_tokens, device, eos_id, sampling) -> list[list[int]]:
    ctx = model.context_length
    lens = [len(p) for p in prompts]
    for i, n in enumerate(lens):
        if n >= ctx and max_new_tokens > 0:
            raise ValueError(
                f"prompt {i} has {n} tokens, which leaves no room below context_length={ctx} "
                "with the KV cache; shorten it or decode without the cache (it crops the window)"
            )
    budgets = [min(max_new_tokens, ctx - n) for n in lens]
    steps = max(budgets)
    outs: list[list[int]] = [[] for _ in prompts]
    done = [b == 0 for b in budgets]
    if all(done):
        return outs
    ids, pads = left_pad(prompts, device)  # (B, P)
    B, P = ids.shape
    cache = KVCache.for_model(model, B, P + steps, pad_lens=pads)
    pad = torch.tensor(pads, device=device)
    positions = (torch.arange(P, device=device) - pad[:, None]).clamp(min=0)  # (B, P)
    logits = model(ids, positions, cache)[:, -1]  # (B, V)
    next_pos = torch.tensor(lens, device=device)  # (B,) position of each row's next token
    for _ in range(steps):
        nxt = sample_next(logits, *sampling)  # (B,)
        _record(outs, done, budgets, nxt.tolist(), eos_id)
        if all(done):
            break
        # Finished rows keep being fed (their output is ignored); clamping keeps their
        # positions inside the RoPE table.
        pos = next_pos.clamp(max=ctx - 1)[:, None]  # (B, 1)
        logits = model(nxt[:, None], pos, cache)[:, -1]
        next_pos += 1
    return outs


def _decode_uncached(model, prompts, max_new_tokens, device, eos_id, sampling) -> list[list[int]]:
    ctx = model.context_length
    seqs = [list(p) for p in prompts]
    budgets = [max_new_tokens] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    done = [max_new_tokens == 0] * len(prompts)
    while not all(done):
        windows = [s[-ctx:] for s in seqs]
        ids, pads = left_pad(windows, device)  # (B, W)
        mask = None
        if any(pads):
            mask = torch.arange(ids.shape[1], device=device) >= torch.tensor(pads, device=device)[:, None]
        logits = model(ids, attention_mask=mask)[:, -1]  # (B, V); positions follow the mask
        nxt = sample_next(logits, *sampling).tolist()
        _record(outs, done, budgets, nxt, eos_id)
        for s, t in zip(seqs, nxt):
            s.append(t)
    return outs
