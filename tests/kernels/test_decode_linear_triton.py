"""The decode projection kernel (RMSNorm, matmul, SwiGLU gate, residual add in one) against the
model's own modules and a float64 formula.

On CPU these run the kernel under TRITON_INTERPRET=1 where triton is installed, else the op's
torch path; `pytest -m gpu` runs the kernel on CUDA."""

import pytest
import torch

from scratchlm.kernels.decode_linear_triton import MAX_ROWS, decode_linear, decode_linear_reference
from scratchlm.kernels.triton_support import interpreting, triton_available
from scratchlm.model.functional import silu
from scratchlm.model.layers import RMSNorm

CASES = [  # (rows, K, N, norm, residual, gate_up)
    (1, 48, 40, True, False, False),  # a norm and an odd number of outputs a program
    (3, 80, 24, False, True, False),  # residual add, K not a multiple of the tile
    (1, 64, 2 * 36, True, False, True),  # SwiGLU gate over stacked w1|w3
    (5, 40, 2 * 20, True, True, True),  # everything at once, rows not a power of two
    (MAX_ROWS, 32, 2100, False, False, False),  # the widest program, the most rows
]


def _tensors(rows, K, N, norm, residual, gate_up, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, K, generator=g) * 3).to(device=device, dtype=dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device=device, dtype=dtype)
    nw = (1 + 0.3 * torch.randn(K, generator=g)).to(device=device, dtype=dtype) if norm else None
    out_n = N // 2 if gate_up else N
    r = torch.randn(rows, out_n, generator=g).to(device=device, dtype=dtype) if residual else None
    return x, w, nw, r


def _float64(x, w, nw, r, eps, gate_up):
    """The same math in float64, each step as the model's modules do it."""
    x, w = x.double(), w.double()
    if nw is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * nw.double()
    y = x @ w.t()
    if gate_up:
        gate, up = y.chunk(2, dim=-1)
        y = gate * torch.sigmoid(gate) * up
    return y if r is None else y + r.double()


def _check(device, dtype, atol):
    for case in CASES:
        x, w, nw, r = _tensors(*case, dtype, device)
        got = decode_linear(x, w, nw, r, 1e-5, case[-1])
        assert got.dtype == dtype and got.shape == (case[0], case[2] // 2 if case[-1] else case[2])
        expected = _float64(x.cpu(), w.cpu(), None if nw is None else nw.cpu(), None if r is None else r.cpu(),
                            1e-5, case[-1])
        torch.testing.assert_close(got.double().cpu(), expected, rtol=0, atol=atol, msg=str(case))


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_decode_linear_equals_the_float64_formula(dtype, atol):
    _check("cpu", dtype, atol)


def test_the_reference_is_the_models_own_modules():
    """RMSNorm, then a matmul, then silu(gate) · up or the residual add, as a pre-norm block runs them."""
    x, w, nw, r = _tensors(3, 32, 2 * 16, True, True, True, torch.float32, "cpu")
    norm = RMSNorm(32, eps=1e-6)
    norm.weight.data.copy_(nw)
    gate, up = (norm(x) @ w.t()).chunk(2, dim=-1)
    torch.testing.assert_close(decode_linear_reference(x, w, nw, r, 1e-6, True), r + silu(gate) * up)


def test_runs_the_kernel_where_it_can():
    if not (triton_available() and interpreting()):
        pytest.skip("the kernel runs on CUDA or under TRITON_INTERPRET=1 with triton installed")
    from scratchlm.kernels import decode_linear_triton as mod

    x, w, nw, r = _tensors(2, 40, 2 * 20, True, True, True, torch.float32, "cpu")
    torch.testing.assert_close(mod._decode_linear_impl(x, w, nw, r, 1e-5, True, False),
                               decode_linear_reference(x, w, nw, r, 1e-5, True), rtol=0, atol=1e-5)


def test_more_rows_than_a_program_takes_use_the_torch_path():
    x, w, nw, r = _tensors(MAX_ROWS + 1, 16, 8, True, True, False, torch.float32, "cpu")
    torch.testing.assert_close(decode_linear(x, w, nw, r), decode_linear_reference(x, w, nw, r))


def test_bad_shapes_are_refused():
    x, w, nw, r = _tensors(2, 16, 8, True, True, False, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"x \(M, K\) and w \(N, K\)"):
        decode_linear(x, w[:, :8])
    with pytest.raises(ValueError, match="norm_weight must be"):
        decode_linear(x, w, nw[:8])
    with pytest.raises(ValueError, match="residual must be"):
        decode_linear(x, w, residual=r[:, :4])


@pytest.mark.gpu
def test_decode_linear_on_cuda():
    _check("cuda", torch.bfloat16, 0.1)
    _check("cuda", torch.float32, 1e-3)  # TF32-free float32 products, summed in another order


def test_tiles_hold_a_whole_row_at_batch_1_and_stay_within_the_budget():
    if not triton_available():
        pytest.skip("tile sizes are chosen with triton's helpers")
    from scratchlm.kernels.decode_linear_triton import TILE_TERMS, blocks_for

    assert blocks_for(1, 2304, 768, False)[1:3] == (2, 1024)  # GPT-2-small q|k|v: K in one tile
    assert blocks_for(1, 768, 2048, False)[1:3] == (4, 2048)  # w2
    for rows in range(1, MAX_ROWS + 1):
        for outputs, inputs, gate_up in ((2304, 768, False), (2048, 768, True), (768, 8192, False)):
            m, n, k, _ = blocks_for(rows, outputs, inputs, gate_up)
            assert m >= rows and m * n * k <= TILE_TERMS


QKV_CASES = [  # (rows, K, heads, kv heads, head dim, norm)
    (1, 48, 4, 4, 8, True),
    (3, 40, 4, 2, 16, False),  # grouped-query attention
    (MAX_ROWS, 32, 2, 1, 6, True),  # a head dim whose pairs do not split in two
]


def _qkv_tensors(rows, K, H, Hkv, d, norm, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, K, generator=g) * 2).to(dtype)
    w = (torch.randn((H + 2 * Hkv) * d, K, generator=g) / K ** 0.5).to(dtype)
    nw = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype) if norm else None
    angles = torch.rand(40, d // 2, generator=g) * 6  # float32 tables, as RotaryEmbedding keeps them
    pos = torch.randint(0, 30, (rows,), generator=g)
    caches = [torch.randn(rows + 1, Hkv, 31, d, generator=g).to(dtype) for _ in range(2)]
    return x, w, nw, angles.cos(), angles.sin(), pos, caches


def _qkv_float64(x, w, nw, cos, sin, pos, H, Hkv, d):
    """q, k, v (rows, heads, d) in float64: the projection, then each interleaved pair rotated."""
    y = _float64(x, w, nw, None, 1e-5, False)
    q, k, v = y.split((H * d, Hkv * d, Hkv * d), dim=-1)
    c, s = cos[pos].double()[:, None], sin[pos].double()[:, None]

    def rotate(t, heads):
        t = t.reshape(len(pos), heads, d // 2, 2)
        return torch.stack((t[..., 0] * c - t[..., 1] * s, t[..., 0] * s + t[..., 1] * c), dim=-1).flatten(-2)

    return rotate(q, H), rotate(k, Hkv), v.reshape(len(pos), Hkv, d)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_decode_qkv_rotates_q_and_writes_k_and_v_at_each_rows_position(dtype, atol):
    from scratchlm.kernels.decode_linear_triton import decode_qkv

    for rows, K, H, Hkv, d, norm in QKV_CASES:
        x, w, nw, cos, sin, pos, (k_cache, v_cache) = _qkv_tensors(rows, K, H, Hkv, d, norm, dtype)
        before = [k_cache.clone(), v_cache.clone()]
        q = decode_qkv(x, w, nw, 1e-5, cos, sin, pos, k_cache, v_cache, H)
        eq, ek, ev = _qkv_float64(x, w, nw, cos, sin, pos, H, Hkv, d)
        at = torch.arange(rows)
        case = str((rows, K, H, Hkv, d, norm))
        torch.testing.assert_close(q.double().reshape(rows, H, d), eq, rtol=0, atol=atol, msg=case)
        torch.testing.assert_close(k_cache[at, :, pos].double(), ek, rtol=0, atol=atol, msg=case)
        torch.testing.assert_close(v_cache[at, :, pos].double(), ev, rtol=0, atol=atol, msg=case)
        for cache, old in zip((k_cache, v_cache), before):  # nothing else written
            cache[at, :, pos] = old[at, :, pos]
            assert torch.equal(cache, old), case


def test_decode_qkv_reference_is_the_models_rope():
    from scratchlm.kernels.decode_linear_triton import decode_qkv_reference
    from scratchlm.model.rope import RotaryEmbedding

    rope = RotaryEmbedding(10_000.0, 8, 40)
    x, w, nw, _, _, pos, (k_cache, v_cache) = _qkv_tensors(3, 32, 4, 2, 8, True, torch.float32)
    q = decode_qkv_reference(x, w, nw, 1e-5, rope.cos, rope.sin, pos, k_cache, v_cache, 4)
    normed = decode_linear_reference(x, w[:32], nw, None, 1e-5).reshape(3, 4, 1, 8)  # q's rows, (rows, H, T=1, d)
    torch.testing.assert_close(q.reshape(3, 4, 1, 8), rope(normed, pos[:, None, None]))


ATTENTION_CASES = [  # (b, H, Hkv, max_len, L, d, window, N): the splits attention_partials picks
    (1, 4, 4, 80, 70, 16, 0, 24),  # batch 1: two splits of a 70-key window (one a 64 keys)
    (1, 4, 2, 40, 33, 16, 0, 24),  # batch 1, a short window: one split
    (3, 4, 2, 200, 192, 12, 0, 40),  # grouped-query attention, a head dim that is not a power of two
    (2, 2, 1, 150, 130, 16, 37, 8),  # sliding window
    (MAX_ROWS, 16, 4, 40, 33, 8, 0, 16),  # rows x heads enough programs: one split each
]


def _check_attention_linear(device, dtype, atol):
    from scratchlm.kernels.decode_linear_triton import decode_attention_linear
    from tests.kernels.test_decode_attention_triton import _case, _loop_reference

    for b, H, Hkv, max_len, L, d, window, N in ATTENTION_CASES:
        q, k, v, pos = _case(b, H, Hkv, max_len, L, d, dtype, device)
        g = torch.Generator().manual_seed(1)
        w = (torch.randn(N, H * d, generator=g) / (H * d) ** 0.5).to(device=device, dtype=dtype)
        r = torch.randn(b, N, generator=g).to(device=device, dtype=dtype)
        got = decode_attention_linear(q, k, v, pos, window, w, r)
        a = _loop_reference(q.cpu(), k.cpu(), v.cpu(), pos.cpu(), window).reshape(b, H * d).to(device)
        expected = a @ w.double().t() + r.double()
        assert got.shape == (b, N) and got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=atol, msg=str((b, H, Hkv, L, d, window)))
        torch.testing.assert_close(decode_attention_linear(q, k, v, pos, window, w).double(),
                                   expected - r.double(), rtol=0, atol=atol, msg="without the residual")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_decode_attention_linear_equals_attention_then_the_projection_in_float64(dtype, atol):
    _check_attention_linear("cpu", dtype, atol)


@pytest.mark.gpu
def test_decode_attention_linear_on_cuda():
    _check_attention_linear("cuda", torch.bfloat16, 0.1)
    _check_attention_linear("cuda", torch.float32, 1e-3)


def test_the_projection_combines_the_attention_splits_only_at_one_row_or_one_split():
    from scratchlm.kernels.decode_linear_triton import combines_in_projection

    def shapes(b, H, keys):
        return torch.empty(b, H, 1, 64, device="meta"), torch.empty(b, H, keys, 64, device="meta")

    assert combines_in_projection(*shapes(1, 12, 320), 0)  # one row, eight splits
    assert not combines_in_projection(*shapes(4, 12, 320), 0)  # GPT-2-small at four rows: split
    assert combines_in_projection(*shapes(4, 32, 320), 0)  # 128 programs: no split
    assert combines_in_projection(*shapes(2, 32, 320), 0) is False  # 64 programs: split


def test_decode_attention_linear_refuses_a_projection_of_another_width():
    from scratchlm.kernels.decode_linear_triton import decode_attention_linear
    from tests.kernels.test_decode_attention_triton import _case

    q, k, v, pos = _case(2, 4, 4, 40, 30, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"w \(N, H·d\)"):
        decode_attention_linear(q, k, v, pos, 0, torch.zeros(8, 31))
    with pytest.raises(ValueError, match=r"residual \(b, N\)"):
        decode_attention_linear(q, k, v, pos, 0, torch.zeros(8, 32), torch.zeros(3, 8))
