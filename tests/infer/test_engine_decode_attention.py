"""The engine with the Triton decode attention generates as with torch's fused attention.

On CPU the kernel runs under TRITON_INTERPRET=1 where triton is installed, else the op's torch
path (fused attention over a mask built from each row's position)."""

import pytest
import torch

from scratchlm.infer.engine import DecodeEngine, default_decode_attention
from tests.infer.cuda_models import peaked_cuda_lm
from tests.infer.test_engine_prefill import _model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kw", [{}, {"num_kv_heads": 2, "qk_norm": True, "sliding_window": 6}])
def test_triton_decode_attention_generates_as_sdpa(kw):
    m = _model(**kw)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 50, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (7,), generator=g)]
    budgets = [12, 3, 25, 9, 1, 17, 30]
    with torch.inference_mode():
        expected = DecodeEngine(m, 3, 64, len_bucket=16, check_every=2, decode_attention="sdpa").run(
            prompts, budgets, temperature=0)
        engine = DecodeEngine(m, 3, 64, len_bucket=16, check_every=2, decode_attention="triton")
        assert engine.cache.decode_attention == "triton"
        assert engine.run(prompts, budgets, temperature=0) == expected
        logits = []
        for e in (DecodeEngine(m, 3, 64, len_bucket=16, decode_attention="sdpa"),
                  DecodeEngine(m, 3, 64, len_bucket=16, decode_attention="triton")):
            e._refresh_projections()
            e._prefill([0, 1, 2], prompts[:3])
            e.lens[:3] = torch.tensor([len(p) for p in prompts[:3]])
            e.tokens[:3] = torch.tensor([5, 6, 7])
            logits.append(e._decode_logits(e.tokens[:3], e.lens[:3], 32))
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_decode_attention_choice_is_checked():
    with pytest.raises(ValueError, match="decode_attention must be 'sdpa', 'triton' or 'auto'"):
        DecodeEngine(_model(), 2, 16, decode_attention="flash")


def test_auto_picks_the_kernel_on_cuda_for_multi_head_attention_only(monkeypatch):
    import scratchlm.kernels.triton_support as support

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    mha, gqa = _model(), _model(num_kv_heads=2)
    assert DecodeEngine(mha, 2, 16).cache.decode_attention == "sdpa"  # on the CPU, interpreter or not
    monkeypatch.setattr(support, "triton_available", lambda: True)
    assert default_decode_attention(mha, cuda) == "triton"
    assert default_decode_attention(gqa, cuda) == "sdpa"
    assert default_decode_attention(mha, cpu) == "sdpa"
    monkeypatch.setattr(support, "triton_available", lambda: False)
    assert default_decode_attention(mha, cuda) == "sdpa"


@pytest.mark.gpu
def test_triton_decode_attention_on_cuda_compiled_and_captured():
    for kw in ({}, {"num_kv_heads": 2, "qk_norm": True, "sliding_window": 24}):
        m = peaked_cuda_lm(num_layers=2, context_length=600, **kw)
        prompts = [list(range(1, 40)), [5], list(range(100, 117)), list(range(7, 60))] * 2
        budgets = [100 - len(p) for p in prompts]
        with torch.inference_mode():
            expected = DecodeEngine(m, 5, 128, len_bucket=64, cuda_graphs=False).run(prompts, budgets, temperature=0)
            for compile in (False, True):
                engine = DecodeEngine(m, 5, 128, len_bucket=64, compile=compile, decode_attention="triton")
                assert engine.run(prompts, budgets, temperature=0) == expected, (kw, compile)
