"""The fused decode step's head (`scratchlm.infer.fused_head`): the final norm, the LM head and the
greedy argmax of the module's step, and the heads it leaves to the module.

On the CPU without TRITON_INTERPRET=1 `decode_head` takes its torch path, so what is checked
there is the wiring (the residual stream before the final norm, the padded weight, the vocab);
under the interpreter the kernels run."""

import pytest
import torch

from scratchlm.infer.engine import DecodeEngine
from scratchlm.infer.fused_head import head_spec
from scratchlm.model.transformer import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(vocab=50, **kw):
    torch.manual_seed(0)
    return TransformerLM(vocab_size=vocab, context_length=64, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                         rope_theta=10_000.0, dtype=torch.float32, **kw).eval()


def _next(model, fused_head, rows):
    engine = DecodeEngine(model, rows, 32, fused_blocks=True)
    engine.fused_head = fused_head
    engine._refresh_projections()
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]][:rows]
    engine._prefill(list(range(rows)), prompts)
    with torch.no_grad():
        ln = model.ln_final.weight
        ln.copy_(torch.linspace(0.5, 1.5, ln.numel()))  # a final norm whose weight matters
    return engine._decode_next(torch.tensor([7, 8, 9, 10][:rows]), torch.tensor([len(p) for p in prompts]), 32)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kw", [{}, {"vocab": 64}, {"vocab": 64, "tie_embeddings": True}])
def test_the_fused_head_gives_the_module_heads_logits_and_argmax(rows, kw):
    model = _model(**kw)
    assert head_spec(model, None) is not None
    expected_logits, expected_argmax = _next(model, False, rows)
    logits, argmax = _next(model, True, rows)
    assert logits.dtype == torch.float32 and logits.shape == expected_logits.shape == (rows, model.vocab_size)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(argmax, expected_argmax)
    assert torch.equal(argmax, logits.argmax(dim=-1))


def test_the_fused_head_reads_the_residual_stream_before_the_final_norm(monkeypatch):
    from scratchlm.infer import fused_head

    seen = {}
    real = fused_head.decode_head

    def recording(h, w, vocab, norm_weight, eps, pdl):
        seen.update(h=h, vocab=vocab, norm_weight=norm_weight, w=w)
        return real(h, w, vocab, norm_weight, eps, pdl=pdl)

    monkeypatch.setattr(fused_head, "decode_head", recording)
    model = _model()
    _next(model, True, 2)
    assert seen["vocab"] == 50 and seen["w"].shape == (64, 32)  # the padded copy, its real rows only
    assert seen["norm_weight"] is model.ln_final.weight
    assert not torch.allclose(model.ln_final(seen["h"]), seen["h"])  # not normalised yet


def test_heads_the_fused_head_would_not_reproduce_stay_with_the_module():
    assert head_spec(_model(logit_softcap=30.0), None) is None
    assert head_spec(_model(use_rmsnorm=False), None) is None
    hooked = _model()
    hooked.lm_head.register_forward_hook(lambda *a: None)
    assert head_spec(hooked, None) is None
    half = _model().to(torch.bfloat16)
    assert head_spec(half, None) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 weights a bf16 matmul would cast
        assert head_spec(_model(), None) is None


def test_the_fused_head_is_off_unless_asked_for():
    # slower than the compiled module head on an H100 at GPT-2-small's shape (decode_linear.md)
    engine = DecodeEngine(_model(), 1, 32, fused_blocks=True)
    assert engine.fused_head is False
