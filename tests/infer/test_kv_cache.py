import pytest
import torch
import torch.nn.functional as F

from scratchlm.infer.kv_cache import KVCache
from scratchlm.model.transformer import TransformerLM


def test_update_appends_and_returns_prefix():
    cache = KVCache(2, 3, 4, 10, 8)
    k1, v1 = torch.randn(3, 4, 6, 8), torch.randn(3, 4, 6, 8)
    k, v = cache.update(0, k1, v1)
    assert k.shape == (3, 4, 6, 8) and torch.equal(k, k1) and torch.equal(v, v1)
    assert cache.lengths == [6, 0] and cache.seq_len == 6
    k2 = torch.randn(3, 4, 1, 8)
    k, v = cache.update(0, k2, k2)
    assert torch.equal(k, torch.cat([k1, k2], 2))
    with pytest.raises(ValueError, match="overflow"):
        cache.update(0, torch.randn(3, 4, 4, 8), torch.randn(3, 4, 4, 8))
    with pytest.raises(ValueError, match="batch"):
        cache.update(1, torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8))


def test_positions_and_key_mask_with_padding():
    cache = KVCache(1, 2, 1, 6, 2, pad_lens=[0, 2])
    assert cache.positions(4).tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]
    cache.update(0, torch.randn(2, 1, 4, 2), torch.randn(2, 1, 4, 2))
    assert cache.positions(1).tolist() == [[4], [2]]
    assert cache.key_mask(4).tolist() == [[True] * 4, [False, False, True, True]]
    assert KVCache(1, 2, 1, 6, 2).key_mask(3) is None


def test_dtype_follows_first_update_and_reset():
    cache = KVCache(1, 1, 1, 4, 2)
    k, _ = cache.update(0, torch.randn(1, 1, 2, 2, dtype=torch.bfloat16), torch.randn(1, 1, 2, 2, dtype=torch.bfloat16))
    assert k.dtype == torch.bfloat16
    cache.reset()
    assert cache.seq_len == 0


def test_for_model():
    model = TransformerLM(50, 16, 32, 3, 4, 64, 10_000.0)
    cache = KVCache.for_model(model, 2, 16)
    assert (cache.num_layers, cache.num_heads, cache.head_dim, cache.max_len) == (3, 4, 8, 16)


def test_attention_mask_is_causal_padding_aware_and_shared():
    cache = KVCache(2, 2, 1, 8, 2, pad_lens=[0, 2])
    cache.update(0, torch.randn(2, 1, 4, 2), torch.randn(2, 1, 4, 2))
    mask = cache.attention_mask(4, 4)
    assert mask.shape == (2, 1, 4, 4)
    assert mask[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                   [True, True, True, False], [True, True, True, True]]
    assert mask[1, 0].tolist() == [[False] * 4, [False] * 4, [False, False, True, False], [False, False, True, True]]
    assert cache.attention_mask(4, 4) is mask  # the next layer reuses it
    assert cache.attention_mask(1, 5)[1, 0].tolist() == [[False, False, True, True, True]]
    plain = KVCache(1, 1, 1, 8, 2)
    plain.update(0, torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2))
    assert plain.attention_mask(3, 3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert plain.attention_mask(1, 4) is None


def test_for_model_stores_the_kv_heads_and_the_window():
    model = TransformerLM(50, 16, 32, 3, 4, 64, 10_000.0, num_kv_heads=1, sliding_window=3)
    cache = KVCache.for_model(model, 2, 16)
    assert (cache.num_heads, cache.head_dim, cache.sliding_window) == (1, 8, 3)


def test_attention_mask_with_a_sliding_window():
    cache = KVCache(1, 2, 1, 8, 2, pad_lens=[0, 1], sliding_window=2)
    cache.update(0, torch.randn(2, 1, 4, 2), torch.randn(2, 1, 4, 2))
    mask = cache.attention_mask(4, 4)
    assert mask[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                   [False, True, True, False], [False, False, True, True]]
    assert mask[1, 0].tolist() == [[False] * 4, [False, True, False, False],
                                   [False, True, True, False], [False, False, True, True]]
    plain = KVCache(1, 1, 1, 8, 2, sliding_window=2)
    plain.update(0, torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2))
    assert plain.attention_mask(1, 2) is None  # the window covers every key
    assert plain.attention_mask(1, 3).tolist() == [[False, True, True]]


@pytest.mark.parametrize("T,masked", [(1, True), (1, False), (5, False)])
def test_grouped_sdpa_equals_repeated_kv_heads(T, masked):
    from scratchlm.infer.static_cache import grouped_sdpa
    from scratchlm.model.attention import repeat_kv

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 6, T, 8), torch.randn(3, 2, 7, 8), torch.randn(3, 2, 7, 8)
    mask = torch.rand(3, 1, 1, 7) > 0.3 if masked else None
    if masked:
        mask[:, ..., 0] = True
    expected = F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask)
    torch.testing.assert_close(grouped_sdpa(q, k, v, mask), expected, rtol=1e-5, atol=1e-6)
    if T > 1:
        expected = F.scaled_dot_product_attention(q, repeat_kv(k[:, :, :T], 3), repeat_kv(v[:, :, :T], 3),
                                                  is_causal=True)
        torch.testing.assert_close(grouped_sdpa(q, k[:, :, :T], v[:, :, :T], is_causal=True), expected,
                                   rtol=1e-5, atol=1e-6)
