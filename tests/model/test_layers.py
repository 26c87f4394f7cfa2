import math

import pytest
import torch
import torch.nn.functional as F

from scratchlm.model.layers import Embedding, Linear, RMSNorm, SiLUFFN, SwiGLU, can_fuse, project_together


def test_linear_shape_and_formula():
    lin = Linear(6, 4)
    assert lin.weight.shape == (4, 6)
    assert [n for n, _ in lin.named_parameters()] == ["weight"]
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


def test_linear_init_scale_and_truncation():
    torch.manual_seed(0)
    lin = Linear(512, 256)
    std = math.sqrt(2 / (512 + 256))
    assert lin.weight.std().item() == pytest.approx(std * 0.9865, rel=0.03)  # truncation at 3σ shrinks std by ~1.3%
    assert lin.weight.abs().max().item() <= 3 * std + 1e-6


def test_linear_device_dtype():
    lin = Linear(3, 5, device="cpu", dtype=torch.float64)
    assert lin.weight.dtype == torch.float64 and lin.weight.device.type == "cpu"


def test_embedding_lookup_and_init():
    torch.manual_seed(0)
    emb = Embedding(1000, 64, dtype=torch.float64)
    assert emb.weight.shape == (1000, 64) and emb.weight.dtype == torch.float64
    ids = torch.randint(0, 1000, (3, 7))
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))
    assert emb.weight.abs().max().item() <= 3.0
    assert emb.weight.std().item() == pytest.approx(0.986, rel=0.03)


def test_embedding_gradient_is_reproducible():
    # Repeated ids (the common case: frequent tokens) must sum their gradients in the same order
    # every time, without torch.use_deterministic_algorithms, so same-seed CPU runs agree bitwise.
    torch.manual_seed(0)
    emb = Embedding(10_000, 128)
    ids = torch.randint(0, 10_000, (16, 128))
    ids[:, :64] = ids[0, 0]
    upstream = torch.randn(16, 128, 128)

    def grad():
        emb.weight.grad = None
        emb(ids).backward(upstream)
        return emb.weight.grad.clone()

    first = grad()
    assert all(torch.equal(first, grad()) for _ in range(10))
    expected = torch.zeros(10_000, 128, dtype=torch.float64).index_add_(0, ids.reshape(-1),
                                                                         upstream.reshape(-1, 128).double())
    torch.testing.assert_close(first.double(), expected, rtol=1e-5, atol=1e-4)


def _torch_rmsnorm(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def test_rmsnorm_matches_torch():
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(2, 3, 16) * 4
    ref = torch.nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
    torch.testing.assert_close(norm(x), ref(x))
    torch.testing.assert_close(norm(x), _torch_rmsnorm(x, norm.weight, 1e-5))


def test_rmsnorm_bf16_returns_input_dtype_and_computes_in_fp32():
    norm = RMSNorm(64, dtype=torch.bfloat16)
    x = (torch.randn(4, 64) * 100).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    expected = _torch_rmsnorm(x, norm.weight, 1e-5)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert out.float().pow(2).mean(-1).sub(1).abs().max() < 0.02


def test_swiglu_formula():
    ffn = SwiGLU(8, 24, dtype=torch.float64)
    assert [n for n, _ in ffn.named_parameters()] == ["w1.weight", "w2.weight", "w3.weight"]
    assert ffn.w1.weight.shape == (24, 8) and ffn.w2.weight.shape == (8, 24) and ffn.w3.weight.shape == (24, 8)
    x = torch.randn(3, 8, dtype=torch.float64)
    ref = F.linear(F.silu(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)
    torch.testing.assert_close(ffn(x), ref)


def test_silu_ffn_formula():
    ffn = SiLUFFN(8, 32, dtype=torch.float64)
    assert [n for n, _ in ffn.named_parameters()] == ["w1.weight", "w2.weight"]
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(ffn(x), F.linear(F.silu(F.linear(x, ffn.w1.weight)), ffn.w2.weight))


def test_linear_init_std_override():
    torch.manual_seed(0)
    lin = Linear(512, 256, init_std=0.01)
    assert lin.weight.std().item() == pytest.approx(0.01 * 0.9865, rel=0.03)
    assert lin.weight.abs().max().item() <= 0.03 + 1e-6
    lin.reset_parameters()  # a reset keeps the override
    assert lin.weight.abs().max().item() <= 0.03 + 1e-6


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _saved_bytes(fn) -> int:
    """Bytes of distinct storages autograd saves while running fn()."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_project_together_is_each_projection_with_the_same_gradients():
    torch.manual_seed(0)
    a, b = Linear(32, 48), Linear(32, 16)
    x = torch.randn(2, 5, 32, requires_grad=True)
    with _bf16():
        ya, yb = project_together(x, (a, b))
        ref_a, ref_b = a(x), b(x)
    assert ya.shape == (2, 5, 48) and yb.shape == (2, 5, 16) and ya.dtype == torch.bfloat16
    torch.testing.assert_close((ya, yb), (ref_a, ref_b))
    gya, gyb = torch.randn_like(ya), torch.randn_like(yb)
    grads = torch.autograd.grad((ya * gya).sum() + (yb * gyb).sum(), (x, a.weight, b.weight))
    ref = torch.autograd.grad((ref_a * gya).sum() + (ref_b * gyb).sum(), (x, a.weight, b.weight))
    assert [g.dtype for g in grads] == [torch.float32] * 3
    torch.testing.assert_close(grads, ref)


def test_project_together_concatenated_is_one_output_with_the_same_gradients():
    torch.manual_seed(0)
    a, b = Linear(32, 48), Linear(32, 16)
    x = torch.randn(2, 5, 32, requires_grad=True)
    with _bf16():
        y = project_together(x, (a, b), concatenated=True)
        ref = torch.cat([a(x), b(x)], dim=-1)
    assert y.shape == (2, 5, 64) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref)
    gy = torch.randn_like(y)
    grads = torch.autograd.grad((y * gy).sum(), (x, a.weight, b.weight))
    ref_grads = torch.autograd.grad((ref * gy).sum(), (x, a.weight, b.weight))
    assert [g.dtype for g in grads] == [torch.float32] * 3
    # one bf16 matmul against the concatenated weight rounds x's gradient once, not per projection
    torch.testing.assert_close(grads, ref_grads, rtol=2e-2, atol=2e-2)


def test_fused_swiglu_trains_like_the_separate_one():
    torch.manual_seed(0)
    fused = SwiGLU(32, 64)
    separate = SwiGLU(32, 64, fused=False)
    separate.load_state_dict(fused.state_dict())
    x = torch.randn(3, 4, 32)
    calls = []
    for ffn in (fused, separate):
        ffn.w3.forward = lambda t, _m=ffn.w3: calls.append(1) or Linear.forward(_m, t)
    with _bf16():
        outs = [ffn(x) for ffn in (fused, separate)]
    assert len(calls) == 1  # under autocast only the separate SwiGLU called w3 as a module
    torch.testing.assert_close(outs[0], outs[1])
    for out in outs:
        out.float().square().sum().backward()
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, dict(separate.named_parameters())[name].grad, msg=name)
    fused(x)
    assert len(calls) == 2  # in full precision the projections stay separate (no weight copy saved)


def test_fused_swiglu_saves_no_more_than_the_separate_one():
    torch.manual_seed(0)
    fused, separate = SwiGLU(32, 64), SwiGLU(32, 64, fused=False)
    for x in (torch.randn(8, 32), torch.randn(8, 32, requires_grad=True)):  # a first layer's input, an activation
        with _bf16():
            assert _saved_bytes(lambda: fused(x)) <= _saved_bytes(lambda: separate(x))
    separate.w1.weight.requires_grad_(False)
    separate.w3.weight.requires_grad_(False)
    fused.load_state_dict(separate.state_dict())
    fused.w1.weight.requires_grad_(False)
    fused.w3.weight.requires_grad_(False)
    x = torch.randn(8, 32, requires_grad=True)
    with _bf16():  # frozen projections: only the input gradient
        assert _saved_bytes(lambda: fused(x)) <= _saved_bytes(lambda: separate(x))
        out = fused(x)
        ref = separate(x)
    gx, = torch.autograd.grad(out.float().sum(), x)
    rx, = torch.autograd.grad(ref.float().sum(), x)
    torch.testing.assert_close(gx, rx)


def test_can_fuse_only_plain_unhooked_linears_in_mixed_precision_training():
    a, b, x = Linear(4, 4), Linear(4, 4), torch.randn(2, 4)
    assert not can_fuse(x, a, b)  # full precision: the concatenated weight would be an extra saved copy
    with _bf16():
        assert can_fuse(x, a, b)
        with torch.no_grad():
            assert not can_fuse(x, a, b)  # decoding reads each weight once: no concatenation

        class Wrapped(Linear):
            pass

        assert not can_fuse(x, a, Wrapped(4, 4))
        handle = b.register_forward_pre_hook(lambda m, args: None)
        assert not can_fuse(x, a, b)
        handle.remove()
        handle = a.register_forward_hook(lambda m, args, out: None)
        assert not can_fuse(x, a, b)
        handle.remove()
        assert can_fuse(x, a, b)


def test_a_hooked_projection_is_still_called_as_a_module():
    ffn = SwiGLU(8, 16)
    seen = []
    ffn.w1.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    with _bf16():
        ffn(torch.randn(2, 8))
    assert seen == [torch.Size([2, 16])]


def test_relu2_ffn_is_w2_of_squared_relu_of_w1():
    from scratchlm.model.layers import ReLU2FFN

    torch.manual_seed(0)
    ffn = ReLU2FFN(8, 12)
    assert sorted(n for n, _ in ffn.named_parameters()) == ["w1.weight", "w2.weight"]
    x = torch.randn(2, 5, 8, requires_grad=True)
    expected = F.linear(F.relu(F.linear(x, ffn.w1.weight)) ** 2, ffn.w2.weight)
    torch.testing.assert_close(ffn(x), expected)
    # gradients through the kink and the square, against torch's own
    g = torch.randn(2, 5, 8)
    (ours,) = torch.autograd.grad(ffn(x), x, g)
    (ref,) = torch.autograd.grad(expected, x, g)
    torch.testing.assert_close(ours, ref)


def test_softcap_bounds_logits_and_is_near_identity_when_small():
    from scratchlm.model.layers import SoftcappedLinear, softcap

    x = torch.tensor([-1000.0, -30.0, -0.01, 0.0, 0.01, 30.0, 1000.0])
    y = softcap(x, 15.0)
    torch.testing.assert_close(y, 15.0 * torch.tanh(x / 15.0))
    assert y.abs().max() <= 15.0 and y[3] == 0 and abs(y[4] - 0.01) < 1e-8
    assert softcap(x.bfloat16(), 15.0).dtype == torch.bfloat16
    torch.manual_seed(0)
    head = SoftcappedLinear(4, 6, cap=2.0)
    h = torch.randn(3, 4) * 10
    torch.testing.assert_close(head(h), 2.0 * torch.tanh(F.linear(h, head.weight) / 2.0))
    assert [n for n, _ in head.named_parameters()] == ["weight"]
