"""Attention of one new query per row over a static KV cache, reading only each row's own keys.

In a decode step every row attends from its newest token to the keys in its cache: positions
0 .. pos (or, with a sliding window of w, pos - w + 1 .. pos). torch's fused attention reads a
window of L slots for every row, the longest row's, and masks the rest; at batch 64 on an H100
cuDNN's kernel took 39% of a GPT-2-small decode step (docs/benchmarks/decode_attention.md) at about a
third of the memory bandwidth. Here one program per (row, query head) walks its row's keys in
tiles of BLOCK_N with an online softmax (running max and sum, in float32) and reads nothing
past the row's position, so short rows of a ragged batch cost only what they hold. Where rows x
heads are too few programs to fill the GPU (batch 1: 12 for GPT-2), each row's keys are split
among 8 programs, and where they are a few hundred with long rows, among 4 (`splits_for`; a
split past the row's keys has nothing to do); a second small kernel combines the splits'
partial results (max, sum, unnormalised output). With grouped-query attention each query
head's program reads its kv head's keys: a program serving all the query heads of a kv head
(keys read once for the group) measured 1.5-4x slower on an H100 at every batch
(docs/benchmarks/decode_attention.md), so there is none.

``decode_attention(q, k, v, pos, window)``: q (b, H, 1, d), k and v (b, Hkv, L, d) (views of the
cache buffers, unit stride in d), pos (b,) the position of each row's newest key (< L); query
head h reads kv head h // (H / Hkv), as `grouped_sdpa`. Returns (b, H, 1, d) in k's dtype, the
softmax scale 1 / √d (torch's default). It is the op ``scratchlm::decode_attention`` (a
``triton_op`` where torch has it: torch.compile launches the kernel from its own code and CUDA
graphs capture it); on tensors Triton cannot run it computes the same with torch's fused
attention and a mask built from pos.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from scratchlm.kernels.triton_support import can_use_triton as _can_use_triton
from scratchlm.kernels.triton_support import device_of as _device
from scratchlm.kernels.triton_support import pdl_launch_options
from scratchlm.kernels.triton_support import register_op as _register
from scratchlm.kernels.triton_support import tl, triton, wrap_triton

__all__ = ["attention_output", "attention_partials", "attention_splits", "decode_attention",
           "decode_attention_reference", "runs_on_triton"]

BLOCK_N = 64  # keys a tile

if triton is not None:

    @triton.jit
    def _key_range(POS, row, L, window, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLITS: tl.constexpr):
        """Keys [lo, hi) of `row` this program reads: the row's (window of) keys, or this split's
        share of them in whole tiles; and the split's index."""
        pos = tl.load(POS + row)
        hi = tl.minimum(pos + 1, L)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        split = tl.program_id(2).to(tl.int64)
        if SPLITS > 1:
            chunk = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
            lo = lo + split * chunk
            hi = tl.minimum(lo + chunk, hi)
        return lo, hi, split

    @triton.jit
    def _decode_attention_kernel(Q, K, V, O, POS, M, LSUM, ACC, L, window, num_heads,
                                 stride_qb, stride_qh, stride_kb, stride_kh, stride_kn,
                                 stride_vb, stride_vh, stride_vn, stride_ob, stride_oh,
                                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                 BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLITS: tl.constexpr,
                                 QK_SCALE: tl.constexpr, PARTIALS: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # launched while the kernel before runs: the next may start too; wait before reading
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        kv_head = head // GROUP
        lo, hi, split = _key_range(POS, row, L, window, BLOCK_N, HAS_WINDOW, SPLITS)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + row * stride_qb + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
        q = q * QK_SCALE  # scale and log2(e) folded in: the softmax runs in base 2
        k_base = K + row * stride_kb + kv_head * stride_kh
        v_base = V + row * stride_vb + kv_head * stride_vh
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
        l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            tile_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + n[:, None] * stride_kn + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1)
            s = tl.where(n_ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            v = tl.load(v_base + n[:, None] * stride_vn + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        if SPLITS == 1 and not PARTIALS:
            out = acc / l_i
            tl.store(O + row * stride_ob + head * stride_oh + d, out.to(O.dtype.element_ty), mask=d_ok)
        else:  # the split's running max, sum and unnormalised output, for _combine_splits or the
            # kernel that reads them (`attention_partials`; an empty split: -inf, 0, 0)
            idx = (row * num_heads + head) * SPLITS + split
            tl.store(M + idx, m_i)
            tl.store(LSUM + idx, l_i)
            tl.store(ACC + idx * BLOCK_D + d, acc)

    @triton.jit
    def _combine_splits(M, LSUM, ACC, O, num_heads, stride_ob, stride_oh,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        idx = (row * num_heads + head) * SPLITS + tl.arange(0, SPLITS)
        d = tl.arange(0, BLOCK_D)
        m = tl.load(M + idx)
        weight = tl.exp2(m - tl.max(m, axis=0))  # 0 for an empty split (m = -inf)
        total = tl.sum(weight * tl.load(LSUM + idx), axis=0)
        acc = tl.load(ACC + idx[:, None] * BLOCK_D + d[None, :])
        out = tl.sum(weight[:, None] * acc, axis=0) / total
        tl.store(O + row * stride_ob + head * stride_oh + d, out.to(O.dtype.element_ty), mask=d < HEAD_DIM)


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                               window: int = 0) -> torch.Tensor:
    """The op's result by torch's fused attention over the masked window (the formula it computes)."""
    b, H, _, d = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    slot = torch.arange(L, device=q.device)
    visible = slot <= pos[:, None]
    if window > 0:
        visible = visible & (slot > pos[:, None] - window)
    out = F.scaled_dot_product_attention(q.reshape(b, Hkv, H // Hkv, d).to(k.dtype), k, v,
                                         attn_mask=visible[:, None, None, :])
    return out.reshape(b, H, 1, d)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    b, H, T, d = q.shape
    if T != 1 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or H % k.shape[1]:
        raise ValueError(f"decode_attention: q (b, H, 1, d) and k, v (b, Hkv, L, d) with Hkv dividing H; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if pos.shape != (b,):
        raise ValueError(f"decode_attention: pos must be (b,) = ({b},), got {tuple(pos.shape)}")


# Where rows x heads are fewer than FEW_PROGRAMS programs, each row's keys are split among
# SPLITS_WHEN_FEW programs; where they are fewer than SOME_PROGRAMS and each row may hold
# LONG_ROW keys or more, among SPLITS_WHEN_LONG (on an H100, 256 programs walking 1,024 keys
# each took 0.73x SDPA's time: docs/benchmarks/decode_attention.md). Fixed numbers, not a
# function of the batch: in the engine's compiled step the batch and the window are symbolic
# sizes, and each comparison below becomes one guard (a few compiled entries at most), where a
# count computed from them would need their exact values.
FEW_PROGRAMS = 128
SPLITS_WHEN_FEW = 8
SOME_PROGRAMS = 512
LONG_ROW = 512
SPLITS_WHEN_LONG = 4
# Where the count may follow the window's length (`by_keys`: a kernel launched with concrete
# sizes, from an opaque op, never traced with symbolic ones): one row's keys split in about
# one program a KEYS_A_SPLIT keys, at most SPLITS_WHEN_FEW. On an H100, GPT-2-small's fused
# layer at one row took 17.7 us with 1 split of 64 keys against 23.0 with 8, 20.7 with 4 splits
# of 192 keys against 23.4, and was fastest with 8 at 320 and 1,024 keys
# (docs/benchmarks/decode_linear.md). 0 turns it off.
KEYS_A_SPLIT = 64


def splits_for(b: int, H: int, keys: int = 0, by_keys: bool = False) -> int:
    """How many programs share one (row, head)'s at most `keys` keys: 1 where the b·H programs
    fill the GPU and each walks few enough keys; with `by_keys` at one row, about one program a
    KEYS_A_SPLIT keys (see above)."""
    if b * H < FEW_PROGRAMS:
        if by_keys and b == 1 and KEYS_A_SPLIT > 0:
            return min(SPLITS_WHEN_FEW, triton.next_power_of_2(-(-keys // KEYS_A_SPLIT)))
        return SPLITS_WHEN_FEW
    if b * H < SOME_PROGRAMS and keys >= LONG_ROW:
        return SPLITS_WHEN_LONG
    return 1


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int, partials: bool,
            pdl: bool = False,
            by_keys: bool = False) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Run the attention kernel: (out or None, m, lsum, acc, splits). With `partials` the splits'
    partial results are kept (one split or more) and not combined: out is None. `pdl`: launch it
    with programmatic dependent launch where supported (from an opaque op only: torch.compile's
    tracing of a triton_op does not pass the launch option on); `by_keys` as for `splits_for`
    (from an opaque op only too)."""
    b, H, _, d = q.shape
    L = k.shape[2]
    out = None if partials else torch.empty((b, H, 1, d), dtype=k.dtype, device=k.device)
    qk_scale = math.log2(math.e) / math.sqrt(d)
    block_d = triton.next_power_of_2(d)
    Hkv = k.shape[1]
    group = H // Hkv
    splits = attention_splits(q, k, window, by_keys)
    # the splits' partial results (unused, one element each, where the kernel writes out itself)
    keep = splits > 1 or partials
    parts = b * H * splits if keep else 1
    m = torch.empty(parts, dtype=torch.float32, device=k.device)
    lsum = torch.empty(parts, dtype=torch.float32, device=k.device)
    acc = torch.empty(parts * (block_d if keep else 1), dtype=torch.float32, device=k.device)
    o = m if out is None else out  # a pointer the kernel does not write to with partials
    args = (q, k, v, o, pos, m, lsum, acc, L, window, H,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0) if out is not None else 0,
            o.stride(1) if out is not None else 0)
    common = dict(HEAD_DIM=d, BLOCK_D=block_d, HAS_WINDOW=window > 0, SPLITS=splits, QK_SCALE=qk_scale)
    with _device(k):
        grid = lambda meta: (b, H, meta["SPLITS"])  # noqa: E731 (a function of the launch metadata, as torch.compile traces it)
        wrap_triton(_decode_attention_kernel)[grid](*args, GROUP=group, BLOCK_N=BLOCK_N, PARTIALS=partials,
                                                    num_warps=4, **common, **pdl_launch_options(pdl, k))
        if splits > 1 and not partials:
            combine_grid = lambda meta: (b, H)  # noqa: E731
            wrap_triton(_combine_splits)[combine_grid](m, lsum, acc, out, H, out.stride(0), out.stride(1),
                                                       HEAD_DIM=d, BLOCK_D=block_d, SPLITS=splits, num_warps=1)
    return out, m, lsum, acc, splits


def attention_splits(q: torch.Tensor, k: torch.Tensor, window: int, by_keys: bool = False) -> int:
    """How many splits the kernel runs for q (b, H, 1, d) over k (b, Hkv, L, d) (`splits_for` of
    its b·H programs, one per row and query head, and the keys a row may read)."""
    L = k.shape[2]
    return splits_for(q.shape[0], q.shape[1], L if window <= 0 else min(L, window), by_keys)


def attention_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int,
                     pdl: bool = False, by_keys: bool = False) -> torch.Tensor:
    """The kernel's combined output (b, H, 1, d) in k's dtype, as `decode_attention` returns it,
    launched with `pdl` and `by_keys` as `_launch` does. Needs `runs_on_triton`."""
    _check(q, k, v, pos)
    return _launch(q, k, v, pos, window, partials=False, pdl=pdl, by_keys=by_keys)[0]


def runs_on_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel runs on these tensors (else the op takes torch's path)."""
    return _can_use_triton(k) and k.stride(3) == 1 and v.stride(3) == 1 and q.stride(3) == 1


def attention_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int,
                       pdl: bool = False,
                       by_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The kernel's uncombined result, for a kernel that combines the splits as it reads them:
    (m, lsum, acc, splits), the running max (base 2), sum and unnormalised output (b·H·splits
    float32 values, and b·H·splits rows of next_power_of_2(d) for acc) of split s of row r and
    head h at index (r·H + h)·splits + s. The output is acc / lsum of one split; of several,
    Σ wₛ accₛ / Σ wₛ lsumₛ with wₛ = 2^(mₛ - maxₛ mₛ). Needs `runs_on_triton`; `pdl` and `by_keys`
    as `_launch`."""
    _check(q, k, v, pos)
    _, m, lsum, acc, splits = _launch(q, k, v, pos, window, partials=True, pdl=pdl, by_keys=by_keys)
    return m, lsum, acc, splits


def _decode_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                           window: int) -> torch.Tensor:
    _check(q, k, v, pos)
    if not runs_on_triton(q, k, v):
        return decode_attention_reference(q, k, v, pos, window)
    return _launch(q, k, v, pos, window, partials=False)[0]


def _decode_attention_fake(q, k, v, pos, window):
    return torch.empty((q.shape[0], q.shape[1], 1, q.shape[3]), dtype=k.dtype, device=k.device)


_decode_attention_op = _register("scratchlm::decode_attention", _decode_attention_impl, _decode_attention_fake)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     window: int | None = None) -> torch.Tensor:
    """Softmax attention of q (b, H, 1, d) over each row's keys 0 .. pos[row] (the last `window`
    of them with a sliding window) in k, v (b, Hkv, L, d): (b, H, 1, d) in k's dtype."""
    return _decode_attention_op(q, k, v, pos, int(window or 0))
