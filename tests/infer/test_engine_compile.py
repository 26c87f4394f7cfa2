"""The compiled decode step: no fall back to eager at torch.compile's recompile limit."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from scratchlm.infer.engine import DecodeEngine, _recompile_limits, batch_buckets
from scratchlm.model.transformer import TransformerLM
from tests.infer.cuda_models import peaked_cuda_lm

pytestmark = pytest.mark.usefixtures("one_thread")

_CONFIG = torch._dynamo.config
_LIMIT = "recompile_limit" if hasattr(_CONFIG, "recompile_limit") else "cache_size_limit"
# a fallback raises instead of quietly running the step eagerly (where torch has the switch)
_STRICT = {"fail_on_recompile_limit_hit": True} if hasattr(_CONFIG, "fail_on_recompile_limit_hit") else {}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TransformerLM(vocab_size=50, context_length=64, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                         rope_theta=10_000.0, dtype=torch.float32).eval()


def _step_every_bucket(engine, counter):
    """Compile the engine's step with `counter` as the backend (eager kernels: CPU, fast) and run
    it at every (b, L) the engine can step, against the uncompiled step."""
    engine._forward = engine._compiled_step(backend=counter)
    engine._refresh_projections()
    slots = engine.slots
    engine._prefill(list(range(slots)), [[1 + s, 2, 3] for s in range(slots)])
    engine.lens[:slots] = 3
    engine.tokens[:slots] = torch.arange(slots) + 5
    lengths = list(range(engine.len_bucket, engine.max_len + 1, engine.len_bucket))
    assert lengths[-1] == engine.max_len  # the window of the whole cache is among them
    for b in batch_buckets(slots):
        for L in lengths:
            args = (engine.tokens[:b], engine.lens[:b], L)
            logits, argmax = engine._forward(*args)
            torch.testing.assert_close(logits, engine._decode_logits(*args), rtol=0, atol=0)
            assert torch.equal(argmax, logits.argmax(dim=-1))


def test_engines_compile_their_own_steps(model):
    # Five engines of two graphs each (b == 1, b > 1) are ten compilations: over the default
    # limit of 8 had they shared one code object, as their common method does.
    assert getattr(_CONFIG, _LIMIT) <= 8
    with _CONFIG.patch(_STRICT), torch.inference_mode():
        for slots in (2, 3, 4, 5, 6):
            engine = DecodeEngine(model, slots, 16, len_bucket=8)
            assert engine.cache.k[0] is None or engine.cache.k[0].shape[2] == 17
            counter = CompileCounter()
            _step_every_bucket(engine, counter)
            assert engine.cache.k[0].shape[2] == 17  # one spare position: L == max_len is no special case
            assert 1 <= counter.frame_count <= 2  # b == 1, and every other b and L


def test_the_limit_is_raised_to_the_engines_buckets_around_its_calls(model):
    # however low the process's limit, an engine's step does not fall back for any of its shapes
    with _CONFIG.patch({_LIMIT: 1, **_STRICT}), torch.inference_mode():
        engine = DecodeEngine(model, 4, 16, len_bucket=8)
        counter = CompileCounter()
        _step_every_bucket(engine, counter)
        assert counter.frame_count == 2
        assert getattr(_CONFIG, _LIMIT) == 1  # restored after each call
    assert _recompile_limits(3)[_LIMIT] == max(getattr(_CONFIG, _LIMIT), 3)
    assert _recompile_limits(10**6)[_LIMIT] == 10**6


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_compiled_bookkeeping_records_what_the_eager_one_does(model, temperature):
    """`_advance` (the token counts, the outputs and the finished rows after each step) compiled,
    as a compiled engine runs it: the same tokens as eagerly, rows finishing and slots refilled."""
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]
    budgets = [6, 9, 3, 12, 7]

    def run(compiled):
        engine = DecodeEngine(model, 3, 32, check_every=2)
        counter = CompileCounter()
        if compiled:
            engine._advance = engine._own_compiled(DecodeEngine._record, 3, counter)
        out = engine.run(prompts, budgets, temperature=temperature, stop_ids=[13],
                         generator=torch.Generator().manual_seed(0))
        return out, counter.frame_count

    with _CONFIG.patch(_STRICT), torch.inference_mode():
        (eager, _), (compiled, frames) = run(False), run(True)
    assert compiled == eager and frames >= 1


@pytest.mark.gpu
def test_compiled_cuda_engines_do_not_hit_the_recompile_limit():
    # The inductor-compiled, captured step on the GPU: several engines in one process, each
    # decoding until its attention window is the whole cache (L == max_len).
    m = peaked_cuda_lm(num_layers=2, context_length=600)
    prompts = [list(range(1, 40)), [5], list(range(100, 117)), list(range(7, 60))] * 2
    with _CONFIG.patch(_STRICT), torch.inference_mode():
        for slots, max_len in [(1, 128), (3, 128), (8, 192), (5, 256), (8, 128)]:
            budgets = [max_len - len(p) for p in prompts]
            compiled = DecodeEngine(m, slots, max_len, len_bucket=64, compile=True)
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            out = compiled.run(prompts, budgets, temperature=0)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
            # decode and the bookkeeping after it: b == 1 and b > 1; prefill: n == 1 and n > 1
            # (a fallback would have raised)
            assert 3 <= graphs <= 6, (slots, max_len, graphs)
            eager = DecodeEngine(m, slots, max_len, len_bucket=64, cuda_graphs=False)
            assert out == eager.run(prompts, budgets, temperature=0)


def test_compile_mode_is_checked_and_reaches_torch_compile(model, monkeypatch):
    with pytest.raises(ValueError, match="compile_mode must be one of"):
        DecodeEngine(model, 2, 16, compile_mode="reduce-overhead")  # the engine captures graphs itself
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    engine = DecodeEngine(model, 2, 16, compile_mode="max-autotune-no-cudagraphs")
    engine._compiled_step()
    engine._compiled_prefill()
    assert [kw["mode"] for kw in seen] == ["max-autotune-no-cudagraphs"] * 2
    seen.clear()
    DecodeEngine(model, 2, 16)._compiled_step()
    assert seen[0]["mode"] is None


def test_inductor_options_are_checked_and_in_effect_while_compiling(model):
    import torch._inductor.config as inductor_config

    with pytest.raises(ValueError, match="unknown inductor option"):
        DecodeEngine(model, 2, 16, inductor_options={"no_such_option": True})
    engine = DecodeEngine(model, 2, 16, inductor_options={"coordinate_descent_tuning": True})
    seen = []

    def backend(gm, example_inputs):  # a compiler that records the setting it runs under
        seen.append(inductor_config.coordinate_descent_tuning)
        return gm.forward

    with torch.inference_mode():
        engine._forward = engine._compiled_step(backend=backend)
        engine._refresh_projections()
        engine._prefill([0, 1], [[1, 2, 3], [4, 5]])
        engine.lens[:2] = torch.tensor([3, 2])
        engine._forward(engine.tokens[:2], engine.lens[:2], 8)
    assert seen == [True] and inductor_config.coordinate_descent_tuning is False
