"""The decode LM head kernel (logits and the greedy argmax in two kernels) against torch.

On CPU the kernel runs under TRITON_INTERPRET=1 where triton is installed (else the op's torch
path); `pytest -m gpu` runs it on CUDA."""

import pytest
import torch

from scratchlm.kernels.decode_head_triton import decode_head, decode_head_reference
from scratchlm.kernels.decode_linear_triton import MAX_ROWS, decode_linear_reference
from scratchlm.kernels.triton_support import interpreting, triton_available

needs_kernel = pytest.mark.skipif(not (triton_available() and interpreting()),
                                  reason="the kernel runs on CUDA or under TRITON_INTERPRET=1 with triton installed")

CASES = [  # (rows, K, vocab, padded vocab, norm): K never a power of two, vocab never a whole number of blocks
    (1, 48, 37, 48, True),
    (3, 80, 101, 112, False),
    (MAX_ROWS, 40, 70, 72, True),
    (MAX_ROWS, 24, 53, 53, False),  # no padding rows
]


def _tensors(rows, K, vocab, padded, norm, dtype, device="cpu", seed=0):
    """x, w and the norm's weight; w's padding rows hold large values that would win the argmax
    if they were read."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, K, generator=g) * 3).to(device=device, dtype=dtype)
    w = torch.randn(padded, K, generator=g) / K ** 0.5
    w[vocab:] = 50.0 * x[0].sign().float().cpu()
    nw = (1 + 0.3 * torch.randn(K, generator=g)).to(device=device, dtype=dtype) if norm else None
    return x, w.to(device=device, dtype=dtype), nw


def _effective_x(x, nw):
    """x as the product sees it (normalised, scaled by the norm's weight): signs only matter here."""
    return x.float() if nw is None else x.float() * nw.float()


def _check(x, w, vocab, nw, atol, case):
    logits, argmax = decode_head(x, w, vocab, nw)
    assert logits.shape == (x.shape[0], vocab) and logits.dtype == torch.float32, case
    assert argmax.shape == (x.shape[0],) and argmax.dtype == torch.int64, case
    expected = decode_linear_reference(x, w, nw)[:, :vocab].float()
    # sums in another order: planted maxima of a few hundred may differ in their last bit (a bf16 ulp is 2^-7 of it)
    rtol = 1e-6 if w.dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(logits, expected, rtol=rtol, atol=atol, msg=lambda m: f"{case}: {m}")
    assert torch.equal(argmax, logits.argmax(-1)), case  # exactly torch's pick over the op's own logits
    return logits, argmax


def _run_cases(device, dtype, atol):
    for case in CASES:
        x, w, nw = _tensors(*case, dtype, device)
        _check(x, w, case[2], nw, atol, case)


@needs_kernel
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.07)])
def test_logits_and_argmax_equal_torchs(dtype, atol):
    _run_cases("cpu", dtype, atol)


def _plant(x, w, nw, row, at, scale=1.0):
    """Make w's row `at` the one that matches x's row `row` best: a clear maximum of that row."""
    w[at] = (scale * _effective_x(x[row], nw).sign()).to(w.dtype)


@needs_kernel
@pytest.mark.parametrize("norm", [False, True])
def test_ties_give_the_first_index_within_and_across_blocks(norm):
    from scratchlm.kernels.decode_head_triton import head_blocks_for

    rows, K, vocab, padded = 3, 40, 150, 160
    block_n = head_blocks_for(rows, vocab, K)[1]
    for dtype in (torch.float32, torch.bfloat16):
        x, w, nw = _tensors(rows, K, vocab, padded, norm, dtype)
        # row 0: equal maxima in one block; row 1: in two blocks; row 2: in the last, partial block
        pairs = [(block_n + 3, block_n + 5), (7, 7 + 2 * block_n), (vocab - 3, vocab - 1)]
        for row, (first, second) in enumerate(pairs):
            _plant(x, w, nw, row, first)
            w[second] = w[first]
        logits, argmax = _check(x, w, vocab, nw, 1e-5 if dtype == torch.float32 else 0.07, (norm, dtype))
        for row, (first, second) in enumerate(pairs):
            assert logits[row, first] == logits[row, second] == logits[row].max()
        assert argmax.tolist() == [first for first, _ in pairs]


@needs_kernel
def test_a_maximum_in_the_last_partial_block_and_nan_as_torch_counts_it():
    rows, K, vocab, padded = MAX_ROWS, 56, 83, 96
    x, w, nw = _tensors(rows, K, vocab, padded, True, torch.float32)
    _plant(x, w, nw, 0, vocab - 1)  # the last column, alone in its block's valid part
    _plant(x, w, nw, 1, vocab - 2)
    w[11] = float("nan")  # every row's product with row 11 is NaN: torch's argmax picks it
    w[40] = float("nan")
    logits, argmax = decode_head(x, w, vocab, nw)
    assert argmax.tolist() == [11] * rows and torch.equal(argmax, logits.argmax(-1))
    w[11] = w[40] = 0.0
    logits, argmax = _check(x, w, vocab, nw, 1e-5, "last block")
    assert argmax[:2].tolist() == [vocab - 1, vocab - 2]


@needs_kernel
def test_the_argmax_kernel_walks_many_partials_in_chunks(monkeypatch):
    """More partial maxima than one tile of the argmax kernel (a large vocabulary's case)."""
    from scratchlm.kernels import decode_head_triton as mod

    monkeypatch.setattr(mod, "_argmax_block", lambda partials: (4, 1))
    monkeypatch.setattr(mod, "head_blocks_for", lambda rows, vocab, inputs: (4, 2, 64, 1))
    rows, K, vocab, padded = 3, 36, 61, 64  # 31 partials a row, 8 chunks of 4
    x, w, nw = _tensors(rows, K, vocab, padded, False, torch.float32)
    for row, (first, second) in enumerate([(2, 9), (33, 34), (58, 60)]):
        _plant(x, w, nw, row, first)
        w[second] = w[first]
    _, argmax = _check(x, w, vocab, nw, 1e-5, "chunks")
    assert argmax.tolist() == [2, 33, 58]


def test_the_torch_path_on_cpu_and_past_max_rows():
    """Without the interpreter CPU tensors take the torch path; so do more rows than a program takes."""
    for rows in (2, MAX_ROWS + 1):
        x, w, nw = _tensors(rows, 16, 30, 32, True, torch.float32)
        _plant(x, w, nw, 0, 29)
        logits, argmax = decode_head(x, w, 30, nw)
        expected, expected_at = decode_head_reference(x, w, 30, nw)
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
        assert torch.equal(argmax, logits.argmax(-1)) and argmax[0] == 29 == expected_at[0]


def test_the_reference_is_the_projection_then_argmax():
    x, w, nw = _tensors(2, 16, 30, 32, True, torch.bfloat16)
    logits, argmax = decode_head_reference(x, w, 30, nw, 1e-6)
    expected = decode_linear_reference(x, w, nw, eps=1e-6)[:, :30].float()
    assert logits.dtype == torch.float32 and logits.is_contiguous() and torch.equal(logits, expected)
    assert torch.equal(argmax, expected.argmax(-1))


def test_bad_shapes_are_refused_in_one_line():
    x, w, nw = _tensors(2, 16, 30, 32, True, torch.float32)
    for call, match in [(lambda: decode_head(x, w[:, :8], 30), r"x \(M, K\), w \(V_pad, K\)"),
                        (lambda: decode_head(x, w, 33), "vocab 33"),
                        (lambda: decode_head(x, w, 0), "vocab 0"),
                        (lambda: decode_head(x[0], w, 30), r"got \(16,\)"),
                        (lambda: decode_head(x, w, 30, nw[:8]), "norm_weight must be")]:
        with pytest.raises(ValueError, match=match) as error:
            call()
        assert "\n" not in str(error.value)


def test_tiles_stay_within_the_budget():
    if not triton_available():
        pytest.skip("tile sizes are chosen with triton's helpers")
    from scratchlm.kernels.decode_head_triton import head_blocks_for
    from scratchlm.kernels.decode_linear_triton import TILE_TERMS
    from scratchlm.kernels.triton_support import triton

    assert head_blocks_for(1, 50_257, 768)[1:] == (32, 256, 2)  # GPT-2, one row: the swept tiles, 1,571 programs
    assert head_blocks_for(2, 50_257, 768)[1] == 16  # more rows: the first guess, 3,142 programs
    assert head_blocks_for(1, 128_256, 2048)[1:3] == (8, 2048)  # Llama-3.2-1B: 16,032 programs
    for rows in range(1, MAX_ROWS + 1):
        for vocab, inputs in ((50_257, 768), (128_256, 2048), (5, 40)):
            m, n, k, _ = head_blocks_for(rows, vocab, inputs)
            assert m >= rows and m * n * k <= TILE_TERMS and n <= triton.next_power_of_2(vocab)


@pytest.mark.gpu
def test_decode_head_on_cuda():
    _run_cases("cuda", torch.bfloat16, 0.07)
    _run_cases("cuda", torch.float32, 1e-3)  # TF32-free float32 products, summed in another order
    x, w, nw = _tensors(1, 768, 50_257, 50_304, True, torch.bfloat16, "cuda")
    _plant(x, w, nw, 0, 50_256)
    _, argmax = _check(x, w, 50_257, nw, 0.07, "GPT-2's head")
    assert argmax.item() == 50_256


@pytest.mark.gpu
def test_decode_head_with_pdl_equals_without():
    x, w, nw = _tensors(4, 2048, 128_256, 128_256, False, torch.bfloat16, "cuda")
    plain, with_pdl = decode_head(x, w, 128_256), decode_head(x, w, 128_256, pdl=True)
    assert torch.equal(plain[0], with_pdl[0]) and torch.equal(plain[1], with_pdl[1])
