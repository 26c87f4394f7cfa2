"""The trainer seam: every strategy trains like one process and resumes exactly from a checkpoint."""

from __future__ import annotations

import pytest
import torch

import dist_workers
from scratchlm.errors import UserError
from scratchlm.parallel.config import ParallelConfig

BITWISE = ["ddp", "ddp_bucketed", "naive_ddp", "flat_ddp", "zero1", "torch_ddp", "zero1-sharded"]
SHARDED_WEIGHTS = ["fsdp", "fsdp-sharded", "torch_fsdp2", "torch_fsdp2-sharded"]


@pytest.mark.distributed
@pytest.mark.parametrize("job", BITWISE)
def test_replicated_and_zero1_engines_are_bit_identical_with_clipping(job, distributed_results, references):
    ref = references[("lm", True, 1.0)]
    rank0, rank1 = distributed_results["engine"][job]
    assert rank1["final"] is None  # full weights on rank 0 only
    assert rank0["final"].keys() == ref["params"].keys()
    for name, expected in ref["params"].items():
        assert torch.equal(rank0["final"][name], expected), name
    assert rank0["norms"] == ref["norms"]
    assert rank0["warnings"] == [] and rank1["warnings"] == []


@pytest.mark.distributed
@pytest.mark.parametrize("job", SHARDED_WEIGHTS + ["fsdp-tied"])
def test_sharded_engines_match_single_process_closely(job, distributed_results, references):
    kind = "lm_tied" if job.endswith("tied") else "lm"
    ref = references[(kind, kind == "lm", 1.0)]
    rank0, rank1 = distributed_results["engine"][job]
    for name, expected in ref["params"].items():
        torch.testing.assert_close(rank0["final"][name], expected, atol=1e-6, rtol=0)
    for a, b in zip(rank0["norms"], ref["norms"], strict=True):
        assert a == pytest.approx(b, rel=1e-6)
    assert rank0["warnings"] == [] and rank1["warnings"] == []


@pytest.mark.distributed
@pytest.mark.parametrize("job", BITWISE + SHARDED_WEIGHTS + ["fsdp-tied"])
def test_resume_from_checkpoint_is_exact(job, distributed_results):
    rank0, rank1 = distributed_results["engine"][job]
    for name, value in rank0["final"].items():
        assert torch.equal(rank0["resumed"][name], value), name
    assert rank0["resumed_loss"] == rank0["losses"][-1]


@pytest.mark.distributed
def test_optimizer_state_formats(distributed_results):
    engine = distributed_results["engine"]
    for job in ("ddp", "zero1", "fsdp", "torch_fsdp2"):
        rank0, rank1 = engine[job]
        assert not rank0["per_rank"] and rank1["optim"] is None  # one optimizer.pt from rank 0
    for job in ("zero1-sharded", "fsdp-sharded", "torch_fsdp2-sharded"):
        rank0, rank1 = engine[job]
        assert rank0["per_rank"] and rank1["optim"] is not None  # one file per rank
    # "full" gathers sharded state into the single-process layout: the same as DDP's.
    replicated = engine["ddp"][0]["optim"]
    for job in ("zero1", "fsdp", "torch_fsdp2"):
        full = engine[job][0]["optim"]
        assert full["state"].keys() == replicated["state"].keys()
        for i, state in replicated["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(torch.as_tensor(full["state"][i][key]), torch.as_tensor(value),
                                           atol=1e-6, rtol=0)
    zero1 = engine["zero1"][0]["optim"]
    for i, state in replicated["state"].items():
        assert torch.equal(zero1["state"][i]["exp_avg_sq"], state["exp_avg_sq"])


def test_init_engine_without_torchrun_is_a_world_of_one(monkeypatch):
    from scratchlm.parallel.engine import init_engine

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    engine = init_engine(ParallelConfig(strategy="ddp", backend="gloo"))
    try:
        assert (engine.rank, engine.world_size, engine.is_main) == (0, 1, True)
        assert engine.device == torch.device("cpu")
        assert engine.all_reduce_mean(3.5) == 3.5
        model = engine.wrap_model(dist_workers.build("lm"))
        state = engine.full_state_dict(model)
        assert state.keys() == dist_workers.build("lm").state_dict().keys()
        engine.barrier()
    finally:
        engine.shutdown()


def test_bad_configs_are_user_errors():
    from scratchlm.parallel.engine import init_engine

    with pytest.raises(UserError):
        init_engine(ParallelConfig(strategy="none"))
    with pytest.raises(ValueError, match="parallel.strategy"):
        ParallelConfig(strategy="zero3")
    with pytest.raises(ValueError, match="parallel.optimizer_state"):
        ParallelConfig(optimizer_state="both")
