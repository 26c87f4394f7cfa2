import pytest
import torch

from scratchlm.kernels import fused_linear_cross_entropy as flce
from scratchlm.kernels.cross_entropy_triton import cross_entropy_rows, cross_entropy_rows_supported


def test_unsupported_inputs_are_refused_with_a_message():
    logits = torch.randn(4, 10)
    assert not cross_entropy_rows_supported(logits)  # a CPU tensor
    with pytest.raises(ValueError, match="cross_entropy_rows needs triton and a CUDA"):
        cross_entropy_rows(logits, torch.zeros(4, dtype=torch.long), torch.ones(4))


@pytest.mark.parametrize("vocab", [4097, 10_000, 32_000, 50_257, 151_936])
def test_loop_steps_pad_rows_little(vocab):
    from scratchlm.kernels.cross_entropy_triton import _BLOCK, _SMALL_BLOCK, _loop_block

    block, warps = _loop_block(vocab)
    padded = {b: -(-vocab // b) * b for b in (_BLOCK, _SMALL_BLOCK)}
    assert padded[block] <= 1.05 * min(padded.values())
    assert block // warps == 512  # 16 entries per thread in either case
    assert block == _BLOCK or padded[_BLOCK] > 1.05 * padded[_SMALL_BLOCK]  # 4096 unless it pads much more


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 1000, 4096, 4097, 10_000, 32_000, 50_257])  # one block, the two-pass loop
def test_gpu_matches_the_eager_chunk_math(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 37
    logits = (torch.randn(rows, vocab, generator=g) * 4).to("cuda", dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g).cuda()
    valid = (torch.rand(rows, generator=g) > 0.25).cuda()
    n_valid = valid.sum().float()
    ref_loss, ref_grad = flce._chunk_loss_and_grad_eager(logits.clone(), targets, valid, n_valid,
                                                          torch.float32, dtype)
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    buffer = logits.clone()
    loss, grad = cross_entropy_rows(buffer, safe, valid.float() / n_valid)
    assert grad.data_ptr() == buffer.data_ptr() and grad.dtype == dtype  # in place
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    tol = dict(rtol=2e-2, atol=1e-4) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, **tol)
    assert (grad[~valid] == 0).all()
    torch.testing.assert_close(grad[valid].float().sum(dim=1), torch.zeros(int(valid.sum()), device="cuda"),
                               atol=1e-3 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.gpu
def test_gpu_strided_rows_and_the_fused_head_use_the_kernel(monkeypatch):
    calls = []
    real = cross_entropy_rows
    monkeypatch.setattr("scratchlm.kernels.cross_entropy_triton.cross_entropy_rows",
                        lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 64, generator=g).cuda().requires_grad_()
    weight = (torch.randn(5000, 64, generator=g) / 8).cuda().requires_grad_()
    targets = torch.randint(0, 5000, (300,), generator=g).cuda()
    targets[::7] = -100
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, chunk_size=128)
    assert len(calls) == 3
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    ref = torch.nn.functional.cross_entropy(hidden @ weight.t(), targets, ignore_index=-100)
    rh, rw = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-5)
    # rows with a larger stride (a column slice of a wider buffer) are read and written in place
    wide = torch.randn(5, 300, device="cuda")
    view = wide[:, :250]
    before = wide[:, 250:].clone()
    t = torch.randint(0, 250, (5,), device="cuda")
    ref_loss, ref_grad = flce._chunk_loss_and_grad_eager(view.clone(), t, torch.ones(5, dtype=torch.bool, device="cuda"),
                                                          torch.tensor(5.0, device="cuda"), torch.float32, torch.float32)
    loss, grad = real(view, t, torch.full((5,), 0.2, device="cuda"))
    torch.testing.assert_close((loss, grad), (ref_loss, ref_grad), rtol=1e-5, atol=1e-6)
    assert torch.equal(wide[:, 250:], before)
