"""Stacked q|k|v and w1|w3 weights of the decoding engine: same tokens, current weights."""

import pytest
import torch

from scratchlm.infer.engine import DecodeEngine
from scratchlm.infer.stacked import StackedProjections
from scratchlm.infer.static_cache import DecodeView, StaticKVCache
from scratchlm.model.transformer import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(**kw):
    torch.manual_seed(0)
    m = TransformerLM(vocab_size=50, context_length=64, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                      rope_theta=10_000.0, dtype=torch.float32, **kw)
    with torch.no_grad():  # confident greedy paths: no argmax near-ties between equal computations
        m.lm_head.weight.mul_(8)
    return m.eval()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (k,), generator=g).tolist() for k in torch.randint(1, 20, (n,), generator=g).tolist()]


def _run(model, prompts, stack, n=12):
    engine = DecodeEngine(model, 4, 64, stack_projections=stack)
    return engine, engine.run(prompts, [n] * len(prompts), temperature=0)


@pytest.mark.parametrize("kw", [{}, {"num_kv_heads": 2, "qkv_bias": True}, {"qk_norm": True}])
def test_stacked_engine_gives_the_tokens_of_separate_projections(kw):
    model = _model(**kw)
    prompts = _prompts(6)
    engine, stacked = _run(model, prompts, True)
    assert engine.cache.projections is not None and len(engine.cache.projections) == 4  # 2 layers x qkv, w13
    _, separate = _run(model, prompts, False)
    assert stacked == separate
    assert len({tuple(o) for o in stacked}) > 1


def test_decode_logits_match_with_and_without_stacking():
    model = _model(num_kv_heads=2, qkv_bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()  # biases that matter
    logits = []
    for stack in (True, False):
        engine = DecodeEngine(model, 2, 32, stack_projections=stack)
        engine._refresh_projections()
        engine._prefill([0, 1], [[1, 2, 3], [4, 5]])
        logits.append(engine._decode_logits(torch.tensor([7, 8]), torch.tensor([3, 2]), 32))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_a_run_decodes_with_the_weights_the_model_has_then():
    # GRPO trains the policy between rollouts: the stacked copy must follow, in place.
    model = _model()
    prompts = _prompts(5, seed=3)
    engine = DecodeEngine(model, 4, 64)
    before = engine.run(prompts, [12] * 5, temperature=0)
    w, _ = engine.cache.projections.get(0, "qkv")
    ptr = w.data_ptr()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.q_proj.weight.mul_(-3.0)
            layer.ffn.w3.weight.normal_()
    after = engine.run(prompts, [12] * 5, temperature=0)
    assert engine.cache.projections.get(0, "qkv")[0].data_ptr() == ptr  # captured steps stay valid
    assert after != before
    assert after == DecodeEngine(model, 4, 64, stack_projections=False).run(prompts, [12] * 5, temperature=0)


def test_autocast_keeps_the_copy_in_the_autocast_dtype():
    model = _model()
    engine = DecodeEngine(model, 2, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = engine.run([[1, 2, 3]], [4], temperature=0)
    assert len(out[0]) == 4
    assert engine.cache.projections.get(1, "w13")[0].dtype == torch.bfloat16
    engine.run([[1, 2, 3]], [4], temperature=0)  # autocast off again: the model's own dtype
    assert engine.cache.projections.get(1, "w13")[0].dtype == torch.float32


def test_only_plain_projections_stack():
    model = _model(ffn="silu")  # no w1|w3 pair to stack
    model.layers[1].attn.k_proj.register_forward_hook(lambda *a: None)  # a hooked projection stays a module
    projections = StackedProjections.for_model(model)
    projections.refresh()
    assert projections.get(0, "qkv") is not None
    assert projections.get(1, "qkv") is None
    assert projections.get(0, "w13") is None
    cache = StaticKVCache.for_model(model, 1, 8, device="cpu")
    view = DecodeView(cache, torch.tensor([0]), 8)
    assert view.stacked(0, "qkv") is None  # no copy set on the cache: the model's own projections


def test_no_copy_where_it_would_crowd_the_gpu(monkeypatch):
    model = _model()
    projections = StackedProjections.for_model(model)
    need = projections.nbytes()
    assert need == sum(p.numel() * 4 for n, p in model.named_parameters()
                       if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "w1", "w3"))
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * need, 8 * need))
    assert projections.fits(cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * need - 1, 8 * need))
    assert not projections.fits(cuda)
    assert projections.fits(torch.device("cpu"))
