import pytest
import torch
import torch.nn.functional as F

from scratchlm.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy


def _case(n, d, v, seed, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, dtype=torch.float64) / d ** 0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    return hidden, weight, targets


def _loss_and_grads(fn, hidden, weight, targets):
    loss = fn(hidden, weight, targets)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    return loss, gh, gw


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 64])
def test_matches_cross_entropy_of_full_logits(chunk_size):
    hidden, weight, targets = _case(37, 16, 50, seed=chunk_size or 0)
    ours = _loss_and_grads(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=chunk_size),
                           hidden, weight, targets)
    ref = _loss_and_grads(lambda h, w, t: F.cross_entropy(h @ w.t(), t), hidden, weight, targets)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_ignore_index_and_leading_dims():
    hidden, weight, targets = _case(24, 8, 30, seed=1)
    targets[::3] = -100
    h3, t3 = hidden.view(2, 12, 8), targets.view(2, 12)
    ours = _loss_and_grads(lambda h, w, t: fused_linear_cross_entropy(h3, w, t3, chunk_size=5), hidden, weight, targets)
    ref = _loss_and_grads(lambda h, w, t: F.cross_entropy(h @ w.t(), t, ignore_index=-100), hidden, weight, targets)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_scales_by_upstream_gradient_and_no_grad_forward():
    hidden, weight, targets = _case(10, 8, 12, seed=2)
    loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=3)
    (3.0 * loss).backward()
    ref_h = hidden.detach().clone().requires_grad_()
    (3.0 * F.cross_entropy(ref_h @ weight.detach().t(), targets)).backward()
    torch.testing.assert_close(hidden.grad, ref_h.grad)
    with torch.no_grad():
        value = fused_linear_cross_entropy(hidden, weight, targets)
    torch.testing.assert_close(value, loss.detach())


def test_float32_with_bfloat16_autocast_close_to_reference():
    hidden, weight, targets = _case(64, 32, 100, seed=3, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _loss_and_grads(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=16),
                               hidden, weight, targets)
    ref = _loss_and_grads(lambda h, w, t: F.cross_entropy(h @ w.t(), t), hidden, weight, targets)
    assert ours[1].dtype == torch.float32 and ours[2].dtype == torch.float32
    for a, b in zip(ours, ref):
        assert ((a - b).norm() / b.norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_reference(dtype):
    hidden, weight, targets = _case(4096, 256, 5000, seed=4, dtype=dtype, device="cuda")
    ours = _loss_and_grads(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=1000),
                           hidden, weight, targets)
    ref = _loss_and_grads(lambda h, w, t: F.cross_entropy((h @ w.t()).float(), t), hidden, weight, targets)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(ours, ref):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < tol


@pytest.mark.gpu
def test_gpu_default_chunks_under_autocast_accumulate_the_weight_gradient_in_the_matmul(monkeypatch):
    from scratchlm.kernels import fused_linear_cross_entropy as flce

    # 40 rows per default (single-pass) chunk: 5 chunks, each adding into the fp32 accumulator.
    monkeypatch.setattr(flce, "_CHUNK_ELEMENTS_SINGLE_PASS", 40 * 5000)
    hidden, weight, targets = _case(200, 64, 5000, seed=5, dtype=torch.float32, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = _loss_and_grads(fused_linear_cross_entropy, hidden, weight, targets)
    ref = _loss_and_grads(lambda h, w, t: F.cross_entropy(h @ w.t(), t), hidden, weight, targets)
    if torch.__version__ >= (2, 8):
        assert flce._addmm_out_dtype  # addmm(out_dtype=float32) ran instead of the bf16 product + add
    for a, b in zip(ours, ref):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 2e-2


def test_fusable_chunk_math_matches_in_place_version():
    from scratchlm.kernels.fused_linear_cross_entropy import (
        _chunk_loss_and_grad_eager,
        _chunk_loss_and_grad_fusable,
    )

    logits = torch.randn(9, 20, dtype=torch.float64)
    targets = torch.randint(0, 20, (9,))
    valid = torch.rand(9) > 0.3
    n_valid = valid.sum().to(torch.float64)
    a = _chunk_loss_and_grad_fusable(logits, targets, valid, n_valid, torch.float64, torch.float64)
    b = _chunk_loss_and_grad_eager(logits.clone(), targets, valid, n_valid, torch.float64, torch.float64)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_cpu_chunks_are_sized_for_the_eager_chunk_math(monkeypatch):
    from scratchlm.kernels import fused_linear_cross_entropy as flce

    # The eager math holds float32 copies of a chunk: on CPU the smaller budget applies.
    assert not flce._single_pass_chunks(torch.empty(1))
    monkeypatch.setattr(flce, "_CHUNK_ELEMENTS", 10 * 50)
    sizes = []
    real = flce._chunk_loss_and_grad
    monkeypatch.setattr(flce, "_chunk_loss_and_grad", lambda logits, *a: sizes.append(len(logits)) or real(logits, *a))
    hidden, weight, targets = _case(35, 8, 50, seed=2, dtype=torch.float32, device="cpu")
    fused_linear_cross_entropy(hidden, weight, targets).backward()
    assert sizes == [10, 10, 10, 5]
