from __future__ import annotations

import os
import random
import time
from collections import Counter

import pytest

from scratchlm.errors import UserError
from scratchlm.tokenizer import train as train_module
from scratchlm.tokenizer.pretokenize import count_pretokens_in_text, special_tokens_pattern
from scratchlm.tokenizer.train import merge_pretokens, train_bpe

from ._text import random_text


def reference_merges(counts: dict[str, int], num_merges: int) -> list[tuple[bytes, bytes]]:
    """Textbook BPE: recount every pair after every merge; ties to the greater byte pair."""
    words = {tuple(bytes([b]) for b in w.encode("utf-8")): n for w, n in counts.items()}
    merges = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p[0], p[1]))
        merges.append(best)
        merged: dict = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return merges


def _write(tmp_path, text: str, name="corpus.txt"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


@pytest.fixture
def tinystories(shared_data):
    path = shared_data / "tinystories" / "tinystories_valid_head.txt"
    if not path.is_file():
        pytest.skip("tinystories sample absent")
    return path


def test_merges_match_reference_on_real_text(tinystories):
    text = tinystories.read_text(encoding="utf-8")[:60_000]
    counts = count_pretokens_in_text(text)
    assert merge_pretokens(counts, 250) == reference_merges(counts, 250)


@pytest.mark.parametrize("seed", range(6))
def test_merges_match_reference_on_random_text(seed):
    rng = random.Random(seed)
    # Few distinct characters: long repeated runs ("aaaa"), adjacent occurrences and many ties.
    text = "".join(rng.choice(["a", "b", "ab", "aa", " a", " b", "ba", "\n", "é"]) for _ in range(3000))
    counts = count_pretokens_in_text(text)
    assert merge_pretokens(counts, 120) == reference_merges(counts, 120)


def test_ties_go_to_lexicographically_greater_pair():
    # Every pair occurs once: (b"c", b"d") is the greatest and comes first.
    assert merge_pretokens({"ab": 1, "cd": 1, "bc": 1}, 1) == [(b"c", b"d")]
    assert merge_pretokens({"zab": 3}, 1) == [(b"z", b"a")]
    # A prefix sorts below its extensions: after (a, b), (ab, x) beats (a, x).
    assert merge_pretokens({"ab": 10, "abx": 1, "ax": 1}, 2) == [(b"a", b"b"), (b"ab", b"x")]
    assert merge_pretokens({"ab": 10, "xab": 1, "xa": 1}, 2) == [(b"a", b"b"), (b"x", b"ab")]
    counts = {"ab": 2, "abc": 1, "abd": 1}
    assert merge_pretokens(counts, 2) == [(b"a", b"b"), (b"ab", b"d")]


def test_vocab_layout_and_special_tokens(tmp_path):
    text = "low lower lowest<|endoftext|>newer wider<|pad|>low the quick brown fox" * 20
    path = _write(tmp_path, text)
    vocab, merges = train_bpe(path, 270, ["<|endoftext|>", "<|pad|>"])
    assert len(vocab) == 270 and len(merges) == 270 - 256 - 2
    assert all(vocab[i] == bytes([i]) for i in range(256))
    assert [vocab[256 + k] for k in range(len(merges))] == [a + b for a, b in merges]
    assert vocab[268] == b"<|endoftext|>" and vocab[269] == b"<|pad|>"
    # Nothing merged across a special token or into one.
    assert all(b"<|" not in a + b and b"|>" not in a + b for a, b in merges)


def test_training_stops_when_no_pairs_are_left(tmp_path):
    vocab, merges = train_bpe(_write(tmp_path, "abab"), 1000, [])
    assert merges == [(b"a", b"b"), (b"ab", b"ab")]
    assert len(vocab) == 258


def test_parallel_equals_serial(tmp_path, monkeypatch, tinystories):
    text = tinystories.read_text(encoding="utf-8")[:200_000].replace("\n\n", "<|endoftext|>")
    path = _write(tmp_path, text)
    serial = train_bpe(path, 600, ["<|endoftext|>"], workers=1)
    monkeypatch.setattr(train_module, "SMALL_CORPUS_BYTES", 0)
    parallel = train_bpe(path, 600, ["<|endoftext|>"], workers=2)
    assert parallel == serial


def test_small_corpus_takes_fast_path(tmp_path, monkeypatch, tinystories):
    path = _write(tmp_path, tinystories.read_text(encoding="utf-8")[:100_000])

    def no_pool(*args, **kwargs):
        raise AssertionError("a worker pool was started for a small corpus")

    monkeypatch.setattr(train_module, "worker_pool", no_pool)
    start = time.perf_counter()
    vocab, merges = train_bpe(path, 1000, ["<|endoftext|>"])
    assert len(vocab) == 1000
    # Generous: well under a second on an idle core; this only catches a pathological slowdown.
    assert time.perf_counter() - start < 10


def test_timings_are_reported(tmp_path):
    timings: dict = {}
    train_bpe(_write(tmp_path, "hello world " * 50), 260, [], timings=timings)
    assert set(timings) == {"pretokenize_s", "merge_s", "workers"} and timings["workers"] == 1


def test_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        train_bpe(tmp_path / "missing.txt", 300, [])
    with pytest.raises(UserError, match="directory"):
        train_bpe(tmp_path, 300, [])
    with pytest.raises(UserError, match="at least 256"):
        train_bpe(_write(tmp_path, "hello"), 256, ["<|endoftext|>"])
    with pytest.raises(UserError, match="empty"):
        train_bpe(_write(tmp_path, "", "empty.txt"), 300, [])
    with pytest.raises(UserError, match="empty"):
        train_bpe(_write(tmp_path, "<|endoftext|><|endoftext|>", "only.txt"), 300, ["<|endoftext|>"])
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok text\xff\xfe more")
    with pytest.raises(UserError, match="byte offset 7"):
        train_bpe(bad, 300, [])
    if os.geteuid() != 0:
        locked = _write(tmp_path, "secret", "locked.txt")
        locked.chmod(0)
        with pytest.raises(UserError, match="permission"):
            train_bpe(locked, 300, [])


def test_a_special_token_that_is_not_utf8_is_a_user_error(tmp_path):
    # Bytes on the command line that are not UTF-8 reach Python as lone surrogates.
    with pytest.raises(UserError, match="not valid UTF-8 text"):
        train_bpe(_write(tmp_path, "hello world"), 300, [os.fsdecode(b"\xff")])


def test_special_tokens_split_before_pretokenization():
    counts = count_pretokens_in_text("a<|endoftext|>b", special_tokens_pattern(["<|endoftext|>"]))
    assert counts == Counter({"a": 1, "b": 1})


def test_random_corpus_round_trips_through_training(tmp_path):
    text = random_text(random.Random(1), 20_000, ("<|endoftext|>",))
    vocab, merges = train_bpe(_write(tmp_path, text), 400, ["<|endoftext|>"])
    assert len(vocab) == len(set(vocab.values())) == 256 + len(merges) + 1
