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


def test_blocks_scope_compiles_one_block_call_and_leaves_the_model_plain(compiled):
    from scratchlm.model.transformer import run_block

    model = dist_workers.build("lm")
    cfg = replace(TrainerConfig(), compile=True, compile_scope="blocks", fused_lm_head=True)
    plain = type("PlainRecorder", (_Recorder,), {"supports_fused_lm_head": True})
    run = parallelize(model, cfg, plain(ParallelConfig(), device=torch.device("cpu")))
    assert compiled[0] == (run_block, "default") and model.block_runner == ("compiled", run_block)
    assert run.model == ("wrapped", model)  # the module itself is not compiled
    assert run.head_inputs == model.head_inputs  # its trunk runs the compiled blocks
    with pytest.raises(ValueError, match="compile_scope must be 'model' or 'blocks'"):
        replace(TrainerConfig(), compile_scope="layers")
    with pytest.raises(UserError, match="needs a scratchlm Transformer"):
        parallelize(torch.nn.Linear(2, 2), cfg, plain(ParallelConfig(), device=torch.device("cpu")))


def test_blocks_scope_forward_and_backward_equal_the_plain_model_with_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    from scratchlm.model.transformer import run_block

    torch.manual_seed(0)
    model = dist_workers.build("lm")
    ids = torch.randint(0, model.vocab_size, (2, 8))
    expected = model(ids)
    expected.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    counter = CompileCounterWithBackend("aot_eager")
    model.block_runner = torch.compile(run_block, backend=counter)
    got = model(ids)
    got.float().pow(2).mean().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    assert len(model.layers) > 1 and counter.frame_count == 1  # one graph serves every block
    # cached and masked forwards (decoding, left padding) keep the plain blocks
    model(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool))
    assert counter.frame_count == 1


def test_cudagraphs_backend_compiles_without_inductor_on_cuda_and_runs_eagerly_elsewhere(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append((fn, kwargs)) or ("compiled", fn))
    cfg = replace(TrainerConfig(), compile=True, compile_backend="cudagraphs")
    model = dist_workers.build("lm")
    run = parallelize(model, cfg, _Recorder(ParallelConfig(), device=torch.device("cuda")))
    assert calls == [(model, {"backend": "cudagraphs"}), (cross_entropy, {"backend": "cudagraphs"})]
    assert run.model == ("wrapped", ("compiled", model)) and run.cudagraphs  # steps are marked
    calls.clear()
    run = parallelize(model, cfg, _Recorder(ParallelConfig(), device=torch.device("cpu")))
    assert calls == [] and run.model == ("wrapped", model) and not run.cudagraphs


def test_compile_backend_is_checked():
    with pytest.raises(ValueError, match="compile_backend"):
        TrainerConfig(compile_backend="eager")
