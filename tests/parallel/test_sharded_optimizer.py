"""ZeRO-1 optimizer-state sharding."""

from __future__ import annotations

import pytest
import torch

import dist_workers


@pytest.mark.distributed
def test_zero1_adamw_is_bit_identical_and_halves_the_state(distributed_results, references):
    ref = references[("toy", False, 0.0)]
    rank0, rank1 = distributed_results["wrappers"]["toy-zero1"]
    for name, expected in ref["params"].items():
        assert torch.equal(rank0["params"][name], expected), name
        assert torch.equal(rank1["params"][name], expected), name
    model = dist_workers.build("toy")
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad and p is not model.unused)
    # AdamW keeps two moments per parameter; each rank holds about half of them.
    state = [rank0["local_state_numel"], rank1["local_state_numel"]]
    assert sum(state) == 2 * trained
    assert max(state) < 0.75 * 2 * trained


def test_world_of_one_matches_the_wrapped_optimizer(world_of_one):
    from scratchlm.optim.adamw import AdamW
    from scratchlm.parallel.sharded_optimizer import ShardedOptimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    sharded = ShardedOptimizer(params[:2], AdamW, lr=0.1, weight_decay=0.1)
    plain = AdamW(twins[:2], lr=0.1, weight_decay=0.1)
    sharded.add_param_group({"params": [params[2]], "lr": 0.05})
    plain.add_param_group({"params": [twins[2]], "lr": 0.05})
    for _ in range(3):
        for p, q in zip(params, twins, strict=True):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        sharded.param_groups[0]["lr"] *= 0.5  # a schedule edits the full groups
        plain.param_groups[0]["lr"] *= 0.5
        sharded.step()
        plain.step()
    for p, q in zip(params, twins, strict=True):
        assert torch.equal(p, q)
    # The consolidated state has the layout of the wrapped optimizer's own state dict.
    full = sharded.consolidated_state_dict()
    expected = plain.state_dict()
    assert full["state"].keys() == expected["state"].keys()
    for i in expected["state"]:
        for key, value in expected["state"][i].items():
            assert torch.equal(torch.as_tensor(full["state"][i][key]), torch.as_tensor(value))
    assert [g["lr"] for g in full["param_groups"]] == [g["lr"] for g in expected["param_groups"]]
    # Per-rank state dicts round-trip, and refuse another rank's shard.
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = ShardedOptimizer(copies[:2], AdamW, lr=0.1)
    again.add_param_group({"params": [copies[2]]})
    again.load_state_dict(sharded.state_dict())
    assert again.param_groups[0]["lr"] == sharded.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="cannot load"):
        again.load_state_dict({**sharded.state_dict(), "rank": 1, "world_size": 2})
