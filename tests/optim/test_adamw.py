import copy

import pytest
import torch

from scratchlm.optim.adamw import AdamW, param_groups


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))


def _train(model, opt, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 7, generator=gen)
        y = torch.randn(16, 5, generator=gen)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw_over_many_steps(foreach, weight_decay):
    ours, ref = _model(), _model()
    kwargs = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    _train(ours, AdamW(ours.parameters(), foreach=foreach, **kwargs), 200)
    _train(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **kwargs), 200)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_foreach_and_single_paths_agree_bitwise():
    a, b = _model(), _model()
    _train(a, AdamW(a.parameters(), lr=1e-2, foreach=False), 50)
    _train(b, AdamW(b.parameters(), lr=1e-2, foreach=True), 50)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_param_groups_with_their_own_hyperparameters_match_torch():
    ours, ref = _model(), _model()

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 1e-2, "weight_decay": 0.5},
                {"params": m[2].parameters()}]

    _train(ours, AdamW(groups(ours), lr=1e-3, weight_decay=0.01), 60)
    _train(ref, torch.optim.AdamW(groups(ref), lr=1e-3, weight_decay=0.01, foreach=False), 60)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_state_dict_round_trip_continues_identically():
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, 10)
    clone = copy.deepcopy(model)
    clone_opt = AdamW(clone.parameters(), lr=123.0)  # hyperparameters come from the state dict
    clone_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert clone_opt.param_groups[0]["lr"] == 1e-2
    _train(model, opt, 10, seed=5)
    _train(clone, clone_opt, 10, seed=5)
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a, b)


def test_loads_a_torch_adamw_state_dict():
    ours, ref = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    _train(ref, ref_opt, 5)
    ours.load_state_dict(ref.state_dict())
    opt = AdamW(ours.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # torch shares tensors otherwise
    assert all(isinstance(s["step"], int) and s["step"] == 5 for s in opt.state.values())
    _train(ref, ref_opt, 5, seed=9)
    _train(ours, opt, 5, seed=9)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_parameters_without_grad_are_skipped_and_keep_no_state():
    model = _model()
    frozen = torch.nn.Parameter(torch.ones(3))
    opt = AdamW([*model.parameters(), frozen], lr=1e-2, weight_decay=0.5)
    _train(model, opt, 3)
    assert frozen not in opt.state and torch.equal(frozen, torch.ones(3))


def test_invalid_hyperparameters_raise():
    p = [torch.nn.Parameter(torch.zeros(1))]
    for kwargs in ({"lr": -1.0}, {"betas": (1.0, 0.9)}, {"eps": -1.0}, {"weight_decay": -0.1}):
        with pytest.raises(ValueError):
            AdamW(p, **kwargs)


def test_param_groups_excludes_vectors_from_decay():
    model = _model()
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(p.ndim == 2 for p in groups[0]["params"])
    assert all(p.ndim == 1 for p in groups[1]["params"])
    assert len(param_groups(model, 0.1, decay_vectors=True)) == 1
