import pytest
import torch

from scratchlm.kernels.rope_triton import rope_qk
from scratchlm.kernels.triton_support import interpreting, triton_available
from scratchlm.model.rope import RotaryEmbedding

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _tables(B, T, d, per_sequence, device):
    rope = RotaryEmbedding(10_000.0, d, 4 * T, device=device)
    positions = torch.randint(0, 4 * T, (B, T), device=device) if per_sequence else torch.arange(T, device=device)
    return rope.tables(positions), rope, positions


def _check(B, T, H, d, dtype, device, per_sequence):
    # Against RotaryEmbedding applied per head in float64, then rounded to the dtype once.
    torch.manual_seed(B * T + H * d)
    qkv = torch.randn(B, T, 3 * H * d, device=device, dtype=dtype)
    (cos, sin), rope, positions = _tables(B, T, d, per_sequence, device)
    out = rope_qk(qkv, cos, sin, H)
    assert out.shape == (B, T, 2 * H * d) and out.dtype == dtype and out.is_contiguous()
    heads = qkv.double().unflatten(-1, (3 * H, d)).transpose(1, 2)  # (B, 3H, T, d)
    pos = positions.unsqueeze(1) if per_sequence else positions
    ref = rope(heads[:, : 2 * H], pos).transpose(1, 2).flatten(-2)  # (B, T, 2·H·d)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("B,T,H,d", [(2, 5, 3, 8), (1, 9, 2, 6), (2, 16, 12, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matches_rotary_embedding(B, T, H, d, per_sequence, dtype):
    # bfloat16 runs the kernel itself under TRITON_INTERPRET=1, the torch formula otherwise.
    _check(B, T, H, d, dtype, "cpu", per_sequence)


def test_takes_a_strided_or_odd_offset_qkv():
    B, T, H, d = 2, 6, 2, 8
    big = torch.randn(B, T, 3 * H * d + 1, dtype=torch.bfloat16)
    (cos, sin), _, _ = _tables(B, T, d, False, "cpu")
    for qkv in (big[..., 1:], big[..., :-1]):  # odd storage offset; rows longer than 3·H·d
        torch.testing.assert_close(rope_qk(qkv, cos, sin, H), rope_qk(qkv.contiguous(), cos, sin, H))


def test_rejects_bad_inputs():
    qkv = torch.randn(2, 4, 3 * 2 * 8)
    cos, sin = torch.ones(4, 4), torch.zeros(4, 4)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_qk(torch.randn(2, 4, 7), cos, sin, 2)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_qk(torch.randn(2, 4, 3 * 2 * 5), cos, sin, 2)  # odd head dim
    with pytest.raises(ValueError, match="cos and sin must be"):
        rope_qk(qkv, torch.ones(5, 4), torch.zeros(5, 4), 2)
    with pytest.raises(ValueError, match="float32"):
        rope_qk(qkv, cos.double(), sin.double(), 2)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,T,H,d", [(3, 333, 5, 96), (32, 1024, 12, 64), (1, 7, 2, 128)])
def test_triton_matches_rotary_embedding(B, T, H, d, dtype, per_sequence):
    _check(B, T, H, d, dtype, "cuda", per_sequence)


@pytest.mark.gpu
@needs_triton
def test_triton_kernel_is_launched_from_compiled_code():
    torch._dynamo.reset()
    B, T, H, d = 2, 64, 4, 32
    qkv = torch.randn(B, T, 3 * H * d, device="cuda", dtype=torch.bfloat16)
    (cos, sin), _, _ = _tables(B, T, d, False, "cuda")
    compiled = torch.compile(lambda t: rope_qk(t * 2, cos, sin, H) + 1, fullgraph=True)
    torch.testing.assert_close(compiled(qkv), rope_qk(qkv * 2, cos, sin, H) + 1)


@needs_triton
def test_kernel_compiles_for_sm90():
    # Ahead-of-time compilation to a Hopper cubin needs no GPU.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from scratchlm.kernels import rope_triton

    if interpreting():
        pytest.skip("under TRITON_INTERPRET=1 the kernel is an interpreted function, not compilable")
    fn = rope_triton._rope_qk_bf16_kernel
    meta = dict(PAIRS=768, HALF=32, BLOCK_R=8, BLOCK_P=256)
    pointers = {"QKV": "*bf16", "COS": "*fp32", "SIN": "*fp32", "OUT": "*bf16"}
    signature = {a: "constexpr" if a in meta else pointers.get(a, "i32") for a in fn.arg_names}
    constexprs = {(fn.arg_names.index(k),): v for k, v in meta.items()}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
