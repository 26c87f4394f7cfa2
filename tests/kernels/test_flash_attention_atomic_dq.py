"""The five-matmul backward (`set_backward_dq("atomic")`): the dK/dV kernel also adds dS·K into a float32
dQ, and no dQ kernel runs. Its gradients must be the recomputing backward's, in every mode the
kernels have (causal or not, grouped-query heads, sliding windows, ragged lengths, the packed
q|k|v gradient with RoPE undone).

The kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1; elsewhere only the switch's
checks run.
"""

import pytest
import torch

from scratchlm.kernels import flash_attention_triton as fa
from scratchlm.kernels.triton_support import interpreting, triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not triton_available() or (DEVICE == "cpu" and not interpreting()),
                                   reason="the kernels run on CUDA or under TRITON_INTERPRET=1")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / (b.double().norm() + 1e-12)).item()


def test_the_mode_is_recompute_unless_set_and_refuses_unknown_names():
    assert fa.backward_dq() == "recompute"
    with pytest.raises(ValueError, match="'recompute' or 'atomic', got 'atomics'"):
        fa.set_backward_dq("atomics")
    assert fa.backward_dq() == "recompute"
    assert fa.set_backward_dq("atomic") == "recompute"  # the mode it replaces
    assert fa.set_backward_dq("recompute") == "atomic" and fa.backward_dq() == "recompute"
    with pytest.raises(RuntimeError), fa.using_backward_dq("atomic"):
        assert fa.backward_dq() == "atomic"
        raise RuntimeError("the block fails")
    assert fa.backward_dq() == "recompute"


def test_deterministic_algorithms_keep_the_recomputing_backward():
    # an earlier test may have left the mode on (seed_everything sets it for the whole process)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        with fa.using_backward_dq("atomic"):
            assert fa._atomic_dq_selected()
            torch.use_deterministic_algorithms(True)
            assert not fa._atomic_dq_selected()
        torch.use_deterministic_algorithms(False)
        assert not fa._atomic_dq_selected()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_unrotate_is_the_gradient_of_the_rotation():
    from scratchlm.model.rope import apply_rope

    torch.manual_seed(0)
    B, H, T, D = 2, 3, 5, 8
    angles = torch.rand(B, T, D // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    x, g = torch.randn(B, H, T, D, requires_grad=True), torch.randn(B, H, T, D)
    (expected,) = torch.autograd.grad(apply_rope(x, cos[:, None], sin[:, None]), x, g)
    torch.testing.assert_close(fa._unrotate(g, cos, sin), expected)
    (expected,) = torch.autograd.grad(apply_rope(x, cos[0], sin[0]), x, g)  # tables shared by the batch
    torch.testing.assert_close(fa._unrotate(g, cos[0], sin[0]), expected)


# (B, H, Hkv, T, D, causal, window): ragged lengths, head dims below a tile and padded (24)
CASES = [(1, 2, 2, 70, 32, True, None), (2, 2, 2, 64, 16, False, None), (1, 4, 2, 50, 32, True, None),
         (1, 2, 1, 90, 32, True, 17), (1, 2, 2, 33, 24, True, None), (2, 3, 3, 129, 64, False, None)]


@needs_kernels
@pytest.mark.parametrize("B,H,Hkv,T,D,causal,window", CASES)
def test_atomic_dq_gives_the_recomputing_backwards_gradients(B, H, Hkv, T, D, causal, window):
    torch.manual_seed(T)
    q, do = (torch.randn(B, H, T, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(B, Hkv, T, D, device=DEVICE) for _ in range(2))
    o, lse = fa._forward_triton(q, k, v, causal, window)
    expected = fa._backward_triton(do, q, k, v, o, lse, causal, window)
    with fa.using_backward_dq("atomic"):
        got = fa._backward_triton(do, q, k, v, o, lse, causal, window)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert _rel(a, b) < 1e-5


@needs_kernels
@pytest.mark.parametrize("per_sequence_positions", [False, True])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_atomic_dq_in_the_packed_qkv_backward_with_rope(per_sequence_positions, kv_heads):
    from scratchlm.model.rope import RotaryEmbedding

    torch.manual_seed(1)
    B, T, H, D = 2, 45, 2, 16
    positions = torch.arange(T).expand(B, T) + torch.arange(B)[:, None] * 3 if per_sequence_positions \
        else torch.arange(T)
    cos, sin = RotaryEmbedding(10_000.0, D, 256, device=DEVICE).tables(positions.to(DEVICE))
    qkv = torch.randn(B, T, (H + 2 * kv_heads) * D, device=DEVICE, requires_grad=True)
    g = torch.randn(B, H, T, D, device=DEVICE)

    def grad():
        out = fa.flash_attention_qkv(qkv, H, cos, sin, True, kv_heads)
        return torch.autograd.grad(out, qkv, g)[0]

    expected = grad()
    with fa.using_backward_dq("atomic"):
        got = grad()
    assert got.shape == qkv.shape
    assert _rel(got, expected) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_atomic_dq_autotuned_bf16_matches_the_recomputing_backward(causal, head_dim):
    # T = 1024 in bf16 takes the autotuned tiles: the atomic kernel's trials zero its dQ buffer
    torch.manual_seed(0)
    q, do = (torch.randn(2, 4, 1024, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 4, 1024, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o, lse = fa._forward_triton(q, k, v, causal, None)
    expected = fa._backward_triton(do, q, k, v, o, lse, causal, None)
    with fa.using_backward_dq("atomic"):
        got = fa._backward_triton(do, q, k, v, o, lse, causal, None)
        again = fa._backward_triton(do, q, k, v, o, lse, causal, None)
    for a, b, c in zip(got, expected, again):
        assert _rel(a, b) < 1e-2 and _rel(c, b) < 1e-2
