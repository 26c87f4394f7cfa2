import pytest
import torch
import torch.nn.functional as F

from scratchlm.infer.sampling import apply_temperature, chunked_argmax, sample_next, top_k_filter, top_p_filter

NEG = float("-inf")


def test_temperature():
    x = torch.tensor([[1.0, 2.0, 4.0]])
    torch.testing.assert_close(apply_temperature(x, 0.5), x * 2)
    with pytest.raises(ValueError):
        apply_temperature(x, 0.0)


def test_top_k_filter():
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0], [4.0, 4.0, 1.0, 5.0]])
    assert top_k_filter(x, 2).tolist() == [[NEG, 3.0, 2.0, NEG], [4.0, 4.0, NEG, 5.0]]
    assert top_k_filter(x, 1).tolist() == [[NEG, 3.0, NEG, NEG], [NEG, NEG, NEG, 5.0]]
    assert torch.equal(top_k_filter(x, 10), x)
    with pytest.raises(ValueError):
        top_k_filter(x, 0)


def test_top_p_filter_examples():
    probs = torch.tensor([[0.2, 0.5, 0.3]])
    logits = probs.log()
    kept = top_p_filter(logits, 0.7)
    assert torch.isinf(kept).tolist() == [[True, False, False]]
    assert torch.isinf(top_p_filter(logits, 0.5)).tolist() == [[True, False, True]]  # 0.5 alone reaches 0.5
    assert torch.isinf(top_p_filter(logits, 0.81)).tolist() == [[False, False, False]]
    assert torch.isinf(top_p_filter(logits, 0.01)).tolist() == [[True, False, True]]  # the top token stays
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_top_p_filter_against_sorted_reference():
    torch.manual_seed(0)
    logits = torch.randn(6, 40, dtype=torch.float64) * 3
    for p in (0.1, 0.5, 0.9, 0.99):
        kept = ~torch.isinf(top_p_filter(logits, p))
        probs = F.softmax(logits, dim=-1)
        for row in range(6):
            order = torch.argsort(probs[row], descending=True)
            cum = torch.cumsum(probs[row][order], 0)
            n = int((cum < p).sum()) + 1  # smallest prefix reaching p
            expected = torch.zeros(40, dtype=torch.bool)
            expected[order[:n]] = True
            assert torch.equal(kept[row], expected), (p, row)
            assert probs[row][kept[row]].sum() >= p - 1e-9


def test_sample_greedy_and_top_k_one():
    torch.manual_seed(0)
    logits = torch.randn(5, 30)
    greedy = sample_next(logits, temperature=0)
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(sample_next(logits, temperature=1.0, top_k=1), greedy)
    assert torch.equal(sample_next(logits, temperature=1.0, top_p=1e-6), greedy)


def test_sample_respects_filters_and_is_seeded():
    logits = torch.tensor([[0.0, 0.0, 0.0, 5.0, 5.0]]).repeat(2000, 1)
    out = sample_next(logits, top_k=2, generator=torch.Generator().manual_seed(1))
    assert set(out.tolist()) == {3, 4}
    again = sample_next(logits, top_k=2, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, again)
    frac = (out == 3).float().mean().item()
    assert 0.45 < frac < 0.55


def test_sample_frequencies_follow_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(20000, 1)
    out = sample_next(logits, temperature=2.0, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(out, minlength=3).double() / out.numel()
    torch.testing.assert_close(freq, F.softmax(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64), -1), atol=0.015, rtol=0)


@pytest.mark.parametrize("temperature", [1e-30, 1e-45, 1e-320])
def test_a_tiny_temperature_samples_the_most_likely_token(temperature):
    # logits / 1e-45 overflowed to +inf and the softmax to NaN: a garbage id was drawn.
    torch.manual_seed(0)
    logits = torch.randn(8, 50) * 4
    out = sample_next(logits, temperature=temperature, top_k=10, top_p=0.9,
                      generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, logits.argmax(-1))
    assert torch.equal(sample_next(logits, temperature=temperature), logits.argmax(-1))


@pytest.mark.parametrize("p", [1e-46, 1e-300])
def test_a_tiny_top_p_keeps_the_most_likely_token(p):
    # p became 0 in float32, every token was removed and the draw from NaN probabilities gave id 0.
    torch.manual_seed(0)
    logits = torch.randn(8, 50) * 4
    assert torch.equal(torch.isinf(top_p_filter(logits, p)), logits != logits.amax(-1, keepdim=True))
    assert torch.equal(sample_next(logits, top_p=p, generator=torch.Generator().manual_seed(0)), logits.argmax(-1))


@pytest.mark.parametrize("V", [1, 7, 64, 50257])
@pytest.mark.parametrize("chunks", [1, 8, 64])
def test_chunked_argmax_is_argmax_ties_included(V, chunks):
    g = torch.Generator().manual_seed(V + chunks)
    logits = torch.randint(-3, 4, (5, V), generator=g).float()  # many ties: the first maximal index wins
    logits[4] = torch.randn(V, generator=g)
    logits[3, -1] = 10.0  # the last column, in the padded slice
    assert torch.equal(chunked_argmax(logits, chunks), logits.argmax(dim=-1))
