import logging
import sys
import types

import pytest
import torch

from scratchlm.infer.kv_cache import KVCache
from scratchlm.model import attention_backends
from scratchlm.model.attention import MultiHeadSelfAttention
from scratchlm.model.attention_backends import (
    ATTENTION_BACKENDS,
    FlashTorchAttention,
    attention_backend_names,
    make_attention_backend,
)
from scratchlm.model.config import ModelConfig
from scratchlm.model.rope import RotaryEmbedding
from scratchlm.model.transformer import TransformerLM
from tests.docs_examples import python_blocks

D, H = 32, 4
LOGGER = "scratchlm.model.attention_backends"


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    # "once per process": each test starts as a fresh process would.
    monkeypatch.setattr(attention_backends, "_warned", set())


def test_registry_names_its_backends_by_their_own_name():
    assert attention_backend_names() == ("math", "flash_torch", "flash_triton")
    for name, cls in ATTENTION_BACKENDS.items():
        assert cls.name == name
        assert make_attention_backend(name).name == name


def test_config_validates_against_the_registry(monkeypatch):
    for name in attention_backend_names():
        ModelConfig(attention_backend=name)
    with pytest.raises(ValueError, match="'math', 'flash_torch', 'flash_triton'"):
        ModelConfig(attention_backend="nope")
    monkeypatch.setitem(ATTENTION_BACKENDS, "nope", FlashTorchAttention)
    ModelConfig(attention_backend="nope")  # registered, so valid: no second list of names


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="choose one of math, flash_torch, flash_triton"):
        make_attention_backend("nope")


def _pair(backend, dtype=torch.float64):
    torch.manual_seed(0)
    rope = RotaryEmbedding(10_000.0, D // H, 64)
    ref = MultiHeadSelfAttention(D, H, rope, dtype=dtype)
    other = MultiHeadSelfAttention(D, H, rope, backend=backend, dtype=dtype)
    other.load_state_dict(ref.state_dict())
    return ref, other


def _fallback_warnings(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


@pytest.mark.parametrize("backend", ["flash_torch", "flash_triton"])
def test_kv_cache_with_a_flash_backend_decodes_on_math_and_says_so_once(backend, caplog):
    ref, flash = _pair(backend)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    outs = []
    for attn in (ref, flash):
        cache = KVCache(1, 2, H, 8, D // H)
        outs.append(torch.cat([attn(x[:, :4], kv_cache=cache)] + [attn(x[:, t:t + 1], kv_cache=cache)
                                                                  for t in range(4, 7)], 1))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)  # the same math path, bit for bit
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 1  # four cached calls, one line
    assert backend in warnings[0].getMessage() and "KV cache" in warnings[0].getMessage()


@pytest.mark.parametrize("backend", ["flash_torch", "flash_triton"])
def test_padding_mask_with_a_flash_backend_runs_on_math_and_says_so_once(backend, caplog):
    ref, flash = _pair(backend)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    mask = torch.tensor([[True] * 6, [False] * 2 + [True] * 4])
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    for _ in range(2):
        torch.testing.assert_close(flash(x, pos, attention_mask=mask), ref(x, pos, attention_mask=mask), rtol=0, atol=0)
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 1 and "padding mask" in warnings[0].getMessage()


def test_flash_triton_on_cpu_runs_on_math_and_says_so_once(caplog):
    ref, flash = _pair("flash_triton")
    x = torch.randn(2, 5, D, dtype=torch.float64)
    torch.testing.assert_close(flash(x), ref(x), rtol=0, atol=0)
    flash(x)
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 1 and "cpu tensors" in warnings[0].getMessage()


def test_backends_that_take_the_call_say_nothing(caplog):
    ref, flash = _pair("flash_torch")
    x = torch.randn(2, 5, D, dtype=torch.float64)
    ref(x, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    ref(x[:, :2], kv_cache=KVCache(1, 2, H, 8, D // H))
    flash(x)
    assert _fallback_warnings(caplog) == []


def test_flash_torch_gets_strided_views_of_the_projections():
    # The flash path hands its kernel (B, H, T, d) views of (B, T, H, d) memory, as before the
    # registry: no copy before the kernel, and its output's transpose back is a view.
    _, flash = _pair("flash_torch", dtype=torch.float32)
    seen = []
    real = flash._backend._apply

    def spy(q, k, v, is_causal):
        seen.append((q, k, v, is_causal))
        return real(q, k, v, is_causal)

    flash._backend._apply = spy
    flash(torch.randn(2, 5, D))
    (q, k, v, is_causal), = seen
    assert is_causal is True
    for t in (q, k, v):
        assert t.shape == (2, H, 5, D // H) and t.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("backend,call", [("flash_triton", "plain"), ("flash_torch", "padding")])
def test_fallback_compiles_without_a_graph_break(backend, call):
    # The once-only log is skipped while torch.compile traces: fullgraph=True fails on a break.
    ref, flash = _pair(backend, dtype=torch.float32)
    x = torch.randn(2, 5, D)
    kwargs = {"attention_mask": torch.tensor([[True] * 5, [False] + [True] * 4])} if call == "padding" else {}
    torch._dynamo.reset()
    compiled = torch.compile(flash, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, **kwargs), ref(x, **kwargs))


# --- docs/extending.md: the worked example runs ----------------------------------------------

def _install_docs_backend(monkeypatch):
    """Run the page's blocks as the files they stand for; return the example's namespace."""
    new_file, registry_line, usage = python_blocks("extending.md", "An attention backend")
    module = types.ModuleType("scratchlm.model.attention_sdpa")
    exec(compile(new_file, "docs/extending.md (attention_sdpa.py)", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    registry = dict(vars(attention_backends))  # the block is a line of attention_backends.py
    exec(compile(registry_line, "docs/extending.md (attention_backends.py)", "exec"), registry)
    shown = registry["ATTENTION_BACKENDS"]
    assert {k: v for k, v in shown.items() if k != "sdpa"} == ATTENTION_BACKENDS  # the page shows today's dict
    monkeypatch.setattr(attention_backends, "ATTENTION_BACKENDS", shown)
    namespace = {}
    exec(compile(usage, "docs/extending.md (usage)", "exec"), namespace)
    return namespace


def test_docs_example_backend_matches_math(monkeypatch):
    ns = _install_docs_backend(monkeypatch)
    model, token_ids = ns["model"], ns["token_ids"]
    assert model.layers[0].attn._backend.name == "sdpa"
    assert "sdpa" in attention_backend_names()
    ModelConfig(attention_backend="sdpa")
    reference = TransformerLM(vocab_size=256, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=128)
    reference.load_state_dict(model.state_dict())
    logits = ns["logits"]
    assert logits.dtype == torch.float32 and logits.shape == (2, 16, 256)
    expected = reference(token_ids)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(logits, torch.zeros_like(logits))
    # ... and trains the same: gradients of every weight agree too.
    logits.square().mean().backward()
    expected.square().mean().backward()
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
