"""The decoding engine's padded LM head: same logits and tokens as the model's own head."""

import pytest
import torch

from scratchlm.infer.engine import DecodeEngine
from scratchlm.infer.padded_head import HEAD_ROW_MULTIPLE, PaddedHead
from scratchlm.model.transformer import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(vocab=50, **kw):
    torch.manual_seed(0)
    m = TransformerLM(vocab_size=vocab, context_length=64, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                      rope_theta=10_000.0, dtype=torch.float32, **kw)
    with torch.no_grad():  # confident greedy paths: no argmax near-ties between equal computations
        m.lm_head.weight.mul_(8)
    return m.eval()


def _prompts(n, seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in torch.randint(1, 20, (n,), generator=g).tolist()]


def _logits(engine):
    """Prefill logits of two rows, then one decode step's."""
    engine._refresh_projections()
    prefill = engine._prefill([0, 1], [[1, 2, 3], [4, 5]])
    decode = engine._decode_logits(torch.tensor([7, 8]), torch.tensor([3, 2]), 32)
    return prefill, decode


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True}, {"logit_softcap": 5.0}])
def test_padded_head_gives_the_logits_and_tokens_of_the_model_head(kw):
    model = _model(**kw)
    padded = DecodeEngine(model, 4, 64)
    plain = DecodeEngine(model, 4, 64, pad_lm_head=False)
    assert padded.head is not None and plain.head is None
    for a, b in zip(_logits(padded), _logits(plain)):
        assert a.shape == b.shape == (2, 50)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    w = padded.head.weight
    assert w.shape == (HEAD_ROW_MULTIPLE, 32) and not w[50:].any()
    prompts = _prompts(6)
    greedy = padded.run(prompts, [12] * 6, temperature=0)
    assert greedy == plain.run(prompts, [12] * 6, temperature=0)
    assert len({tuple(o) for o in greedy}) > 1
    # sampling, top-k and top-p read the strided logits as the contiguous ones
    sample = dict(temperature=1.0, top_k=20, top_p=0.9)
    drawn = padded.run(prompts, [12] * 6, generator=torch.Generator().manual_seed(3), **sample)
    assert drawn == plain.run(prompts, [12] * 6, generator=torch.Generator().manual_seed(3), **sample)


def test_softcapped_head_is_capped():
    model = _model(logit_softcap=2.0)
    engine = DecodeEngine(model, 2, 32)
    prefill, decode = _logits(engine)
    assert engine.head.cap == 2.0
    assert prefill.abs().max() <= 2.0 and decode.abs().max() <= 2.0
    assert decode.abs().max() > 1.5  # the head's x8 logits, capped


@pytest.mark.parametrize("tied", [False, True])
def test_the_copy_follows_the_model_weights_in_place(tied):
    # GRPO trains the policy between rollouts; a tied head is the embedding table too
    model = _model(tie_embeddings=tied)
    prompts = _prompts(5, seed=3)
    engine = DecodeEngine(model, 4, 64)
    before = engine.run(prompts, [12] * 5, temperature=0)
    logits_before = _logits(engine)[1]
    ptr = engine.head.weight.data_ptr()
    with torch.no_grad():  # through the embedding's name when tied: the same tensor
        w = model.token_embeddings.weight if tied else model.lm_head.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
        w[:, :8].mul_(-1.0)
    after = engine.run(prompts, [12] * 5, temperature=0)
    assert engine.head.weight.data_ptr() == ptr  # captured steps stay valid
    torch.testing.assert_close(engine.head.weight[:50], model.lm_head.weight, rtol=0, atol=0)
    plain = DecodeEngine(model, 4, 64, pad_lm_head=False)
    assert after == plain.run(prompts, [12] * 5, temperature=0)
    logits_after = _logits(engine)[1]
    torch.testing.assert_close(logits_after, _logits(plain)[1], rtol=1e-6, atol=1e-6)
    assert (logits_after - logits_before).abs().max() > 1.0
    if not tied:  # (a tied model this small mostly repeats its last token, whatever the weights)
        assert after != before


def test_no_copy_for_a_vocabulary_multiple_of_64():
    model = _model(vocab=128)
    engine = DecodeEngine(model, 2, 32)
    assert engine.head is None
    prompts = _prompts(3, vocab=128)
    assert len(engine.run(prompts, [5] * 3, temperature=0)[0]) == 5


def test_a_head_with_hooks_or_an_outside_cap_stays_the_module():
    model = _model()
    calls = []
    handle = model.lm_head.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    engine = DecodeEngine(model, 2, 32)
    assert engine.head is None
    engine.run([[1, 2, 3]], [3], temperature=0)
    assert len(calls) >= 3  # prefill and the decode steps, all through the hooked module
    handle.remove()

    model.logit_softcap = 3.0  # a cap the head module does not apply: not the copy's to reproduce
    assert PaddedHead.for_model(model) is None
    model.logit_softcap = 0.0

    # a hook added after the engine was built: the next run drops the copy and calls the module
    engine = DecodeEngine(model, 2, 32)
    engine.run([[1, 2, 3]], [3], temperature=0)
    assert engine.head.weight is not None
    model.lm_head.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    calls.clear()
    engine.run([[1, 2, 3]], [3], temperature=0)
    assert engine.head.weight is None and len(calls) >= 3


def test_autocast_keeps_the_copy_in_the_autocast_dtype():
    model = _model()
    engine = DecodeEngine(model, 2, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = engine.run([[1, 2, 3]], [4], temperature=0)
        assert out == DecodeEngine(model, 2, 32, pad_lm_head=False).run([[1, 2, 3]], [4], temperature=0)
    assert engine.head.weight.dtype == torch.bfloat16
    engine.run([[1, 2, 3]], [4], temperature=0)  # autocast off again: the model's own dtype
    assert engine.head.weight.dtype == torch.float32


def test_no_copy_where_it_would_crowd_the_gpu(monkeypatch):
    model = _model()
    head = PaddedHead.for_model(model)
    need = head.nbytes()
    assert need == HEAD_ROW_MULTIPLE * 32 * 4
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * need, 8 * need))
    assert head.fits(cuda)
    assert not head.fits(cuda, reserved=1)  # with the stacked copies' bytes, it would not
    assert head.fits(torch.device("cpu"), reserved=10**18)
