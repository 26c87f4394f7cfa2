"""Packed SFT / LM data: the stream, its windows, masks, shuffling, and the `sft.packed` switch."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from scratchlm.align.config import OptimConfig, SFTConfig
from scratchlm.align.packed import PackedDataset, encode_documents, pack_documents
from scratchlm.align.sft import sft_train
from scratchlm.errors import UserError

EOS = 0


def _documents(n: int, seed: int = 0):
    """(prompt, response) pairs of random lengths; prompt ids in [100, 200), response ids in [200, 300)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(100, 200, rng.integers(1, 8)).tolist(), rng.integers(200, 300, rng.integers(1, 12)).tolist())
            for _ in range(n)]


def _epoch(data, batch_size, epoch=0):
    return list(data.batches(batch_size, start_epoch=epoch))


def test_stream_puts_eos_after_every_document():
    docs = _documents(5) + [[7, 8, 9], ([], [])]
    tokens, flags = pack_documents(docs, EOS)
    expected = []
    for d in docs[:5]:
        expected += d[0] + d[1] + [EOS]
    expected += [7, 8, 9, EOS]  # a plain document; the empty one is skipped
    assert tokens.tolist() == expected
    assert tokens.dtype == np.int64 and flags.dtype == bool and flags.shape == tokens.shape
    assert flags.tolist() == [t < 100 or t >= 200 for t in expected]
    assert pack_documents(docs, EOS, mask_prompt=False)[1].all()


def test_encode_documents_from_texts():
    encode = lambda s: [ord(c) for c in s]  # noqa: E731
    assert encode_documents(encode, [("ab", "c"), "de"]) == [([97, 98], [99]), [100, 101]]


@pytest.mark.parametrize("pad_last", [False, True])
def test_an_epoch_covers_the_stream_exactly_once(pad_last):
    T = 7
    data = PackedDataset(_documents(31), context_length=T, eos_id=EOS, mask_prompt=False, pad_last=pad_last,
                         pad_id=-1, seed=3)
    n = len(data.tokens)
    assert (n - 1) % T  # a partial last window, to be dropped or padded
    assert len(data) == (-(-(n - 1) // T) if pad_last else (n - 1) // T)
    for epoch in range(2):
        batches = _epoch(data, 4, epoch)
        xs = torch.cat([b[0] for b in batches])
        ys = torch.cat([b[1] for b in batches])
        assert len(xs) == len(data)
        # Windows overlap by one token: x is the stream, y the stream one ahead.
        covered = len(data) * T
        stream = np.concatenate([data.tokens, np.full(covered + 1 - n, -1)]) if pad_last else data.tokens
        assert Counter(ys.flatten().tolist()) == Counter(stream[1:covered + 1].tolist())
        assert Counter(xs.flatten().tolist()) == Counter(stream[:covered].tolist())
        # Each row is one window: y is x shifted by one within the stream.
        assert torch.equal(xs[:, 1:], ys[:, :-1])
        if pad_last:
            masks = torch.cat([b[2] for b in batches])
            assert torch.equal(masks, ys != -1) and (ys == -1).any()
        else:
            assert covered <= n - 1 < covered + T  # only a tail shorter than a window is dropped


def test_windows_in_index_order_rebuild_the_stream():
    data = PackedDataset(_documents(20), context_length=5, eos_id=EOS, seed=0)
    x, y, _ = data.batch(range(len(data)))
    assert x.flatten().tolist() == data.tokens[: len(data) * 5].tolist()
    assert y.flatten().tolist() == data.tokens[1: len(data) * 5 + 1].tolist()


def test_loss_mask_is_off_exactly_on_prompt_tokens():
    data = PackedDataset(_documents(40), context_length=9, eos_id=EOS, mask_prompt=True, seed=1)
    for x, y, mask in _epoch(data, 8):
        assert mask.dtype == torch.bool
        assert torch.equal(mask, (y >= 200) | (y == EOS))  # responses and EOS count, prompts do not
        assert (~mask).any()
    plain = PackedDataset(_documents(40), context_length=9, eos_id=EOS, mask_prompt=False, seed=1)
    assert not plain.returns_mask and all(len(b) == 2 for b in _epoch(plain, 8))


def test_shapes_and_the_short_last_batch():
    data = PackedDataset(_documents(50), context_length=6, eos_id=EOS, seed=0)
    batches = _epoch(data, 5)
    assert len(batches) == -(-len(data) // 5)
    for x, y, mask in batches[:-1]:
        assert x.shape == y.shape == mask.shape == (5, 6) and x.dtype == y.dtype == torch.long
    assert batches[-1][0].shape == ((len(data) - 1) % 5 + 1, 6)
    assert len(list(data.batches(5, epochs=3))) == 3 * len(batches)


def test_order_is_a_seeded_permutation_per_epoch():
    docs = _documents(60)
    a = PackedDataset(docs, context_length=4, eos_id=EOS, seed=7)
    b = PackedDataset(docs, context_length=4, eos_id=EOS, seed=7)
    c = PackedDataset(docs, context_length=4, eos_id=EOS, seed=8)
    assert sorted(a.order(0).tolist()) == list(range(len(a)))
    for (xa, ya, ma), (xb, yb, mb) in zip(_epoch(a, 3), _epoch(b, 3)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(ma, mb)
    assert not np.array_equal(a.order(0), c.order(0))
    assert not np.array_equal(a.order(0), a.order(1))
    stream = a.index_stream()
    assert [next(stream) for _ in range(2 * len(a))] == a.order(0).tolist() + a.order(1).tolist()


def test_too_little_data_is_a_user_error():
    with pytest.raises(UserError, match="fewer than one window"):
        PackedDataset([[5, 6]], context_length=8, eos_id=EOS)
    assert len(PackedDataset([[5, 6]], context_length=8, eos_id=EOS, pad_last=True)) == 1


def test_sft_mask_prompt_off_needs_packing():
    with pytest.raises(ValueError, match="sft.packed"):
        SFTConfig(mask_prompt=False)
    assert SFTConfig().packed is False


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_packed_sft_of_one_window_equals_padded_sft(tiny_tokenizer):
    """A pair that fills one window exactly trains as unpacked SFT does (same rows, same mask)."""
    from scratchlm.align.policy import ScratchPolicy
    from scratchlm.model.transformer import build_model
    from tests.align.conftest import tiny_model_config

    pair = ("Start with 3. Add 4.", " 3+4=7 </think> <answer> 7 </answer>")
    length = len(tiny_tokenizer.encode(pair[0])) + len(tiny_tokenizer.encode(pair[1]))  # + EOS - 1
    runs = []
    for packed in (False, True):
        torch.manual_seed(0)
        cfg = tiny_model_config(tiny_tokenizer.vocab_size)
        policy = ScratchPolicy(build_model(cfg), tiny_tokenizer, cfg)
        history = sft_train(policy, [pair], sft=SFTConfig(micro_batch_size=1, grad_accum_steps=1, max_steps=3,
                                                          packed=packed, pack_length=length),
                            optim=OptimConfig(lr=1e-2))
        runs.append((history, _params(policy.model)))
    (h0, p0), (h1, p1) = runs
    assert [r["loss"] for r in h0] == pytest.approx([r["loss"] for r in h1], rel=1e-5)
    assert h0[0]["response_tokens"] == h1[0]["response_tokens"]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(p0, p1))


def test_packed_sft_learns_and_counts_windows(tiny_policy):
    from scratchlm.align.prompts import get_template
    from scratchlm.align.task import ArithmeticTask

    template = get_template("r1_zero")
    pairs = [(template.format(e.question), template.response(e.reasoning, e.answer))
             for e in ArithmeticTask(difficulty=1).examples(6, seed=2)]
    sft = SFTConfig(micro_batch_size=2, grad_accum_steps=1, num_epochs=8.0, packed=True, pack_length=64)
    history = sft_train(tiny_policy, pairs, sft=sft, optim=OptimConfig(lr=1e-2, warmup_steps=2))
    stream = sum(len(tiny_policy.encode(p)) + len(tiny_policy.encode(r)) + 1 for p, r in pairs)
    windows = -(-(stream - 1) // 64)
    assert len(history) == -(-8 * windows // 2)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    lm = sft_train(tiny_policy, pairs, sft=SFTConfig(micro_batch_size=2, grad_accum_steps=1, max_steps=1, packed=True,
                                                     pack_length=64, mask_prompt=False), optim=OptimConfig(lr=0.0))
    assert lm[0]["response_tokens"] > history[0]["response_tokens"]  # the prompt tokens count too


class _LongContextPolicy:
    """What packing reads of an HFPolicy whose context length is max_position_embeddings."""

    context_length = 32768
    eos_id, pad_id = 1, 1

    def encode(self, text):
        return [2 + ord(c) % 100 for c in text]


def test_packed_sft_default_window_fits_the_pairs_not_a_huge_context():
    from scratchlm.align.sft import packed_sft_dataset

    policy = _LongContextPolicy()
    pairs = [("Q: 2+3?" * 3, " 5" * 20), ("Q: 1+1?", " 2"), ("x" * 50, "y" * 80)]  # longest: 50 + 80 + EOS = 131
    data = packed_sft_dataset(policy, pairs, sft=SFTConfig(packed=True))
    assert data.context_length == 192
    x, y, mask = data.batch([0])
    assert x.shape == (1, 192)
    # An explicit pack_length wins, and is still checked against the context length.
    assert packed_sft_dataset(policy, pairs, sft=SFTConfig(packed=True, pack_length=100)).context_length == 100
    with pytest.raises(UserError, match="exceeds the model's context length"):
        packed_sft_dataset(policy, pairs, sft=SFTConfig(packed=True, pack_length=40000))
    # A model whose context is shorter than the longest pair keeps its context length.
    policy.context_length = 96
    assert packed_sft_dataset(policy, pairs, sft=SFTConfig(packed=True)).context_length == 96
