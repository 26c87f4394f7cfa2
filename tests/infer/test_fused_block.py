"""Decode steps through fused blocks (`DecodeEngine(fused_blocks=True)`): the logits of the
module-by-module step, and the blocks that do not qualify keep that step.

Where Triton cannot run (CPU without TRITON_INTERPRET=1) the engine keeps the module-by-module
step; `test_the_fused_step_computes_the_blocks_math` then runs the fused step on the op's torch
path, so its wiring is checked everywhere."""

import pytest
import torch

from scratchlm.infer import fused_block
from scratchlm.infer.engine import DecodeEngine
from scratchlm.infer.static_cache import DecodeView
from scratchlm.kernels.decode_linear_triton import MAX_ROWS
from scratchlm.kernels.triton_support import interpreting, triton_available
from scratchlm.model.transformer import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(**kw):
    torch.manual_seed(0)
    return TransformerLM(vocab_size=50, context_length=64, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                         rope_theta=10_000.0, dtype=torch.float32, **kw).eval()


def _decode_logits(model, fused, rows=2, decode_attention="auto"):
    engine = DecodeEngine(model, rows, 32, fused_blocks=fused, decode_attention=decode_attention)
    engine._refresh_projections()
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]][:rows]
    engine._prefill(list(range(rows)), prompts)
    ids = torch.tensor([7, 8, 9, 10][:rows])
    pos = torch.tensor([len(p) for p in prompts])
    return engine, engine._decode_logits(ids, pos, 32)


def _counted_ops(monkeypatch, calls):
    """The fused step taken wherever Triton would run (on the CPU its kernels take the ops' torch
    paths), its decode_linear and decode_qkv calls appended to `calls`."""
    def counted(name):
        real = getattr(fused_block, name)

        def call(*args, **kwargs):
            calls.append("gated" if kwargs.get("gate_up") else name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(fused_block, "can_use_triton", lambda t: True)
    for name in ("decode_linear", "decode_qkv", "decode_attention_linear"):
        monkeypatch.setattr(fused_block, name, counted(name))


@pytest.mark.parametrize("fused, decode_attention", [(True, "sdpa"), (True, "triton"), ("projections", "triton")])
@pytest.mark.parametrize("kw", [{}, {"num_kv_heads": 2, "qk_norm": True}])
def test_the_fused_step_computes_the_blocks_math(monkeypatch, kw, fused, decode_attention):
    model = _model(**kw)
    _, expected = _decode_logits(model, False)
    calls = []
    _counted_ops(monkeypatch, calls)
    _, got = _decode_logits(model, fused, decode_attention=decode_attention)
    # four fused projections a block (q|k|v, output, w1|w3 gated, w2); q|k|v with RoPE and the
    # cache write in its kernel and the Triton decode attention inside the output projection's,
    # unless the block normalises q and k before RoPE or they are left to torch ("projections")
    in_kernels = not kw.get("qk_norm") and fused is True
    qkv = "decode_qkv" if in_kernels else "decode_linear"
    out = "decode_attention_linear" if in_kernels and decode_attention == "triton" else "decode_linear"
    assert calls == [qkv, out, "gated", "decode_linear"] * 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_compiled_fused_steps_give_the_module_steps_logits(monkeypatch):
    """torch.compile traces the fused step with decode_qkv (an op that writes the cache), and a
    second compiled step, which reads the first one's keys from the cache, gives the module
    step's logits too. (Whether the write stays in place on a GPU shows in the time of
    benchmarks/generate.py's fused rows.)"""
    model = _model()
    steps = [(torch.tensor([7, 8]), torch.tensor([3, 2])), (torch.tensor([9, 1]), torch.tensor([4, 3]))]

    def two_steps(fused, compiled):
        engine, _ = _decode_logits(model, fused, decode_attention="triton")
        decode = torch.compile(engine._decode_logits, backend="aot_eager", dynamic=False) if compiled \
            else engine._decode_logits
        with torch.no_grad():  # as `DecodeEngine.run` steps
            return [decode(ids, pos, 32) for ids, pos in steps]

    expected = two_steps(False, False)
    calls = []
    _counted_ops(monkeypatch, calls)
    torch._dynamo.reset()
    got = two_steps(True, True)
    torch._dynamo.reset()
    assert "decode_qkv" in calls and "decode_attention_linear" in calls
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_the_engine_refuses_pdl_where_it_cannot_launch_with_it():
    model = _model()
    assert DecodeEngine(model, 2, 32, fused_blocks=True).cache.pdl is False  # "auto": off without compile and CUDA
    for fused in (False, True):
        with pytest.raises(ValueError, match="pdl=True needs fused_blocks and a CUDA device"):
            DecodeEngine(model, 2, 32, fused_blocks=fused, pdl=True)
    from scratchlm.infer.generate import generate

    with pytest.raises(ValueError, match="pdl=True needs fused_blocks and a CUDA device"):  # generate passes it on
        generate(model, [[1, 2, 3]], 4, temperature=0, fused_blocks=True, pdl=True)


def test_the_engine_refuses_an_unknown_fused_blocks_value():
    with pytest.raises(ValueError, match="fused_blocks must be"):
        DecodeEngine(_model(), 2, 32, fused_blocks="all")
    with pytest.raises(ValueError, match="pdl must be True, False or 'auto'"):
        DecodeEngine(_model(), 2, 32, pdl="on")


def test_fused_blocks_default_to_compiled_engines_of_few_slots(monkeypatch):
    from scratchlm.infer import engine as engine_module

    param = torch.zeros(1)
    monkeypatch.setattr(engine_module, "can_use_triton", lambda t: False)
    assert not engine_module.fused_blocks_default(param, 1, True, True)  # where Triton cannot run
    monkeypatch.setattr(engine_module, "can_use_triton", lambda t: True)
    assert engine_module.fused_blocks_default(param, 1, True, True)
    assert engine_module.fused_blocks_default(param, MAX_ROWS, True, True)
    assert not engine_module.fused_blocks_default(param, MAX_ROWS + 1, True, True)  # rollouts' engines
    assert not engine_module.fused_blocks_default(param, 1, False, True)  # uncompiled
    assert not engine_module.fused_blocks_default(param, 1, True, False)  # without CUDA graphs
    # the engine's "auto" on the CPU: no CUDA graphs, so module by module and no PDL
    engine = DecodeEngine(_model(), 1, 32)
    assert engine.cache.fused_blocks is False and engine.cache.pdl is False


@pytest.mark.parametrize("decode_attention", ["sdpa", "triton"])
def test_the_fused_kernels_give_the_logits_of_the_module_step(decode_attention):
    if not (triton_available() and interpreting()):
        pytest.skip("the kernels run on CUDA or under TRITON_INTERPRET=1 with triton installed")
    model = _model(num_kv_heads=2)
    _, expected = _decode_logits(model, False, rows=3)
    _, got = _decode_logits(model, True, rows=3, decode_attention=decode_attention)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _view(engine, rows):
    return DecodeView(engine.cache, torch.zeros(rows, dtype=torch.long), 32)


def test_blocks_qualify_only_where_the_fused_step_reproduces_them():
    engine = DecodeEngine(_model(), 2, 32, fused_blocks=True)
    engine._refresh_projections()
    block = engine.model.layers[0]
    assert fused_block.fused_weights(block, _view(engine, 1), 1) is not None
    assert fused_block.fused_weights(block, _view(engine, MAX_ROWS + 1), MAX_ROWS + 1) is None  # too many rows
    for kw in ({"norm_position": "post"}, {"ffn": "silu"}, {"qkv_bias": True}):
        other = DecodeEngine(_model(**kw), 2, 32, fused_blocks=True)
        other._refresh_projections()
        assert fused_block.fused_weights(other.model.layers[0], _view(other, 1), 1) is None, kw
    unstacked = DecodeEngine(_model(), 2, 32, fused_blocks=True, stack_projections=False)
    assert fused_block.fused_weights(unstacked.model.layers[0], _view(unstacked, 1), 1) is None
    handle = block.ffn.w2.register_forward_hook(lambda *a: None)  # a hook the fused step would skip
    assert fused_block.fused_weights(block, _view(engine, 1), 1) is None
    handle.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, "projections"])
@pytest.mark.parametrize("compile", [False, True])
def test_fused_blocks_on_cuda_captured(compile, fused):
    model = _model().to("cuda", torch.bfloat16)
    with torch.no_grad():  # confident greedy paths: few argmax near-ties for bf16 rounding to flip
        model.lm_head.weight.mul_(8)
    prompts = [[1, 2, 3], [4, 5]]
    outs = [DecodeEngine(model, 2, 64, compile=compile, fused_blocks=f).run(prompts, [16, 16], temperature=0)
            for f in (False, fused)]
    for plain, fused in zip(*outs, strict=True):
        agree = sum(a == b for a, b in zip(plain, fused, strict=True))
        assert agree >= 12, outs  # bf16 rounding may flip a near-tie late in a random model's sequence


@pytest.mark.gpu
def test_pdl_launches_change_nothing():
    # The same kernels launched with programmatic dependent launch (each may start before the one
    # before it ends, and waits for it before reading its results), at one row, where the engine
    # uses it: the same logits, bit for bit, and the same tokens from captured compiled steps.
    from scratchlm.kernels.triton_support import pdl_supported

    if not pdl_supported(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs compute capability 9 or more and a Triton with gdc_wait")
    model = _model().to("cuda", torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    logits = []
    for pdl in (False, True):
        engine = DecodeEngine(model, 1, 32, fused_blocks=True, pdl=pdl, cuda_graphs=False)
        engine._refresh_projections()
        engine._prefill([0], [[1, 2, 3]])
        logits.append(engine._decode_logits(torch.tensor([7], device="cuda"), torch.tensor([3], device="cuda"), 32))
    assert torch.equal(*logits)
    with pytest.raises(ValueError, match="needs compile=True"):
        DecodeEngine(model, 1, 64, fused_blocks=True, pdl=True)
    outs = [DecodeEngine(model, 1, 64, compile=True, fused_blocks=True, pdl=pdl).run([[1, 2, 3]], [48], temperature=0)
            for pdl in (False, True)]
    assert outs[0] == outs[1]


@pytest.mark.gpu
def test_a_compiled_one_slot_engine_fuses_its_blocks_and_launches_with_pdl_by_default():
    from scratchlm.kernels.triton_support import pdl_supported

    model = _model().to("cuda", torch.bfloat16)
    one = DecodeEngine(model, 1, 64, compile=True)
    assert one.cache.fused_blocks is True and one.cache.pdl == pdl_supported(torch.empty(1, device="cuda"))
    rollouts = DecodeEngine(model, MAX_ROWS + 1, 64, compile=True)
    assert rollouts.cache.fused_blocks is False and rollouts.cache.pdl is False


def test_the_compiled_fused_step_computes_the_positions_once(monkeypatch):
    """Inductor's CPU code for a fused step: one kernel computes the embedding and the clamped
    positions that every layer's kernels take. Under the exact-stride default for custom ops it
    computed a copy of the positions before each op that read them (24 extra kernels a GPT-2-small
    step on a GPU); the opaque ops take flexible layouts instead (`register_op`)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from scratchlm.kernels import triton_support

    if not (hasattr(torch.Tag, "flexible_layout") and triton_support._custom_op_takes_tags()):
        pytest.skip("this torch has no flexible_layout tag for custom ops")
    assert torch.Tag.flexible_layout in torch.ops.scratchlm.decode_qkv.default.tags
    monkeypatch.setattr(fused_block, "can_use_triton", lambda t: True)  # the ops' torch paths where no Triton
    engine, expected = _decode_logits(_model(), True, rows=1, decode_attention="triton")
    ids, pos = torch.tensor([7]), torch.tensor([3])
    with torch.no_grad():
        expected = engine._decode_next(ids, pos, 32)[0]
    torch._dynamo.reset()
    step = torch.compile(engine._decode_next, backend="inductor", dynamic=True)
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        (logits, _), codes = run_and_get_code(step, ids, pos, 32)
    torch._dynamo.reset()
    kernels = re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)\(", "\n".join(codes), re.MULTILINE)
    assert sum("clamp" in k for k in kernels) == 1, kernels
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
