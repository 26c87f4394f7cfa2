"""FSDP of scratchlm Linear/Embedding weights: exact in fp32, close in bf16, torch FSDP2 agrees."""

from __future__ import annotations

import pytest
import torch

import dist_workers


@pytest.mark.distributed
@pytest.mark.parametrize("job,kind,joint", [("lm-fsdp", "lm", True), ("lm_tied-fsdp", "lm_tied", False)])
def test_fp32_fsdp_is_bit_identical_to_single_process(job, kind, joint, distributed_results, references):
    ref = references[(kind, joint, 0.0)]
    rank0, rank1 = distributed_results["wrappers"][job]
    assert rank0["params"].keys() == ref["params"].keys()
    for name, expected in ref["params"].items():
        assert torch.equal(rank0["params"][name], expected), name
        assert torch.equal(rank1["params"][name], expected), name
    assert rank0["losses"] == ref["losses"]
    assert rank0["warnings"] == [] and rank1["warnings"] == []


@pytest.mark.distributed
def test_shards_and_their_grads_have_shard_shape_and_fp32(distributed_results):
    model = dist_workers.build("lm")
    full = dict(model.named_parameters())
    for rank0 in distributed_results["wrappers"]["lm-fsdp"][:1]:
        shapes, grad_shapes, grad_dtypes = rank0["shapes"], rank0["grad_shapes"], rank0["grad_dtypes"]
        # vocab 61 rows -> padded to 62, 31 rows per rank; norms stay replicated
        assert shapes["token_embeddings.weight"] == (31, 16)
        assert shapes["lm_head.weight"] == (31, 16)
        assert shapes["layers.0.ffn.w1.weight"] == (20, 16)
        assert shapes["layers.0.ln1.weight"] == (16,)
        for name, shape in shapes.items():
            assert grad_shapes[name] == shape
            assert grad_dtypes[name] == "torch.float32"
            assert shape[0] in (full[name].shape[0], -(-full[name].shape[0] // 2))


@pytest.mark.distributed
def test_bf16_compute_is_close(distributed_results, references):
    ref = references[("lm", True, 0.0)]
    rank0, rank1 = distributed_results["wrappers"]["lm-fsdp-bf16"]
    for a, b in zip(rank0["losses"], ref["losses"], strict=True):
        assert abs(a - b) < 2e-2 * abs(b)
    for name, expected in ref["params"].items():
        assert rank0["params"][name].dtype == torch.float32  # fp32 master weights
        # AdamW moves each weight by about lr=1e-2 per step whatever the gradient's size, so a
        # few bf16-flipped update signs bound the difference by a few lr.
        torch.testing.assert_close(rank0["params"][name], expected, atol=5e-2, rtol=0)
        assert torch.equal(rank0["params"][name], rank1["params"][name])


@pytest.mark.distributed
def test_gradient_accumulation(distributed_results, references):
    ref = references[("lm", True, 0.0)]
    rank0 = distributed_results["wrappers"]["lm-fsdp-accum"][0]
    for name, expected in ref["params"].items():
        torch.testing.assert_close(rank0["params"][name], expected, atol=1e-5, rtol=0)


@pytest.mark.distributed
@pytest.mark.parametrize("suffix", ["", "-sharded"])
def test_scratchlm_fsdp_and_torch_fsdp2_agree(suffix, distributed_results):
    ours = distributed_results["engine"]["fsdp" + suffix][0]["final"]
    theirs = distributed_results["engine"]["torch_fsdp2" + suffix][0]["final"]
    assert ours.keys() == theirs.keys()
    for name in ours:
        # Clipping is on: fsdp replicates the RMSNorm gains, torch_fsdp2 shards them, so the
        # two global norms add different partial sums (an ulp apart).
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=0)


def test_world_of_one_fsdp_matches_plain_training_and_frees_gathered_weights(world_of_one):
    from scratchlm.parallel.fsdp import FSDP

    ref = dist_workers.train_reference("lm", 2, 1)
    model = FSDP(dist_workers.build("lm"))
    dist_workers.train_world_of_one(model, 2)
    full = model.gather_full_params()
    assert full.keys() == ref["params"].keys()
    for name, expected in ref["params"].items():
        assert torch.equal(full[name], expected), name
    # Outside forward, sharded modules expose their shard again, not a gathered weight.
    lm = model.module
    assert "weight" not in lm.lm_head.__dict__ and lm.lm_head.weight is lm.lm_head._parameters["weight"]


def test_saved_weights_are_regathered_not_kept(world_of_one, monkeypatch):
    from scratchlm.parallel import fsdp as fsdp_module

    model = fsdp_module.FSDP(dist_workers.build("lm"))
    gathers = []
    real = fsdp_module._ShardedWeight.gather
    monkeypatch.setattr(fsdp_module._ShardedWeight, "gather",
                        lambda self, dtype: (gathers.append(self), real(self, dtype))[1])
    (x, y), = dist_workers.batches(1, 1)[0]
    loss = dist_workers.loss_fn(model, x, y)
    forward_gathers = len(gathers)
    linears = sum(isinstance(m, fsdp_module.Linear) for m in model.module.modules())
    assert forward_gathers == linears + 1  # every Linear and the Embedding, once
    loss.backward()
    # Backward gathers each Linear again (matmul needs its weight); the embedding's backward
    # needs only the indices.
    assert len(gathers) - forward_gathers == linears


def test_world_of_one_fsdp_with_activation_checkpointing(world_of_one):
    from torch.utils.checkpoint import checkpoint

    from scratchlm.parallel.fsdp import FSDP

    ref = dist_workers.train_reference("lm", 2, 1)
    plain = dist_workers.build("lm")
    for block in plain.layers:  # as scratchlm.train.activation_checkpoint does, from outside
        block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(block.forward)
    model = FSDP(plain)
    dist_workers.train_world_of_one(model, 2)
    full = model.gather_full_params()
    for name, expected in ref["params"].items():
        assert torch.equal(full[name], expected), name
