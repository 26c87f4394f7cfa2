"""The engine's prefill: rows back in prompt order, and its compiled forward against the eager one."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from scratchlm.infer.engine import PREFILL_BUCKET, PREFILL_GRAPHS_KEPT, DecodeEngine, _lm_logits
from scratchlm.infer.static_cache import PrefillView
from scratchlm.model.transformer import TransformerLM
from tests.infer.cuda_models import peaked_cuda_lm

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    m = TransformerLM(vocab_size=50, context_length=64, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                      rope_theta=10_000.0, dtype=torch.float32, **kw)
    with torch.no_grad():  # confident greedy paths: no argmax near-ties between equal computations
        m.lm_head.weight.mul_(8)
    return m.eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def gqa_model():
    # grouped-query attention, QK-norm and a window shorter than most prompts
    return _model(1, num_kv_heads=2, qk_norm=True, sliding_window=6)


def _prompts(n, seed=0, lo=1, hi=20):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 50, (k,), generator=g).tolist() for k in lens]


def _prefill_row_by_row(engine, slots, prompts, max_tokens=16384):
    # The former gathering of the rows: one chunk's rows at a time into a list, then a stack.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    chunks, chunk = [], []
    for i in order:
        if chunk and len(prompts[i]) * (len(chunk) + 1) > max_tokens:
            chunks.append(chunk)
            chunk = []
        chunk.append(i)
    chunks.append(chunk)
    logits = [None] * len(prompts)
    for chunk in chunks:
        T = max(len(prompts[i]) for i in chunk)
        ids = torch.tensor([list(prompts[i]) + [0] * (T - len(prompts[i])) for i in chunk])
        lens = torch.tensor([len(prompts[i]) for i in chunk])
        rows = torch.tensor([slots[i] for i in chunk])
        view = PrefillView(engine.cache, rows, T)
        chunk_logits = _lm_logits(engine.model, ids, torch.arange(T), view, lens - 1, engine.head).float()
        for j, i in enumerate(chunk):
            logits[i] = chunk_logits[j]
    return torch.stack(logits)


@pytest.mark.parametrize("max_tokens", [16384, 40, 1])
def test_prefill_returns_the_rows_in_prompt_order_as_before(model, max_tokens):
    # one chunk, a few, one prompt a chunk; slots in no particular order
    prompts = _prompts(7, seed=5)
    slots = [6, 0, 3, 1, 5, 2, 4]
    with torch.inference_mode():
        ours, theirs = DecodeEngine(model, 7, 32), DecodeEngine(model, 7, 32)
        for engine in (ours, theirs):
            engine._refresh_projections()
        got = ours._prefill(slots, prompts, max_tokens=max_tokens)
        expected = _prefill_row_by_row(theirs, slots, prompts, max_tokens=max_tokens)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        for mine, ref in zip(ours.cache.k + ours.cache.v, theirs.cache.k + theirs.cache.v):
            torch.testing.assert_close(mine, ref, rtol=0, atol=0)
        # sorted already: the forward's rows as they come
        ordered = sorted(prompts, key=len)
        torch.testing.assert_close(ours._prefill(slots, ordered), _prefill_row_by_row(theirs, slots, ordered),
                                   rtol=0, atol=0)


# ---- the compiled prefill ------------------------------------------------------------------

_CONFIG = torch._dynamo.config
_LIMIT = "recompile_limit" if hasattr(_CONFIG, "recompile_limit") else "cache_size_limit"
# a fallback raises instead of quietly running eagerly (where torch has the switch)
_STRICT = {"fail_on_recompile_limit_hit": True} if hasattr(_CONFIG, "fail_on_recompile_limit_hit") else {}


@pytest.fixture(scope="module")
def window_model():
    # grouped-query attention and a window that prefills of 16 tokens fit in and those of 32 not
    return _model(2, num_kv_heads=2, qk_norm=True, sliding_window=20)


def _compiled(engine, counter):
    # What compile=True sets up on CUDA, with `counter` as the backend (eager kernels: CPU)
    engine.prefill_bucket = PREFILL_BUCKET
    engine._prefill_forward = engine._compiled_prefill(backend=counter)
    engine._refresh_projections()
    return engine


def test_the_cpu_engine_prefills_eagerly(model):
    engine = DecodeEngine(model, 2, 32, compile=True)
    assert engine._prefill_forward == engine._prefill_logits and engine.prefill_bucket == 1


@pytest.mark.parametrize("name", ["model", "window_model"])
def test_compiled_prefill_equals_eager_with_few_compiles(name, request):
    m = request.getfixturevalue(name)
    counter = CompileCounterWithBackend("aot_eager")  # functionalised: the cache writes as index_put
    shapes = [(3, 5), (5, 17), (2, 9), (1, 4), (4, 30), (6, 12), (1, 20)]  # (n, longest prompt)
    with _CONFIG.patch({_LIMIT: 1, **_STRICT}), torch.inference_mode():
        compiled = _compiled(DecodeEngine(m, 6, 48), counter)
        eager = DecodeEngine(m, 6, 48)
        eager._refresh_projections()
        for k, (n, T) in enumerate(shapes):
            prompts = _prompts(n - 1, seed=k, hi=T) + [_prompts(1, seed=k, lo=T, hi=T + 1)[0]]
            slots = torch.randperm(6, generator=torch.Generator().manual_seed(k))[:n].tolist()
            got, expected = compiled._prefill(slots, prompts), eager._prefill(slots, prompts)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
            for s, p in zip(slots, prompts):  # the real tokens' keys and values, in the right rows
                for ours, theirs in zip(compiled.cache.k + compiled.cache.v, eager.cache.k + eager.cache.v):
                    torch.testing.assert_close(ours[s, :, :len(p)], theirs[s, :, :len(p)], rtol=1e-5, atol=1e-5)
        assert getattr(_CONFIG, _LIMIT) == 1  # raised around the engine's calls only
    # n == 1 and n > 1, and for the window
    # model each for widths within the window (16) and beyond it (32, 48)
    assert 2 <= counter.frame_count <= (2 if name == "model" else 4)


@pytest.mark.parametrize("name", ["model", "window_model"])
def test_engine_with_compiled_prefill_generates_as_the_eager_one(name, request):
    # refill of finished rows' slots (prefill of a few rows), stop ids, decoding past the window
    m = request.getfixturevalue(name)
    prompts = _prompts(9, seed=7, lo=1, hi=30)
    budgets = [3, 9, 1, 30, 12, 2, 5, 17, 8]
    with torch.inference_mode():
        expected = DecodeEngine(m, 3, 64, len_bucket=16, check_every=2).run(prompts, budgets, temperature=0)
        assert len({tuple(o) for o in expected}) > 1
        stops = [expected[3][4]]
        expected_stopped = DecodeEngine(m, 3, 64, len_bucket=16, check_every=2).run(
            prompts, budgets, temperature=0, stop_ids=stops)
        counter = CompileCounter()
        engine = DecodeEngine(m, 3, 64, len_bucket=16, check_every=2)
        engine.prefill_bucket = PREFILL_BUCKET
        engine._prefill_forward = engine._compiled_prefill(backend=counter)
        assert engine.run(prompts, budgets, temperature=0) == expected
        assert engine.run(prompts, budgets, temperature=0, stop_ids=stops) == expected_stopped
        assert counter.frame_count >= 1  # the refills and the second run went through it
        # padding the width alone (eager) changes nothing either
        padded = DecodeEngine(m, 3, 64, len_bucket=16, check_every=2)
        padded.prefill_bucket = PREFILL_BUCKET
        assert padded.run(prompts, budgets, temperature=0) == expected


def test_prefill_width_stays_within_the_cache_and_the_model(model):
    # max_len 40 (not a multiple of the bucket); a model of context 64 with a cache of 80
    with torch.inference_mode():
        engine = DecodeEngine(model, 2, 40)
        engine.prefill_bucket = PREFILL_BUCKET
        eager = DecodeEngine(model, 2, 40)
        prompts = [list(range(1, 38)), [3, 4]]
        torch.testing.assert_close(engine._prefill([0, 1], prompts), eager._prefill([0, 1], prompts))
        wide = DecodeEngine(model, 1, 80)
        wide.prefill_bucket = PREFILL_BUCKET
        assert wide._prefill_cap == 64
        wide._prefill([0], [list(range(50))])  # padded to 64, not 64 + 16 positions


@pytest.mark.gpu
def test_compiled_prefill_on_cuda_equals_eager():
    # inductor, dynamic shapes: prefills of several (n, T), with and without a sliding window
    # and grouped-query attention, under compile=True against the uncompiled engine
    for kw in ({}, {"num_kv_heads": 2, "qk_norm": True, "sliding_window": 24}):
        m = peaked_cuda_lm(num_layers=2, context_length=600, **kw)
        with _CONFIG.patch(_STRICT), torch.inference_mode():
            compiled = DecodeEngine(m, 8, 192, len_bucket=64, compile=True)
            eager = DecodeEngine(m, 8, 192, len_bucket=64, cuda_graphs=False)
            assert compiled.prefill_bucket == PREFILL_BUCKET
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            for k, (n, T) in enumerate([(8, 40), (3, 17), (1, 5), (5, 90), (8, 33), (2, 3), (1, 60)]):
                g = torch.Generator().manual_seed(k)
                prompts = [torch.randint(1, 300, (int(torch.randint(1, T + 1, (1,), generator=g)),),
                                         generator=g).tolist() for _ in range(n - 1)] + [list(range(1, T + 1))]
                budgets = [min(30, 192 - len(p)) for p in prompts]
                out = compiled.run(prompts, budgets, temperature=0)
                assert out == eager.run(prompts, budgets, temperature=0), (kw, n, T)
                slots = list(range(n))[::-1]
                torch.testing.assert_close(compiled._prefill(slots, prompts), eager._prefill(slots, prompts),
                                           rtol=1e-3, atol=1e-3)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
            # decode: b == 1 and b > 1; prefill: n == 1 and n > 1 (each within and beyond the window)
            assert 3 <= graphs <= (4 if "sliding_window" not in kw else 6), (kw, graphs)


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this compiler cannot take the graph")


def test_a_compiled_prefill_that_fails_at_first_falls_back_to_eager_with_a_warning(model):
    torch.manual_seed(0)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]
    expected = DecodeEngine(model, 3, 32).run(prompts, [6, 6, 6], temperature=0)
    engine = DecodeEngine(model, 3, 32)
    engine.prefill_bucket = PREFILL_BUCKET
    engine._prefill_forward = engine._compiled_prefill(backend=_failing_backend)
    with pytest.warns(RuntimeWarning, match="compiled prefill failed .*prefilling eagerly"):
        assert engine.run(prompts, [6, 6, 6], temperature=0) == expected
    assert engine._prefill_forward == engine._prefill_logits  # dropped for good
    assert engine.run(prompts, [6, 6, 6], temperature=0) == expected


def test_a_compiled_prefill_that_worked_raises_its_later_errors(model):
    engine = DecodeEngine(model, 2, 32)
    calls = []

    def flaky(ids, rows, last):
        calls.append(ids.shape)
        if len(calls) > 1:
            raise RuntimeError("out of memory")
        return engine._prefill_logits(ids, rows, last)

    engine._prefill_forward = flaky
    engine.run([[1, 2, 3]], [1], temperature=0)  # eager (allocates the cache), then the stand-in once
    assert calls == [(1, 3)]
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.run([[4, 5, 6]], [1], temperature=0)


def test_the_first_run_compiles_the_prefill(model):
    # The compilation happens in the engine's first run (its warm-up), not in the second one:
    # the first prefill allocates the cache eagerly and then runs compiled on the same chunk.
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]
    with torch.inference_mode():
        expected = DecodeEngine(model, 3, 32).run(prompts, [6, 6, 6], temperature=0)
        counter = CompileCounter()
        engine = _compiled(DecodeEngine(model, 3, 32), counter)
        assert engine.run(prompts, [6, 6, 6], temperature=0) == expected
        compiled_in_first = counter.frame_count
        assert compiled_in_first >= 1 and engine._prefill_compiled_ran
        assert engine.run(prompts, [6, 6, 6], temperature=0) == expected
        assert counter.frame_count == compiled_in_first


# ---- prefill replayed from CUDA graphs ------------------------------------------------------

@pytest.mark.parametrize("name", ["model", "gqa_model"])
def test_rows_padded_to_a_power_of_two_change_no_output(name, request):
    # What prefill graphs add on the CPU: each chunk's last prompt repeated up to a power of two
    # of rows (its copies write the same slot) and the width rounded up to PREFILL_BUCKET.
    m = request.getfixturevalue(name)
    prompts = _prompts(11, seed=9)
    budgets = [3, 9, 1, 14, 6, 2, 11, 5, 8, 4, 7]
    with torch.inference_mode():
        expected = DecodeEngine(m, 3, 48).run(prompts, budgets, temperature=0)
        padded = DecodeEngine(m, 3, 48)
        padded._pad_prefill_rows, padded.prefill_bucket = True, PREFILL_BUCKET
        assert padded.run(prompts, budgets, temperature=0) == expected  # refills of 1-3 rows
        slots = [2, 0, 1]
        torch.testing.assert_close(padded._prefill(slots, prompts[:3]), _prefill_row_by_row(padded, slots, prompts[:3]),
                                   rtol=1e-5, atol=1e-5)


def test_prefill_graphs_need_cuda_graphs_and_no_compile(model):
    engine = DecodeEngine(model, 2, 16)  # on the CPU: no CUDA graphs
    assert not engine.prefill_graphs and not engine._pad_prefill_rows and engine.prefill_bucket == 1


@pytest.mark.gpu
def test_prefill_graphs_on_cuda_equal_the_eager_prefill():
    for kw in ({}, {"num_kv_heads": 2, "qk_norm": True, "sliding_window": 24}):
        m = peaked_cuda_lm(num_layers=2, context_length=600, **kw)
        with torch.inference_mode():
            graphs = DecodeEngine(m, 4, 192, len_bucket=64)
            eager = DecodeEngine(m, 4, 192, len_bucket=64, prefill_graphs=False)
            assert graphs.prefill_graphs and not eager.prefill_graphs
            for seed in range(3):  # the same shapes again with other tokens: the graphs are replayed
                prompts = _prompts(9, seed=seed, lo=5, hi=60)
                budgets = [40 - 3 * i for i in range(9)]
                assert graphs.run(prompts, budgets, temperature=0) == eager.run(prompts, budgets, temperature=0)
            # (the first prefill of an engine runs eagerly; shapes past the kept ones too)
            assert 0 < len(graphs._prefill_graph_cache) <= PREFILL_GRAPHS_KEPT
