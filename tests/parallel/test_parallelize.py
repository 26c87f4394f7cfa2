"""parallelize(): checkpointing, then torch.compile, then the strategy's wrapper, and the compiled loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import dist_workers
from scratchlm.errors import UserError
from scratchlm.model.functional import cross_entropy
from scratchlm.parallel.config import ParallelConfig
from scratchlm.parallel.parallelize import parallelize
from scratchlm.parallel.strategy import Strategy, init_strategy
from scratchlm.train.activation_checkpoint import _ORIGINAL_FORWARD
from scratchlm.train.config import TrainerConfig


class _Recorder(Strategy):
    """A world of one that records what reaches `wrap_model`."""

    name = "recorder"

    def wrap_model(self, model):
        self.received = model
        return ("wrapped", model)


@pytest.fixture
def compiled(monkeypatch):
    """torch.compile replaced by a recorder: (what was compiled, mode)."""
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append((fn, kwargs.get("mode")))
        return ("compiled", fn)

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


def test_order_is_checkpointing_then_compile_then_wrapper(compiled):
    model = dist_workers.build("lm")
    strategy = _Recorder(ParallelConfig(), device=torch.device("cpu"))
    cfg = replace(TrainerConfig(), compile=True, compile_mode="max-autotune", activation_checkpointing=True,
                  activation_checkpointing_every=2)
    run = parallelize(model, cfg, strategy)
    assert [_ORIGINAL_FORWARD in b.__dict__ for b in model.layers] == [True, False]
    assert compiled[0] == (model, "max-autotune")  # the checkpointed plain model is compiled ...
    assert strategy.received == ("compiled", model)  # ... and the compiled module is wrapped
    assert run.model == ("wrapped", ("compiled", model))
    assert compiled[1] == (cross_entropy, "max-autotune") and run.loss_fn == ("compiled", cross_entropy)
    assert run.head_inputs is None and not run.cudagraphs  # reduce-overhead on CUDA only


def test_without_options_the_plain_model_and_loss_run(compiled):
    model = dist_workers.build("lm")
    run = parallelize(model, TrainerConfig(), init_strategy(ParallelConfig(), device="cpu"))
    assert run.model is model and run.loss_fn is cross_entropy and compiled == []
    assert not any(_ORIGINAL_FORWARD in b.__dict__ for b in model.layers)


def test_fused_head_compiles_the_trunk_and_needs_a_plain_strategy(compiled):
    model = dist_workers.build("lm")
    cfg = replace(TrainerConfig(), compile=True, fused_lm_head=True)
    plain = type("PlainRecorder", (_Recorder,), {"supports_fused_lm_head": True})
    run = parallelize(model, cfg, plain(ParallelConfig(), device=torch.device("cpu")))
    assert run.head_inputs == ("compiled", model.head_inputs)
    assert init_strategy(ParallelConfig(), device="cpu").supports_fused_lm_head
    with pytest.raises(UserError, match="fused_lm_head"):
        parallelize(dist_workers.build("lm"), cfg, _Recorder(ParallelConfig(), device=torch.device("cpu")))
