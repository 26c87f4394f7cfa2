"""The MoE routing and layout kernels against the torch functions they replace
(`scratchlm.model.moe.route` and `block_layout`), and their gradient against autograd's.

On CPU these run the kernels under TRITON_INTERPRET=1 where triton is installed, else the op's
torch path (then only the hand-written backward is under test); `pytest -m gpu` runs them on CUDA."""

import pytest
import torch

from scratchlm.kernels.moe_route_triton import BLOCK_T, _torch_route, route_and_layout
from scratchlm.kernels.triton_support import interpreting, triton_available
from scratchlm.model.moe import buffer_rows

CASES = [  # (tokens, experts, top_k, capacity or None, renormalize)
    (300, 8, 2, None, True),  # three blocks of tokens: the counts carry across blocks
    (130, 5, 1, 20, False),  # experts not a power of two; a capacity that drops
    (257, 6, 3, 40, True),
    (50, 3, 3, None, False),  # every expert chosen
    (2 * BLOCK_T, 16, 4, 70, True),
]


def _check(N, E, k, capacity, renormalize, device, dtype=torch.float32):
    torch.manual_seed(N + E)
    logits = (torch.randn(N, E) * 3).to(device=device, dtype=dtype).requires_grad_(True)
    got = route_and_layout(logits, k, renormalize, capacity, 128)
    want = _torch_route(logits, k, renormalize, -1 if capacity is None else capacity, 128)
    assert got.row_token.shape == (buffer_rows(N * k, E, 128),)
    for name, a, b in zip(got._fields, got, want):
        if a.is_floating_point():
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    if capacity is not None:
        assert int(got.kept.max()) <= capacity
    grads = (torch.randn(N, E, device=device), torch.randn(N, k, device=device))
    (g1,) = torch.autograd.grad((got.probs * grads[0]).sum() + (got.gates * grads[1]).sum(), logits)
    (g2,) = torch.autograd.grad((want[0] * grads[0]).sum() + (want[1] * grads[1]).sum(), logits)
    assert g1.dtype == dtype
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_matches_the_torch_routing_and_layout(case):
    _check(*case, "cpu")


def test_the_kernels_ran():
    if not (triton_available() and interpreting()):
        pytest.skip("the kernels run on CUDA or under TRITON_INTERPRET=1 with triton installed")


def test_a_tie_goes_to_the_lower_expert():
    if not (triton_available() and interpreting()):
        pytest.skip("the kernel's rule (torch.topk orders ties its own way)")
    logits = torch.zeros(3, 4)
    logits[:, 2] = 1.0  # expert 2 first, then a three-way tie among 0, 1, 3
    r = route_and_layout(logits, 2, True, None, 128)
    assert r.experts.tolist() == [[2, 0]] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("case", CASES + [(32768, 8, 2, None, True), (32768, 8, 2, 10240, True)])
def test_cuda_matches_the_torch_routing_and_layout(case):
    _check(*case, "cuda")


def test_float64_logits_keep_float64_probabilities():
    logits = torch.randn(40, 4, dtype=torch.float64, requires_grad=True)
    r = route_and_layout(logits, 2, True, None, 128)
    assert r.probs.dtype == r.gates.dtype == torch.float64
    (grad,) = torch.autograd.grad(r.gates.sum() + r.probs.square().sum(), logits)
    want = _torch_route(logits, 2, True, -1, 128)
    (ref,) = torch.autograd.grad(want[1].sum() + want[0].square().sum(), logits)
    torch.testing.assert_close(grad, ref)
