from __future__ import annotations

import random

import numpy as np
import pytest

from scratchlm.tokenizer.bulk_merge import BulkMerger, PairTable
from scratchlm.tokenizer.pretokenize import pretokenize
from scratchlm.tokenizer.tokenizer import Tokenizer

from ._text import random_text
from .conftest import EOT


def _words(rng: random.Random, n: int) -> list[bytes]:
    """Distinct pretokens of random text, plus runs that merge with themselves (a a a ...)."""
    words = {p.encode("utf-8") for p in pretokenize(random_text(rng, n))}
    words |= {c * k for c in (b"a", b" ", b"-", b"e", b"\n") for k in range(2, 40)}
    words |= {b"ab" * k for k in range(1, 20)} | {b" the" * 3, b"aaab" * 5}
    return sorted(words)


def _check_against_loop(tok: Tokenizer, words: list[bytes]) -> None:
    merger = tok._bulk_merger()
    assert merger is not None
    assert merger.merge(words) == [tok._merge_loop(w) for w in words]


def test_bulk_merge_equals_the_word_loop(trained):
    _check_against_loop(trained, _words(random.Random(0), 20_000))


def test_bulk_merge_equals_the_word_loop_with_gpt2_merges(gpt2_tokenizer):
    _check_against_loop(gpt2_tokenizer, _words(random.Random(1), 20_000))


def test_merge_text_equals_merge_of_the_utf8_bytes(trained):
    merger = trained._bulk_merger()
    words = [w.decode("utf-8", "replace") for w in _words(random.Random(3), 5000)]
    assert merger.merge_text(words) == merger.merge([w.encode("utf-8") for w in words])
    ascii_words = [w for w in words if w.isascii()]
    assert merger.merge_text(ascii_words) == merger.merge([w.encode() for w in ascii_words])
    with_nul = words + ["a\x00b", "\x00\x00", "é\x00"]  # NUL in a word: lengths found another way
    assert merger.merge_text(with_nul) == merger.merge([w.encode("utf-8") for w in with_nul])
    assert merger.merge_text([]) == []


def test_bulk_merge_single_words_and_empty_input(trained):
    merger = trained._bulk_merger()
    assert merger.merge([]) == []
    for word in (b"ab", b"hello", b" world", "日本".encode()):
        assert merger.merge([word]) == [trained._merge_loop(word)]


def test_merge_lists_that_use_a_token_before_making_it_are_not_bulk_merged(monkeypatch):
    from scratchlm.tokenizer import tokenizer as module

    # "ab" is used by merge 0 but made by merge 1, so merging every occurrence of the best
    # pair in one round could differ from the leftmost-first loop; the tokenizer falls back.
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"abc", 257: b"ab"}
    merges = [(b"ab", b"c"), (b"a", b"b")]
    pairs, made = [(257, 99), (97, 98)], [256, 257]
    assert not BulkMerger.exact_for(pairs, made)
    assert BulkMerger.exact_for(pairs[::-1], made[::-1])
    monkeypatch.setattr(module, "BULK_MERGE_MIN", 0)
    tok = Tokenizer(vocab, merges)
    assert tok._bulk_merger() is None
    assert tok.encode("abcabc ab abc") == [256, 256, 32, 257, 32, 256]


def test_ids_beyond_the_surrogate_range_merge_in_bulk(trained, monkeypatch):
    from scratchlm.tokenizer import tokenizer as module

    shift = 0xE000 - 1000  # ids 256.. move into the surrogates (0xD800..0xDFFF) and beyond
    vocab = {i if i < 256 else i + shift: t for i, t in trained.vocab.items()}
    monkeypatch.setattr(module, "BULK_MERGE_MIN", 0)
    moved = Tokenizer(vocab, trained.merges, [EOT])
    text = random_text(random.Random(2), 5000, (EOT,))
    ids = moved.encode(text)
    assert ids == [i if i < 256 else i + shift for i in trained.encode(text)]
    assert any(0xD800 <= i <= 0xDFFF for i in ids) and max(ids) > 0xDFFF


@pytest.mark.parametrize("n", [0, 1, 7, 5000])
def test_pair_table_finds_exactly_its_keys(n):
    rng = np.random.default_rng(n)
    keys = np.unique(rng.integers(0, 10 * n + 10, size=n))
    table = PairTable(keys)
    assert sorted(table.slots_of_keys.tolist()) == sorted(set(table.slots_of_keys.tolist()))
    queries = np.concatenate([keys, rng.integers(0, 20 * n + 20, size=3 * n + 5)])
    slots = table.lookup(queries)
    position = {int(k): int(s) for k, s in zip(keys, table.slots_of_keys)}
    assert slots.tolist() == [position.get(int(q), table.size) for q in queries]


def test_batched_encoding_equals_the_per_word_path(trained, tinystories_text, monkeypatch):
    """A cold encode (new units batched: one regex pass, one numpy merge loop) gives the ids of
    the per-word merge loop, on real text, on random byte strings, and with a merge listed twice."""
    from scratchlm.tokenizer import tokenizer as module

    rng = random.Random(5)
    real = tinystories_text[:40_000]
    words = sorted({p.encode("utf-8") for p in pretokenize(real)})
    random_bytes = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 30))) for _ in range(3000)]
    merges = list(trained.merges)
    doubled = Tokenizer(trained.vocab, merges[:40] + merges[10:20] + merges[40:], [EOT])
    for tok in (trained, doubled):
        tok = Tokenizer(tok.vocab, tok.merges, [EOT])
        merger = tok._bulk_merger()
        assert merger is not None
        for batch in (words, random_bytes):
            assert merger.merge(batch) == [tok._merge_loop(w) for w in batch]
        batched = Tokenizer(tok.vocab, tok.merges, [EOT]).encode(real)
        monkeypatch.setattr(module, "BULK_MERGE_MIN", 1 << 30)  # every new pretoken through _merge_loop
        assert Tokenizer(tok.vocab, tok.merges, [EOT]).encode(real) == batched
        monkeypatch.undo()
        assert batched == trained.encode(real)
