"""The decoding engine (static cache, refill, compaction) against the dynamic-cache reference."""

import pytest
import torch

from scratchlm.infer.engine import DecodeEngine, batch_buckets
from scratchlm.infer.generate import generate
from scratchlm.model.transformer import TransformerLM
from tests.char_tokenizer import CharTokenizer, tiny_llama_policies
from tests.infer.cuda_models import peaked_cuda_lm


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TransformerLM(vocab_size=50, context_length=64, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                      rope_theta=10_000.0, dtype=torch.float32)
    with torch.no_grad():  # confident greedy paths: no argmax near-ties between equal computations
        m.lm_head.weight.mul_(8)
    return m.eval()


def _prompts(n, seed=0, lo=1, hi=20):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 50, (k,), generator=g).tolist() for k in lens]


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]


def test_static_equals_dynamic_greedy_ragged(model):
    prompts = _prompts(7)
    static = generate(model, prompts, 20, temperature=0)
    dynamic = generate(model, prompts, 20, temperature=0, kv_cache="dynamic")
    assert static == dynamic
    assert len({tuple(o) for o in static}) > 1


def test_refill_and_compaction_keep_every_row_exact(model, monkeypatch):
    # 11 prompts through 3 slots: finished rows' slots take waiting prompts, then the batch
    # shrinks; with stop ids rows finish at different steps.
    prompts = _prompts(11, seed=1)
    free = generate(model, prompts, 25, temperature=0, kv_cache="dynamic")
    stops = [free[0][2], free[3][5]]
    expected = generate(model, prompts, 25, temperature=0, kv_cache="dynamic", eos_id=stops)
    assert any(len(e) < 25 for e in expected) and any(len(e) == 25 for e in expected)
    calls = {"refill": 0, "compact": 0}
    start_rows, compact = DecodeEngine._start_rows, DecodeEngine._compact

    def counting(name, fn):
        def wrapper(self, *args, **kwargs):
            calls[name] += 1
            return fn(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(DecodeEngine, "_start_rows", counting("refill", start_rows))
    monkeypatch.setattr(DecodeEngine, "_compact", counting("compact", compact))
    for max_batch in (1, 3, 4, 11):
        assert generate(model, prompts, 25, temperature=0, eos_id=stops, max_batch=max_batch) == expected
    assert calls["refill"] > 4 and calls["compact"] > 0  # both were exercised
    for e in expected:
        cut = [i for i, t in enumerate(e) if t in stops]
        assert not cut or cut[0] == len(e) - 1  # ends at its first stop id


def test_engine_run_directly_with_per_row_budgets(model):
    prompts = _prompts(5, seed=2)
    budgets = [0, 1, 7, 30, 12]
    engine = DecodeEngine(model, 2, 64, check_every=3)
    outs = engine.run(prompts, budgets, temperature=0)
    assert [len(o) for o in outs] == budgets
    for p, g, o in zip(prompts, budgets, outs):
        if g:
            assert o == generate(model, [p], g, temperature=0, kv_cache="dynamic")[0]
    assert engine.run(prompts, budgets, temperature=0) == outs  # the engine is reusable
    with pytest.raises(ValueError, match="max_len"):
        engine.run([[1] * 40], [30])


def test_greedy_steps_replayed_together_give_the_same_tokens(model, monkeypatch):
    # n greedy steps a replay where the window and the next check allow: the same steps, so the
    # same tokens, with refills, compaction, stop ids and windows of 8 slots that the steps cross
    prompts = _prompts(7, seed=9)
    budgets = [5, 30, 17, 9, 26, 1, 22]
    stops = [3, 11]
    expected = DecodeEngine(model, 3, 64, len_bucket=8, check_every=8).run(prompts, budgets, temperature=0,
                                                                           stop_ids=stops)
    engine = DecodeEngine(model, 3, 64, len_bucket=8, check_every=8)
    engine.steps_per_replay = 4
    calls = []
    step = DecodeEngine._step
    monkeypatch.setattr(DecodeEngine, "_step", lambda self, b, L, greedy, n=1: calls.append(n) or step(
        self, b, L, greedy, n))
    assert engine.run(prompts, budgets, temperature=0, stop_ids=stops) == expected
    assert 4 in calls and 1 in calls  # both kinds ran
    calls.clear()
    engine.run(prompts, budgets, temperature=1.0, stop_ids=stops)
    assert set(calls) == {1}  # a sampled step draws between steps


def test_sampling_seeded_and_rows_independent_of_slots(model):
    prompts = _prompts(6, seed=3)
    kw = dict(temperature=1.2, top_k=20, top_p=0.9, seed=5)
    a = generate(model, prompts, 15, **kw)
    assert a == generate(model, prompts, 15, **kw)
    # no row finishes early, so the same draws happen in the same order as the reference loop
    assert a == generate(model, prompts, 15, kv_cache="dynamic", **kw)
    assert a != generate(model, prompts, 15, **{**kw, "seed": 6})
    few = generate(model, prompts, 15, max_batch=2, **kw)  # other draws, same lengths and vocabulary
    assert [len(x) for x in few] == [15] * 6 and all(0 <= t < 50 for row in few for t in row)


def test_static_cache_with_bfloat16_autocast_runs(model):
    prompts = _prompts(3, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, prompts, 6, temperature=0)
    assert [len(o) for o in out] == [6, 6, 6]



_MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _engine_tensors(engine):
    cache = engine.cache
    held = [engine.tokens, engine.lens, engine.n_out, engine.budget, engine.done, engine.out, engine.stop_ids]
    held += [t for t in cache.k + cache.v if t is not None]
    held += [t for w_b in cache.projections.stacked.values() for t in w_b if t is not None]
    return held + [engine.head.weight]


@pytest.mark.parametrize("built_in", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("modes", [("inference_mode", "no_grad"), ("no_grad", "inference_mode")])
def test_one_engine_runs_under_inference_mode_and_no_grad_in_turn(model, modes, built_in):
    # The buffers are allocated lazily, inside the first run: under inference mode they would
    # be inference tensors, which a later run outside it could not update in place.
    prompts = _prompts(5, seed=6)
    budgets = [9, 4, 12, 7, 10]
    stops = list(range(20, 31))  # more than the 8 stop ids the engine holds at first: a new table
    with torch.no_grad():
        expected = DecodeEngine(model, 3, 64, check_every=2).run(prompts, budgets, temperature=0,
                                                                 stop_ids=stops)
    with _MODES[built_in]():
        engine = DecodeEngine(model, 3, 64, check_every=2)
    assert engine.cache.projections is not None and engine.head is not None  # every copy is exercised
    for mode in modes * 2:
        with _MODES[mode]():
            assert engine.run(prompts, budgets, temperature=0, stop_ids=stops) == expected, mode
    assert not any(t.is_inference() for t in _engine_tensors(engine))

@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_engine_matches_dynamic(compile):
    m = peaked_cuda_lm(num_layers=3, context_length=600)
    prompts = [list(range(1, 40)), [5], list(range(100, 117)), list(range(7, 290))] * 3
    expected = generate(m, prompts, 300, temperature=0, kv_cache="dynamic", eos_id=[17, 99])
    assert generate(m, prompts, 300, temperature=0, eos_id=[17, 99], compile=compile, max_batch=5) == expected
    sampled = generate(m, prompts, 40, temperature=1.0, top_p=0.9, seed=1, compile=compile)
    assert sampled == generate(m, prompts, 40, temperature=1.0, top_p=0.9, seed=1, compile=compile)


def test_hf_llama_policy_samples_through_the_engine_like_hf_generate():
    hf, engine, reference = tiny_llama_policies(num_key_value_heads=4)
    prompts = ["hello there", "x", "a longer prompt of text"]
    ours = engine.generate(prompts, max_new_tokens=12, temperature=0.0)
    assert engine._twin not in (None, False)  # the engine path was taken
    theirs = reference.generate(prompts, max_new_tokens=12, temperature=0.0)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert len({tuple(c.token_ids) for c in ours}) > 1
    with torch.no_grad():  # a training step changes the weights: the twin follows
        hf.lm_head.weight.mul_(-1)
    assert [c.token_ids for c in engine.generate(prompts, max_new_tokens=12, temperature=0.0)] == \
        [c.token_ids for c in reference.generate(prompts, max_new_tokens=12, temperature=0.0)]


def test_engine_is_kept_per_model_and_released(model):
    from scratchlm.infer import generate as gen

    generate(model, [[1, 2, 3]], 4, temperature=0)
    engine = gen._ENGINES[model][1]
    generate(model, [[4, 5]], 4, temperature=0)
    assert gen._ENGINES[model][1] is engine  # same shape: reused
    gen.release_engines(model)
    assert model not in gen._ENGINES


def test_greedy_calls_share_a_kept_engine_of_other_slot_counts(model):
    from scratchlm.infer import generate as gen

    gen.release_engines(model)
    prompts = _prompts(6, seed=8)
    expected = generate(model, prompts, 5, temperature=0, kv_cache="dynamic")
    sampled = generate(model, prompts[:4], 5, temperature=1.0, seed=1)  # an engine of 4 slots
    engine = gen._ENGINES[model][1]
    assert engine.slots == 4
    assert generate(model, prompts, 5, temperature=0) == expected  # 6 rows in the kept 4 slots
    assert generate(model, prompts[:1], 5, temperature=0) == expected[:1]  # 1 row in them
    assert gen._ENGINES[model][1] is engine
    assert generate(model, prompts[:4], 5, temperature=1.0, seed=1) == sampled  # and the same draws after
    generate(model, prompts, 5, temperature=0, max_batch=3)  # at most 3 rows at once: not the kept 4
    assert gen._ENGINES[model][1] is not engine
    engine = gen._ENGINES[model][1]
    generate(model, prompts[:4], 5, temperature=0.8, seed=2)  # sampled: exactly 4 slots
    assert gen._ENGINES[model][1] is not engine and gen._ENGINES[model][1].slots == 4
    gen.release_engines(model)


@pytest.fixture(scope="module")
def gqa_model():
    # grouped-query attention (2 kv heads for 4 query heads), QK-norm and a window shorter than
    # the prompts plus their completions
    torch.manual_seed(1)
    m = TransformerLM(vocab_size=50, context_length=64, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                      num_kv_heads=2, qk_norm=True, sliding_window=6, dtype=torch.float32)
    with torch.no_grad():
        m.lm_head.weight.mul_(8)
    return m.eval()


def _greedy_uncached(model, prompt, n):
    # The definition: argmax of a full-sequence forward, one token at a time, no cache.
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_gqa_sliding_window_engine_equals_uncached_argmax(gqa_model):
    from scratchlm.infer.static_cache import StaticKVCache

    prompts = _prompts(5, seed=3, lo=2, hi=14)
    ours = generate(gqa_model, prompts, 12, temperature=0)
    assert ours == [_greedy_uncached(gqa_model, p, 12) for p in prompts]
    assert len({tuple(o) for o in ours}) > 1
    assert generate(gqa_model, prompts, 12, temperature=0, kv_cache="dynamic") == ours
    assert generate(gqa_model, prompts, 12, temperature=0, use_kv_cache=False) == ours
    cache = StaticKVCache.for_model(gqa_model, 2, 16, device="cpu")
    assert (cache.num_heads, cache.sliding_window) == (2, 6)  # the cache holds only the kv heads


def test_gqa_engine_refill_keeps_rows_exact(gqa_model):
    prompts = _prompts(7, seed=4, lo=1, hi=10)
    budgets = [3, 9, 1, 7, 12, 2, 5]
    engine = DecodeEngine(gqa_model, slots=3, max_len=32, len_bucket=8, check_every=2)
    with torch.inference_mode():
        outs = engine.run(prompts, budgets, temperature=0)
    assert outs == [_greedy_uncached(gqa_model, p, b) for p, b in zip(prompts, budgets)]


def test_hf_qwen2_greedy_generate_equals_the_engine():
    transformers = pytest.importorskip("transformers")
    from scratchlm.align.policy import HFPolicy

    for window in (None, 5):
        config = transformers.Qwen2Config(
            vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=True, eos_token_id=0, bos_token_id=0,
            use_sliding_window=window is not None, sliding_window=window, max_window_layers=0)
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        hf = transformers.Qwen2ForCausalLM(config).eval()
        with torch.no_grad():
            # weights far from Hugging Face's small init, so that attention (and the window) matters
            for name, p in hf.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.5)
                elif p.dim() == 2:
                    p.normal_(0, p.shape[1] ** -0.5)
            hf.model.norm.weight.mul_(2)  # confident argmaxes
            hf.lm_head.weight[0] -= 3  # (tied: also the embedding of) eos, rarer: longer completions
        prompts = ["hello there", "x", "a longer prompt of text"]
        engine = HFPolicy(hf, CharTokenizer())
        ours = engine.generate(prompts, max_new_tokens=12, temperature=0.0)
        twin = engine._twin
        assert twin not in (None, False)  # the engine path was taken
        assert (twin[1].qkv_bias, twin[1].num_kv_heads, twin[1].sliding_window) == (True, 2, window)
        theirs = HFPolicy(hf, CharTokenizer(), use_engine=False).generate(prompts, max_new_tokens=12,
                                                                            temperature=0.0)
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        assert len({tuple(c.token_ids) for c in ours}) > 1


def test_graph_capture_turns_autocast_cache_off_and_keeps_autocast():
    from scratchlm.infer.engine import _uncached_autocast

    with _uncached_autocast("cpu"):  # no autocast: nothing changes
        assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_cache_enabled()
        with _uncached_autocast("cpu"):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert not torch.is_autocast_cache_enabled()
        assert torch.is_autocast_cache_enabled()


@pytest.mark.gpu
def test_captured_steps_see_weights_updated_between_runs_under_autocast():
    # Under no_grad (every torch version caches cast weights there) and bf16 autocast, a weight
    # that reaches the step through autocast's cast (not a stacked or padded copy), changed
    # between runs, must change what the captured steps compute.
    m = peaked_cuda_lm(num_layers=2, context_length=600)
    prompts = [list(range(1, 30)), [5, 6], list(range(40, 57))]
    engine = DecodeEngine(m, 3, 128, len_bucket=64)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        engine.run(prompts, [30, 30, 30], temperature=0)
    with torch.no_grad():
        for block in m.layers:
            block.attn.output_proj.weight.mul_(-1.0)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        got = engine.run(prompts, [30, 30, 30], temperature=0)
        fresh = DecodeEngine(m, 3, 128, len_bucket=64).run(prompts, [30, 30, 30], temperature=0)
    assert got == fresh
