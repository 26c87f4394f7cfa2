import pytest
import torch

from scratchlm.kernels.adamw_triton import fused_adamw_supported, triton
from scratchlm.optim.adamw import AdamW, param_groups


def _params(device: str, seed: int = 0) -> list[torch.Tensor]:
    # Sizes that are not multiples of the tile (2048), one smaller than a tile, one of several tiles.
    gen = torch.Generator().manual_seed(seed)
    shapes = [(13, 7), (5,), (2049,), (64, 300), (1,)]
    return [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]


def _run(params, opt, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_fused_request_falls_back_off_cuda():
    # On CPU (or without triton) fused=True must still give exactly the per-parameter update.
    a, b = _params("cpu"), _params("cpu")
    assert not fused_adamw_supported(a)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    _run(a, AdamW(a, fused=True, **kw), 5)
    _run(b, AdamW(b, foreach=False, **kw), 5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.skipif(triton is None, reason="needs triton")
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_matches_torch_adamw_on_cuda(weight_decay):
    ours, ref = _params("cuda"), _params("cuda")
    for p in ours:
        p.grad = torch.zeros_like(p)
    assert fused_adamw_supported(ours)
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt = AdamW(ours, fused=True, **kw)
    _run(ours, opt, 50)
    _run(ref, torch.optim.AdamW(ref, foreach=False, **kw), 50)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(opt.state[p]["step"] == 50 for p in ours)


@pytest.mark.gpu
@pytest.mark.skipif(triton is None, reason="needs triton")
def test_fused_groups_and_state_dict_round_trip():
    model = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.LayerNorm(70), torch.nn.Linear(70, 3)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.LayerNorm(70), torch.nn.Linear(70, 3)).cuda()
    twin.load_state_dict(model.state_dict())
    fused = AdamW(param_groups(model, 0.1), lr=1e-2, fused=True)
    plain = AdamW(param_groups(twin, 0.1), lr=1e-2, foreach=True)
    x = torch.randn(64, 33, device="cuda")
    for step in range(6):
        for m, opt in ((model, fused), (twin, plain)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step == 2:  # a reload in the middle continues the same trajectory
            fused.load_state_dict(fused.state_dict())
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
