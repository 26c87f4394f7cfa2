"""The one-kernel SwiGLU feed-forward of a few decode rows (RMSNorm, w1|w3, gate, w2, residual)
against a float64 formula and the model's own modules.

On CPU these run the kernel under TRITON_INTERPRET=1 where triton is installed, else the op's
torch path; `pytest -m gpu` runs the kernel on CUDA."""

import pytest
import torch

from scratchlm.kernels import decode_ffn_triton as mod
from scratchlm.kernels.decode_ffn_triton import decode_ffn, decode_ffn_reference
from scratchlm.kernels.decode_linear_triton import MAX_ROWS
from scratchlm.kernels.triton_support import interpreting, triton_available
from scratchlm.model.layers import RMSNorm, SwiGLU

CASES = [  # (rows, D, F, norm)
    (1, 48, 40, True),  # 20 programs in groups of 8: the last group short
    (3, 80, 300, False),  # 75 programs, 5 groups; rows not a power of two, D not a multiple of the tile
    (MAX_ROWS, 32, 72, True),  # the most rows
    (2, 64, 4, True),  # one program, one group
]


def _tensors(rows, D, F, norm, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, D, generator=g) * (3 if norm else 1)).to(device=device, dtype=dtype)
    w13 = (torch.randn(2 * F, D, generator=g) / D ** 0.5).to(device=device, dtype=dtype)
    w2 = (torch.randn(D, F, generator=g) / F ** 0.5).to(device=device, dtype=dtype)
    nw = (1 + 0.3 * torch.randn(D, generator=g)).to(device=device, dtype=dtype) if norm else None
    return x, w13, w2, nw


def _float64(x, w13, w2, nw, eps=1e-5):
    x, w13, w2 = x.double().cpu(), w13.double().cpu(), w2.double().cpu()
    n = x if nw is None else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * nw.double().cpu()
    gate, up = (n @ w13.t()).chunk(2, dim=-1)
    return x + (gate * torch.sigmoid(gate) * up) @ w2.t()


def _check(device, dtype, atol, cases=CASES):
    """Each case against the float64 formula (bf16: within `atol` plus 2% of the value; its gate
    values reach ~10 without a norm) and a second call (the same bits)."""
    for case in cases:
        x, w13, w2, nw = _tensors(*case, dtype, device)
        got = decode_ffn(x, w13, w2, nw)
        assert got.dtype == dtype and got.shape == x.shape
        rtol = 2e-2 if dtype == torch.bfloat16 else 0
        torch.testing.assert_close(got.double().cpu(), _float64(x, w13, w2, nw), rtol=rtol, atol=atol, msg=str(case))
        assert torch.equal(decode_ffn(x, w13, w2, nw), got), f"not the same bits twice: {case}"


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_decode_ffn_equals_the_float64_formula(dtype, atol):
    _check("cpu", dtype, atol)


def test_the_reference_is_the_models_own_block_half():
    """x + SwiGLU(RMSNorm(x)), as a pre-norm block's second half runs it."""
    x, w13, w2, nw = _tensors(3, 32, 24, True, torch.float32, "cpu")
    norm, ffn = RMSNorm(32, eps=1e-6), SwiGLU(32, 24)
    norm.weight.data.copy_(nw)
    ffn.w1.weight.data.copy_(w13[:24])
    ffn.w3.weight.data.copy_(w13[24:])
    ffn.w2.weight.data.copy_(w2)
    torch.testing.assert_close(decode_ffn_reference(x, w13, w2, nw, 1e-6), x + ffn(norm(x)))


def _needs_kernel():
    if not (triton_available() and interpreting()):
        pytest.skip("the kernel runs on CUDA or under TRITON_INTERPRET=1 with triton installed")


def test_runs_the_kernel_and_leaves_its_counters_at_zero(monkeypatch):
    _needs_kernel()
    launched = []
    kernel = mod._decode_ffn_kernel
    monkeypatch.setattr(mod, "_decode_ffn_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (launched.append(grid), kernel[grid])[1]})())
    x, w13, w2, nw = _tensors(2, 40, 300, True, torch.float32, "cpu")
    torch.testing.assert_close(decode_ffn(x, w13, w2, nw), decode_ffn_reference(x, w13, w2, nw, 1e-5),
                               rtol=0, atol=1e-5)
    assert launched == [(75,)]
    assert not mod._counts(x.device).any()


def test_too_many_hidden_units_a_program_take_two_projection_kernels(monkeypatch):
    monkeypatch.setattr(mod, "MAX_BLOCK_H", 1)
    if triton_available():
        assert mod.ffn_blocks_for(1, 48, 40) is None
    _check("cpu", torch.float32, 1e-4, CASES[:1])


def test_tiles_stay_within_the_budget():
    if not triton_available():
        pytest.skip("tile sizes are chosen with triton's helpers")
    from scratchlm.kernels.decode_linear_triton import TILE_TERMS

    assert mod.ffn_blocks_for(1, 768, 2048)[:5] == (1, 16, 1024, 1024, 16)  # GPT-2-small: 128 programs
    assert mod.ffn_blocks_for(1, 2048, 8192 * 8) is None
    for rows in range(1, MAX_ROWS + 1):
        for d, f in ((768, 2048), (2048, 8192), (64, 40)):
            m, h, k, dd, group, _ = mod.ffn_blocks_for(rows, d, f)
            programs = -(-f // h)
            assert m >= rows and m * h * k <= TILE_TERMS and m * h * dd <= TILE_TERMS
            assert group * group >= programs and h <= mod.MAX_BLOCK_H


def test_bad_shapes_are_refused():
    x, w13, w2, nw = _tensors(2, 16, 8, True, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"x \(M, D\), w13 \(2F, D\), w2 \(D, F\)"):
        decode_ffn(x, w13, w2[:, :4])
    with pytest.raises(ValueError, match="norm_weight must be"):
        decode_ffn(x, w13, w2, nw[:8])


@pytest.mark.gpu
def test_decode_ffn_on_cuda():
    _check("cuda", torch.bfloat16, 0.1)
    _check("cuda", torch.float32, 1e-3)
    _check("cuda", torch.bfloat16, 0.1, [(1, 768, 2048, True), (4, 768, 2048, True)])  # GPT-2-small


@pytest.mark.gpu
def test_decode_ffn_captured_with_pdl_is_the_same_bits():
    """Captured in a CUDA graph, replayed, and launched with PDL where the device has it: the same
    bits as an eager call (the counters reset by every kernel)."""
    from scratchlm.kernels.triton_support import pdl_supported

    x, w13, w2, nw = _tensors(1, 768, 2048, True, torch.bfloat16, "cuda")
    expected = decode_ffn(x, w13, w2, nw)
    pdl = pdl_supported(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = x
        for _ in range(4):
            h = decode_ffn(h, w13, w2, nw, pdl=pdl)
    graph.replay()
    h_eager = x
    for _ in range(4):
        h_eager = decode_ffn(h_eager, w13, w2, nw)
    torch.cuda.synchronize()
    assert torch.equal(h, h_eager)
    assert torch.equal(decode_ffn(x, w13, w2, nw), expected)
