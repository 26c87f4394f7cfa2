import torch

from scratchlm.optim.clip import clip_grad_norm


def _params_with_grads(scale: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(4, 3), (5,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return params


def test_matches_torch_clip_grad_norm_when_clipping_and_not():
    for scale, max_norm in [(10.0, 1.0), (0.01, 1.0), (1.0, 2.5)]:
        ours, ref = _params_with_grads(scale), _params_with_grads(scale)
        n_ours = clip_grad_norm(ours, max_norm)
        n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        torch.testing.assert_close(n_ours, n_ref)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=1e-6)


def test_clipped_norm_is_at_most_the_limit_and_small_grads_are_untouched():
    params = _params_with_grads(10.0)
    clip_grad_norm(params, 1.0)
    total = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    assert 0.999 < total.item() <= 1.0
    small = _params_with_grads(1e-3)
    before = [p.grad.clone() for p in small]
    clip_grad_norm(small, 1.0)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, small))


def test_parameters_without_grad_are_ignored():
    params = _params_with_grads(10.0)
    params.append(torch.nn.Parameter(torch.ones(3)))
    norm = clip_grad_norm(params, 1.0)
    assert norm.item() > 1.0 and params[-1].grad is None
    assert clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0


def test_mixed_dtypes():
    a = torch.nn.Parameter(torch.zeros(4))
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    a.grad, b.grad = torch.full((4,), 3.0), torch.full((4,), 4.0, dtype=torch.float64)
    assert abs(clip_grad_norm([a, b], 1.0).item() - 10.0) < 1e-5


def test_sharded_norm_in_a_world_of_one_is_the_plain_norm():
    """Rebuilding per-tensor norms from all-reduced squares is exact with one rank: sqrt(x²) = x."""
    import torch.distributed as dist

    from scratchlm.optim.clip import global_grad_norm

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for seed in range(20):
            grads = [p.grad for p in _params_with_grads(10.0 ** (seed % 5 - 2), seed)]
            sharded = [True, False, True]
            assert torch.equal(global_grad_norm(grads, sharded=sharded), global_grad_norm(grads)), seed
    finally:
        dist.destroy_process_group()
