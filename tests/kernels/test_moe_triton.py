"""The MoE grouped-GEMM kernels against float64 torch, forward and backward.

On CPU these run the kernels under TRITON_INTERPRET=1 where triton is installed, else the ops'
torch path (one matmul per expert block); `pytest -m gpu` runs the kernels on CUDA."""

import pytest
import torch

from scratchlm.kernels.moe_triton import ALIGN, grouped_swiglu, grouped_swiglu_reference, moe_expert_grad, moe_rows
from scratchlm.kernels.triton_support import interpreting, triton_available
from scratchlm.model.moe import MoEFFN, block_layout, expert_capacity

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(N, E, k, capacity=None, empty=(), seed=0, device="cpu"):
    """A layout of N tokens' k choices over E experts (none routed to `empty`), as MoEFFN builds it,
    and what grouped_swiglu takes: row_token, offs, kept, token_rows."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    scores = torch.rand(N, len(allowed), generator=g)
    flat_expert = allowed[scores.topk(k, dim=1).indices].t().reshape(-1).to(device)
    lay = block_layout(flat_expert, E, capacity, ALIGN)
    row_token = torch.where(lay.filled, lay.assign_of % N, -1).to(torch.int32)
    token_rows = torch.where(lay.keep, lay.row, -1).view(k, N)
    return lay, row_token, token_rows


CASES = [  # (N, D, F, E, k, capacity, experts given no token)
    (70, 32, 48, 4, 2, None, ()),
    (90, 40, 36, 5, 2, None, (1, 3)),  # D and F not multiples of the tiles; empty experts
    (130, 64, 32, 3, 1, 20, ()),  # a capacity: dropped assignments, blocks cut to 20 rows
    (300, 16, 24, 8, 3, None, (0,)),  # a block longer than ALIGN rows
]


def _tensors(N, D, F, E, dtype, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(device)
    w1, w3 = ((torch.randn(E, F, D, generator=g) / D ** 0.5).to(device=device, dtype=dtype) for _ in range(2))
    w2 = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(device=device, dtype=dtype)
    return x, w1, w3, w2


def _check(N, D, F, E, k, capacity, empty, dtype, device, tol):
    """grouped_swiglu computing in `dtype` from float32 x and weights (as under autocast), against
    float64; the gradients come back in float32."""
    lay, row_token, token_rows = _routing(N, E, k, capacity, empty, device=device)
    x, w1, w3, w2 = (t.requires_grad_(True) for t in _tensors(N, D, F, E, torch.float32, device=device))
    y = grouped_swiglu(x, row_token, lay.offs, lay.kept.to(torch.int32), token_rows, w1, w3, w2, dtype)
    assert y.shape == (row_token.shape[0], D) and y.dtype == dtype
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(y, [x, w1, w3, w2], grad)

    ref_in = [t.detach().to(dtype).double().requires_grad_(True) for t in (x, w1, w3, w2)]
    ref = grouped_swiglu_reference(ref_in[0], row_token, lay.offs, torch.cat(ref_in[1:3], dim=1), ref_in[3])
    ref_grads = torch.autograd.grad(ref, ref_in, grad.double())
    assert torch.all(y[row_token < 0] == 0)
    scale = ref.abs().max()
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * scale.item())
    for name, got, want in zip(("x", "w1", "w3", "w2"), grads, ref_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("case", CASES)
def test_float32_matches_float64(case):
    _check(*case, torch.float32, "cpu", 1e-4)


def test_bfloat16_compute_from_float32_activations_and_weights():
    # as under autocast: float32 x and master weights, the matmuls in bf16
    _check(90, 40, 36, 5, 2, None, (1,), torch.bfloat16, "cpu", 3e-2)


def test_the_kernels_ran():
    # under the interpreter the kernels themselves ran above; say so rather than pass silently
    if not (triton_available() and interpreting()):
        pytest.skip("the kernels run on CUDA or under TRITON_INTERPRET=1 with triton installed")


def test_expert_grad_sums_only_the_kept_rows_of_each_block():
    lay, row_token, _ = _routing(60, 4, 2, capacity=18)
    P = row_token.shape[0]
    a = torch.randn(P, 8)
    b = torch.randn(60, 6)
    first, rest = moe_expert_grad(a, b, row_token, lay.offs, lay.kept.to(torch.int32), gather_b=True, split=3,
                                  out_dtype=torch.float64)
    assert first.shape == (4, 3, 6) and rest.shape == (4, 5, 6) and first.dtype == torch.float64
    got = torch.cat([first, rest], dim=1)
    starts = [0, *lay.offs[:-1].tolist()]
    for e in range(4):
        rows = torch.arange(starts[e], starts[e] + int(lay.kept[e]))
        want = a[rows].double().t() @ b[row_token[rows].long()].double()
        torch.testing.assert_close(got[e], want, rtol=1e-5, atol=1e-5)
    assert int(lay.kept.max()) == 18


def test_rows_store_multiplies_each_block_by_its_expert():
    lay, row_token, _ = _routing(50, 3, 1, empty=(1,))
    P = row_token.shape[0]
    a = torch.randn(P, 24)
    w = torch.randn(3, 10, 24)
    (c, h) = moe_rows(a, row_token, lay.offs, w)
    assert c.shape == (P, 10) and h.numel() == 0
    starts = [0, *lay.offs[:-1].tolist()]
    for e, (s, t) in enumerate(zip(starts, lay.offs.tolist())):
        want = a[s:t] @ w[e].t()
        filled = row_token[s:t] >= 0
        torch.testing.assert_close(c[s:t][filled], want[filled], rtol=1e-5, atol=1e-5)
        assert torch.all(c[s:t][~filled] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("case", CASES + [(4096, 768, 1536, 8, 2, None, ()), (2000, 256, 384, 8, 2, 300, (5,))])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_matches_float64(case, dtype, tol):
    _check(*case, dtype, "cuda", tol)


def _untied(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(N,) tokens whose k + 1 largest logits are all different: their top-k choice does not depend
    on how a tie is broken (torch.topk and the routing kernel break ties their own ways)."""
    top = logits.float().topk(k + 1, dim=-1).values
    return (top[:, :-1] > top[:, 1:]).all(dim=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("capacity_factor, autocast", [(None, False), (1.0, False), (None, True)])
def test_moe_layer_on_the_kernels_compiles_and_matches_grouped_mm(capacity_factor, autocast):
    torch._dynamo.reset()
    torch.manual_seed(0)
    # torch._grouped_mm takes bf16 on CUDA: in float32 the per-expert matmuls are the reference
    ref = MoEFFN(256, 384, 8, 2, capacity_factor=capacity_factor, gemm="grouped_mm" if autocast else "portable",
                 device="cuda")
    moe = MoEFFN(256, 384, 8, 2, capacity_factor=capacity_factor, gemm="triton", device="cuda")
    moe.load_state_dict(ref.state_dict())
    x = torch.randn(4, 500, 256, device="cuda")
    outs = []
    for module in (ref, torch.compile(moe, fullgraph=True)):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = module(xi)
            logits = ref.router(xi.reshape(-1, 256))
        y.float().square().mean().backward()
        outs.append((y.float().reshape(-1, 256), xi.grad.reshape(-1, 256), (ref if module is ref else moe).w1.grad))
    if capacity_factor:
        assert expert_capacity(2000, 8, 2, capacity_factor) == 500
    same = _untied(logits, 2)
    assert same.float().mean() > 0.9
    for i, (got, want) in enumerate(zip(outs[1], outs[0])):
        if i < 2:  # per token: where the routing cannot differ
            got, want = got[same], want[same]
        tol = 3e-2 if autocast else 1e-4
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_moe_layer_on_the_kernels_compiles_in_one_graph():
    # The ops' bodies are their own fake kernels under torch.compile: nothing in them may sync.
    if interpreting():
        pytest.skip("under TRITON_INTERPRET=1 the kernels are interpreted functions, not compilable")
    torch._dynamo.reset()
    torch.manual_seed(0)
    moe = MoEFFN(32, 48, 4, 2, capacity_factor=1.0, gemm="triton")
    x = torch.randn(2, 50, 32)
    want = moe(x)
    got = torch.compile(moe, fullgraph=True)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wants", ["x", "w1", "w2"])
def test_backward_computes_only_the_gradients_asked_for(wants):
    lay, row_token, token_rows = _routing(70, 4, 2)
    tensors = _tensors(70, 32, 48, 4, torch.float32)
    for name, t in zip(("x", "w1", "w3", "w2"), tensors):
        t.requires_grad_(name == wants)
    inputs = [t for t in tensors if t.requires_grad]
    y = grouped_swiglu(tensors[0], row_token, lay.offs, lay.kept.to(torch.int32), token_rows, *tensors[1:])
    grads = torch.autograd.grad(y.square().sum(), inputs)
    ref_in = [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]
    ref = grouped_swiglu_reference(ref_in[0], row_token, lay.offs, torch.cat(ref_in[1:3], dim=1), ref_in[3])
    want = torch.autograd.grad(ref.square().sum(), [t for t in ref_in if t.requires_grad])
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
