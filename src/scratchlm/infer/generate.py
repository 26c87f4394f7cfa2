"""Autoregressive decoding of a batch of prompts, with or without a KV cache.

With the cache (the default) decoding runs on `engine.DecodeEngine`: a static cache, decode
steps captured in CUDA graphs on GPU, finished rows' slots refilled with waiting prompts (at
most `max_batch` rows decode at once), rows checked for completion every few steps. Rows are
independent: each decodes exactly as it would alone. `kv_cache="dynamic"` keeps the simple
loop below over the growing `KVCache` (the reference the engine is tested against).

In the dynamic and uncached paths prompts of different lengths are left-padded into one batch. Padding slots are masked out of
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

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from scratchlm.infer.engine import DecodeEngine
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
    eos_id: int | Sequence[int] | None = None,
    use_kv_cache: bool = True,
    seed: int | None = None,
    kv_cache: str = "static",
    compile: bool = False,
    max_batch: int = 256,
    fused_blocks: bool | str = "auto",
    pdl: bool | str = "auto",
) -> list[list[int]]:
    """Continue each prompt by up to `max_new_tokens` tokens; returns the new tokens of each.

    A row stops after emitting `eos_id` (or any of several stop ids; the stop id is kept as its
    last token). temperature=0 is greedy. With `seed`, sampling uses its own generator (same
    seed, same output); without one it draws from torch's global RNG. The model is put in eval
    mode for the call and restored afterwards.

    kv_cache: "static" (the decoding engine) or "dynamic" (the growing cache); ignored without
    the cache. compile: `torch.compile` the engine's decode step (CUDA; the first calls pay the
    compilation). max_batch: rows decoded at once by the engine; more prompts wait for slots.
    fused_blocks: the engine's decode steps of up to 8 rows run each block's norms, SwiGLU gate
    and residual adds inside its matmul kernels, and RoPE, the cache write and the attention's
    combine too (`DecodeEngine(fused_blocks=True)`; CUDA; "projections": the matmuls' part only).
    "auto" (default): on for compiled calls of at most 8 rows on CUDA (`fused_blocks_default`).
    pdl: one-row fused steps launch their kernels with programmatic dependent launch (needs
    `compile`, `fused_blocks` and a Hopper or later GPU: `DecodeEngine(pdl=True)`); "auto"
    (default): on wherever those hold.
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
    stop_ids = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else list(eos_id)
    sampling = (temperature, top_k, top_p, generator)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            if not use_kv_cache:
                return _decode_uncached(model, prompts, max_new_tokens, device, stop_ids, sampling)
            if kv_cache == "dynamic":
                return _decode_cached(model, prompts, max_new_tokens, device, stop_ids, sampling)
            if kv_cache != "static":
                raise ValueError(f"kv_cache must be 'static' or 'dynamic', got {kv_cache!r}")
            return _decode_static(model, prompts, max_new_tokens, stop_ids, sampling, compile, max_batch,
                                  fused_blocks, pdl)
    finally:
        model.train(was_training)


def _record(outs: list[list[int]], done: list[bool], budgets: list[int], ids: list[int], stop_ids) -> None:
    """Append this step's token to every unfinished row and mark rows that finish."""
    for b, t in enumerate(ids):
        if done[b]:
            continue
        outs[b].append(t)
        if t in stop_ids or len(outs[b]) >= budgets[b]:
            done[b] = True


def _check_room(model, prompts, max_new_tokens) -> list[int]:
    """Each row's token budget under context_length; an error for a prompt that leaves none."""
    ctx = model.context_length
    lens = [len(p) for p in prompts]
    for i, n in enumerate(lens):
        if n >= ctx and max_new_tokens > 0:
            raise ValueError(
                f"prompt {i} has {n} tokens, which leaves no room below context_length={ctx} "
                "with the KV cache; shorten it or decode without the cache (it crops the window)"
            )
    return [min(max_new_tokens, ctx - n) for n in lens]


# One engine per model, kept while its shape fits: its captured (and compiled) steps are reused
# by the next call, as rollouts call generate with the same batch size again and again.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LEN_STEP = 256  # engines' max_len is a multiple of this, so one engine serves many calls
# Attention reads a window of L cache slots, L a multiple of this: short rollouts (a 40-token
# prompt and 48 new tokens) read 128 slots a row, not 256, for a few more captured steps.
_LEN_BUCKET = 64


def release_engines(model: nn.Module | None = None) -> None:
    """Drop the engine kept for `model` (all engines when None): its cache and captured steps
    hold device memory between calls, which a training step may want back."""
    if model is None:
        _ENGINES.clear()
    else:
        _ENGINES.pop(model, None)


def _engine_for(model: nn.Module, slots: int, need: int, compile: bool, *, greedy: bool = False,
                max_slots: int | None = None, fused_blocks: bool | str = "auto",
                pdl: bool | str = "auto") -> DecodeEngine:
    """The engine kept for `model` when it fits the call, else a new one of `slots` rows.

    A sampled call needs an engine of exactly `slots` rows: which rows share a step decides
    which draws each row gets, so a seed gives the same samples only from the same slot count.
    A greedy call's tokens do not depend on it, so it also takes a kept engine of at least half
    its rows and at most `max_slots` (GRPO's held-out evaluation of 500 questions and its
    rollouts of 256 then share one engine and its captured steps, instead of rebuilding each
    in turn).
    """
    device = next(model.parameters()).device
    autocast = torch.is_autocast_enabled(device.type) and device.type in ("cuda", "cpu")
    mode = (compile, autocast, torch.get_autocast_dtype(device.type) if autocast else None,
            next(model.parameters()).dtype, fused_blocks, pdl)
    max_len = min(model.context_length, -(-need // _LEN_STEP) * _LEN_STEP)
    held = _ENGINES.get(model)
    if held is not None and held[0] == mode and held[1].max_len >= need:
        kept = held[1].slots
        if kept == slots or (greedy and 2 * kept >= slots and kept <= (max_slots or slots)):
            return held[1]
    _ENGINES.pop(model, None)  # free the old cache before allocating the new one
    engine = DecodeEngine(model, slots, max_len, compile=compile, len_bucket=_LEN_BUCKET, fused_blocks=fused_blocks,
                          pdl=pdl)
    _ENGINES[model] = (mode, engine)
    return engine


def _decode_static(model, prompts, max_new_tokens, stop_ids, sampling, compile, max_batch,
                   fused_blocks="auto", pdl="auto") -> list[list[int]]:
    budgets = _check_room(model, prompts, max_new_tokens)
    if max(budgets) <= 0:
        return [[] for _ in prompts]
    need = max(len(p) + g for p, g in zip(prompts, budgets))
    temperature, top_k, top_p, generator = sampling
    engine = _engine_for(model, min(len(prompts), max_batch), need, compile, greedy=temperature == 0,
                         max_slots=max_batch, fused_blocks=fused_blocks, pdl=pdl)
    return engine.run(prompts, budgets, temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids,
                      generator=generator)


def _decode_cached(model, prompts, max_new_tokens, device, stop_ids, sampling) -> list[list[int]]:
    ctx = model.context_length
    lens = [len(p) for p in prompts]
    budgets = _check_room(model, prompts, max_new_tokens)
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
        _record(outs, done, budgets, nxt.tolist(), stop_ids)
        if all(done):
            break
        # Finished rows keep being fed (their output is ignored); clamping keeps their
        # positions inside the RoPE table.
        pos = next_pos.clamp(max=ctx - 1)[:, None]  # (B, 1)
        logits = model(nxt[:, None], pos, cache)[:, -1]
        next_pos += 1
    return outs


def _decode_uncached(model, prompts, max_new_tokens, device, stop_ids, sampling) -> list[list[int]]:
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
        _record(outs, done, budgets, nxt, stop_ids)
        for s, t in zip(seqs, nxt):
            s.append(t)
    return outs
