"""The engine's prefill: rows back in prompt order, and its compiled forward against the eager one."""

import pytest
import torch

from scratchlm.infer.engine import DecodeEngine, _lm_logits
from scratchlm.infer.static_cache import PrefillView
from scratchlm.model.transformer import TransformerLM

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
