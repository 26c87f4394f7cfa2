"""DDP variants: bit-identical to one process on the same global batch (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

import dist_workers

EXACT = ["toy-naive", "toy-flat", "toy-ddp", "toy-ddp_bucketed", "lm-ddp_bucketed-one-bucket"]


def _assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name}: max diff {(expected[name] - got[name]).abs().max()}"


@pytest.mark.distributed
@pytest.mark.parametrize("job", EXACT)
def test_bit_identical_to_single_process(job, distributed_results, references):
    kind = job.split("-")[0]
    # Tied weights (the toy model ties its embedding and head) need the per-half reference.
    ref = references[(kind, kind == "lm", 0.0)]
    rank0, rank1 = distributed_results["wrappers"][job]
    _assert_same(ref["params"], rank0["params"])
    _assert_same(rank0["params"], rank1["params"])
    assert rank0["losses"] == ref["losses"]
    assert rank0["warnings"] == [] and rank1["warnings"] == []


@pytest.mark.distributed
def test_frozen_and_unused_parameters_are_left_alone(distributed_results):
    initial = dist_workers.build("toy")
    for job in ("toy-naive", "toy-flat", "toy-ddp", "toy-ddp_bucketed"):
        params = distributed_results["wrappers"][job][0]["params"]
        assert torch.equal(params["frozen"], initial.frozen.detach())
        assert torch.equal(params["unused"], initial.unused.detach())  # no grad: AdamW skips it
        assert not torch.equal(params["up.weight"], initial.up.weight.detach())


@pytest.mark.distributed
@pytest.mark.parametrize("job", ["lm-ddp-accum", "lm-ddp_bucketed-accum"])
def test_gradient_accumulation_without_no_sync(job, distributed_results, references):
    # Two micro-batches per rank change the matmul shapes, so equality is to rounding only.
    ref = references[("lm", True, 0.0)]
    rank0, rank1 = distributed_results["wrappers"][job]
    for name, expected in ref["params"].items():
        torch.testing.assert_close(rank0["params"][name], expected, atol=1e-5, rtol=0)
        assert torch.equal(rank0["params"][name], rank1["params"][name])


def test_buckets_follow_reverse_parameter_order_and_size(world_of_one):
    from scratchlm.parallel.ddp import DDP

    model = dist_workers.build("toy")
    params = [p for p in model.parameters() if p.requires_grad]
    one_param = DDP(model, bucket_size_mb=1e-9)  # every parameter alone
    assert [b for b in one_param.buckets] == [[p] for p in reversed(params)]
    one_bucket = DDP(dist_workers.build("toy"), bucket_size_mb=1000)
    assert len(one_bucket.buckets) == 1
    limit_mb = 2 * 16 * 64 * 4 / 2**20  # room for up.weight + down.weight, not more
    model = dist_workers.build("toy")
    sizes = [sum(p.numel() * 4 for p in b) for b in DDP(model, bucket_size_mb=limit_mb).buckets]
    assert all(s <= limit_mb * 2**20 for s in sizes[1:]) and len(sizes) > 1


def test_world_of_one_ddp_matches_plain_training(world_of_one):
    from scratchlm.parallel.ddp import DDP, FlatDDP, NaiveDDP

    ref = dist_workers.train_reference("lm", 2, 1)
    for wrapper in (NaiveDDP, FlatDDP, DDP, lambda m: DDP(m, bucket_size_mb=0.001)):
        model = wrapper(dist_workers.build("lm"))
        dist_workers.train_world_of_one(model, 2)
        _assert_same(ref["params"], dist_workers.named_params(model.module))


def test_no_sync_skips_communication_until_the_last_backward(world_of_one, monkeypatch):
    import torch.distributed as dist

    from scratchlm.parallel.ddp import DDP

    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    model = DDP(dist_workers.build("lm"))
    (x, y), = dist_workers.batches(1, 1)[0]
    with model.no_sync():
        dist_workers.loss_fn(model, x, y).backward()
    assert calls == []
    dist_workers.loss_fn(model, x, y).backward()
    model.finish_gradient_synchronization()
    assert len(calls) == len([p for p in model.parameters() if p.grad is not None])
