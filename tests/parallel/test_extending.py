"""The worked example of docs/extending.md, "A parallel strategy", runs and trains like one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dist_workers
from tests.docs_examples import python_blocks

STEPS = 3


def _register_doc_strategy() -> type:
    """Execute the section's python blocks (the strategy module, then its registration)."""
    namespace: dict[str, Any] = {"__name__": "allreduce_after_backward"}
    for block in python_blocks("extending.md", "A parallel strategy"):
        exec(compile(block, "docs/extending.md", "exec"), namespace)
    return namespace["AllReduceAfterBackward"]


def train_with_doc_strategy(rank: int, world: int) -> dict[str, Any]:
    """Train STEPS steps of the tiny LM with the docs' strategy, chosen by name through the config."""
    from scratchlm.optim.adamw import AdamW
    from scratchlm.parallel.config import ParallelConfig
    from scratchlm.parallel.strategy import init_strategy

    _register_doc_strategy()
    torch.use_deterministic_algorithms(True)
    strategy = init_strategy(ParallelConfig(strategy="allreduce_after_backward"))
    model = dist_workers.build("lm", seed=rank + 100)  # different init per rank: wrap_model must broadcast
    if rank == 0:
        model.load_state_dict(dist_workers.build("lm").state_dict())
    model = strategy.wrap_model(model)
    opt = strategy.build_optimizer(model, AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    norms = []
    for step in dist_workers.batches(STEPS, world):
        x, y = step[rank]
        opt.zero_grad(set_to_none=True)
        dist_workers.loss_fn(model, x, y).backward()
        strategy.sync_gradients(model)
        norms.append(float(strategy.clip_grad_norm(model, 1.0)))
        opt.step()
    return {"weights": strategy.full_state_dict(model), "norms": norms, "name": type(strategy).__name__}


def test_the_docs_strategy_registers_by_name(monkeypatch):
    from scratchlm.parallel.config import ParallelConfig
    from scratchlm.parallel.registry import STRATEGIES

    monkeypatch.setattr("scratchlm.parallel.registry.STRATEGIES", dict(STRATEGIES))
    with pytest.raises(ValueError, match="parallel.strategy"):
        ParallelConfig(strategy="allreduce_after_backward")
    # The docs' block imports the registry module's dict, which is the patched copy.
    cls = _register_doc_strategy()
    import scratchlm.parallel.registry as registry

    assert registry.STRATEGIES["allreduce_after_backward"] is cls
    assert ParallelConfig(strategy="allreduce_after_backward").strategy == "allreduce_after_backward"


@pytest.mark.distributed
def test_the_docs_strategy_trains_bit_identically_to_one_process():
    from scratchlm.parallel.launch import spawn

    rank0, rank1 = spawn(train_with_doc_strategy, 2, timeout_s=180)
    ref = dist_workers.train_reference("lm", STEPS, 2, clip=1.0, joint=True)
    assert rank0["name"] == "AllReduceAfterBackward" and rank1["weights"] is None
    assert rank0["weights"].keys() == ref["params"].keys()
    for name, expected in ref["params"].items():
        assert torch.equal(rank0["weights"][name], expected), name
    assert rank0["norms"] == ref["norms"]
