from __future__ import annotations

import io
import random
import subprocess
import sys
from itertools import islice

import pytest

from scratchlm.errors import UserError
from scratchlm.tokenizer.tokenizer import Tokenizer, UnknownTokenError

from ._text import random_text
from .conftest import EOT, tiktoken_from

TRICKY = [
    "", " ", "  ", "\n", "hello world", "Hello, World!  It's a test.\n\n\tIndented\r\n",
    "I'm you're we've they'll he'd she's IT'S", "   leading and trailing   ", "a\n\n\n b",
    "1234567890 3.14159 ½ ² ٣", "naïve café résumé 日本語のテキスト 한국어 😀👍🏽", "x\u3000y\xa0z\x1cw\x85v",
    "<|endoftext|>", "a<|endoftext|>b", "<|endoftext|><|endoftext|>", " <|endoftext|> ",
    "<|endoftext|", "<|endoftext|>\n\nOnce upon a time", "e\u0301 \u200d", "$$$ --- ...!!!",
]


@pytest.mark.parametrize("text", TRICKY)
def test_gpt2_matches_tiktoken(gpt2_tokenizer, tiktoken_gpt2, text):
    assert gpt2_tokenizer.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all")


def test_gpt2_matches_tiktoken_on_real_and_random_text(gpt2_tokenizer, tiktoken_gpt2, tinystories_text):
    text = tinystories_text[:200_000].replace("\n\n", EOT)
    assert gpt2_tokenizer.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all")
    rng = random.Random(0)
    for _ in range(50):
        text = random_text(rng, rng.randrange(1, 400), (EOT,))
        assert gpt2_tokenizer.encode(text) == tiktoken_gpt2.encode(text, allowed_special="all")


def test_units_holding_nul_match_tiktoken(gpt2_tokenizer, tiktoken_gpt2, trained):
    # NUL separates units in the cache fill; units that contain it take another path.
    text = " ".join(["plain", "a\x00b", "\x00", " \x00\x00!", "x\x00", "naïve\x00", "end"] * 50)
    assert gpt2_tokenizer.encode(text) == tiktoken_gpt2.encode(text)
    fresh = Tokenizer(trained.vocab, trained.merges, [EOT])
    assert fresh.encode(text) == tiktoken_from(trained).encode(text)


def test_gpt2_ids(gpt2_tokenizer):
    assert gpt2_tokenizer.encode("Hello world<|endoftext|>") == [15496, 995, 50256]
    assert gpt2_tokenizer.vocab_size == 50257 and gpt2_tokenizer.eot_id == 50256


def test_trained_matches_tiktoken_from_our_merges(trained, tinystories_text):
    enc = tiktoken_from(trained)
    text = tinystories_text[300_000:600_000].replace("\n\n", EOT)
    assert trained.encode(text) == enc.encode(text, allowed_special="all")
    rng = random.Random(1)
    for _ in range(30):
        text = random_text(rng, 500, (EOT,))
        assert trained.encode(text) == enc.encode(text, allowed_special="all")


@pytest.mark.parametrize("seed", range(5))
def test_round_trip_random_unicode(trained, gpt2_tokenizer, seed):
    rng = random.Random(seed)
    for _ in range(40):
        text = random_text(rng, rng.randrange(0, 300), (EOT,))
        assert trained.decode(trained.encode(text)) == text
        assert gpt2_tokenizer.decode(gpt2_tokenizer.encode(text)) == text


def test_overlapping_special_tokens_longest_wins(trained):
    tok = Tokenizer(trained.vocab, trained.merges, ["<|a|>", "<|a|><|b|>", EOT])
    a, ab = tok.special_token_ids["<|a|>"], tok.special_token_ids["<|a|><|b|>"]
    ids = tok.encode("x<|a|><|b|>y<|a|>")
    assert ab in ids and ids.count(a) == 1
    assert tok.decode(ids) == "x<|a|><|b|>y<|a|>"
    assert len(set(tok.special_token_ids.values())) == 3


def test_without_special_tokens_they_are_plain_text(trained):
    plain = Tokenizer(trained.vocab, trained.merges)
    ids = plain.encode("a<|endoftext|>b")
    assert trained.eot_id not in ids and plain.decode(ids) == "a<|endoftext|>b"


def test_decode_replaces_invalid_utf8_and_rejects_unknown_ids(trained):
    # The two bytes of "é" decoded one at a time are not valid UTF-8 alone.
    assert trained.decode([0xC3]) == "\ufffd"
    assert trained.decode([0xC3, 0xA9]) == "é"
    for bad in ([trained.vocab_size], [-1], [10**9]):
        with pytest.raises(UnknownTokenError):
            trained.decode(bad)
    assert issubclass(UnknownTokenError, ValueError) and issubclass(UnknownTokenError, UserError)


def test_decode_can_show_unknown_ids_as_given_text(trained):
    # For ids sampled from the padding rows of a model whose vocab_size is above the tokenizer's.
    ids = [*trained.encode("ab"), trained.vocab_size, *trained.encode("c"), 10**9]
    assert trained.decode(ids, unknown="\ufffd") == "ab\ufffdc\ufffd"
    assert trained.decode(trained.encode("abc"), unknown="?") == "abc"


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_encode_iterable_equals_encode(trained, tinystories_text, chunk):
    text = tinystories_text[:150_000].replace("\n\n", EOT) + "  trailing  "
    pieces = (text[i:i + chunk] for i in range(0, len(text), chunk))
    assert list(trained.encode_iterable(pieces)) == trained.encode(text)


def test_encode_iterable_on_file_object_and_random_text(trained):
    rng = random.Random(3)
    text = "".join(random_text(rng, 2000, (EOT,)) + rng.choice(["\n", " ", EOT]) for _ in range(60))
    assert list(trained.encode_iterable(io.StringIO(text))) == trained.encode(text)
    pieces = []
    i = 0
    while i < len(text):
        step = rng.randrange(1, 9000)
        pieces.append(text[i:i + step])
        i += step
    assert list(trained.encode_iterable(pieces)) == trained.encode(text)


def test_encode_iterable_is_lazy(trained):
    def endless():
        while True:
            yield "Once upon a time there was a cat. "

    first = list(islice(trained.encode_iterable(endless()), 10_000))
    assert first[:8] == trained.encode("Once upon a time there was a cat. ")[:8]


def test_hash_is_stable_and_sensitive(trained):
    same = Tokenizer(dict(trained.vocab), list(trained.merges), [EOT])
    assert same.hash == trained.hash and len(trained.hash) == 64
    fewer = Tokenizer(trained.vocab, trained.merges[:-1], [EOT])
    assert fewer.hash != trained.hash
    assert Tokenizer(trained.vocab, trained.merges, [EOT, "<|pad|>"]).hash != trained.hash


def test_bad_vocabularies_are_user_errors():
    with pytest.raises(UserError, match="single bytes"):
        Tokenizer({0: b"a"}, [])
    vocab = {i: bytes([i]) for i in range(256)}
    with pytest.raises(UserError, match="merge 0"):
        Tokenizer(vocab, [(b"a", b"b")])


def test_importing_the_tokenizer_does_not_import_torch():
    code = ("import sys; import scratchlm.tokenizer.tokenizer, scratchlm.tokenizer.train, "
            "scratchlm.tokenizer.io, scratchlm.cli.tokenizer, scratchlm.tokenizer.stats; import scratchlm; scratchlm.Tokenizer; "
            "assert 'torch' not in sys.modules, 'torch imported'; assert 'numpy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_long_text_is_encoded_in_blocks(trained, tinystories_text, monkeypatch):
    from scratchlm.tokenizer import tokenizer as module

    text = tinystories_text[:60_000] + "   spaced  out \n\n end"
    expected = trained.encode(text)
    monkeypatch.setattr(module, "ENCODE_BLOCK_CHARS", 1000)
    monkeypatch.setattr(module, "UNIT_BLOCK_CHARS", 300)
    fresh = Tokenizer(trained.vocab, trained.merges, [EOT])
    assert fresh.encode(text) == expected
    monkeypatch.setattr(module, "MAX_CACHE_UNITS", 10)
    monkeypatch.setattr(module, "MAX_CACHE_PRETOKENS", 10)
    assert Tokenizer(trained.vocab, trained.merges, [EOT]).encode(text) == expected


def test_ids_beyond_the_surrogate_range(trained):
    from scratchlm.tokenizer.tokenizer import _ids_of

    ids = [0, 65, 0xD800, 0xDFFF, 70_000, 0x10FFFF]
    assert _ids_of("".join(map(chr, ids))) == ids


def test_replace_placeholders():
    from scratchlm.tokenizer.tokenizer import _replace_placeholders

    first = 1000
    tokens = ["ab", "c", "\ud800\U0010ffff", "defg"]
    text = "".join(chr(first + k) if isinstance(k, int) else k for k in [2, "x", 0, 0, "yz", 3, 1, "w", 2])
    expected = [ord(c) for c in text.translate({first + k: t for k, t in enumerate(tokens)})]
    assert _replace_placeholders(text, first, tokens) == expected
    assert _replace_placeholders("plain", first, tokens) == [ord(c) for c in "plain"]
    assert _replace_placeholders("", first, []) == []


def test_an_interrupted_encode_leaves_no_placeholder_in_the_cache(trained, monkeypatch):
    tok = Tokenizer(trained.vocab, trained.merges, [EOT])
    text = "some fresh words, and more of them<|endoftext|> here"

    def interrupted(units):
        raise KeyboardInterrupt

    monkeypatch.setattr(tok, "_tokens_of", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tok.encode(text)
    monkeypatch.undo()
    assert not tok._cache and not tok._cache.new()
    assert tok.encode(text) == trained.encode(text)


def test_a_used_tokenizer_can_be_pickled_and_copied(trained, tinystories_text):
    import copy
    import pickle

    tok = Tokenizer(trained.vocab, trained.merges, [EOT])
    tok.encode(tinystories_text[:5000])
    for clone in (pickle.loads(pickle.dumps(tok)), copy.deepcopy(tok)):
        assert dict(clone._cache) == dict(tok._cache)
        assert clone.encode(tinystories_text[:20_000]) == trained.encode(tinystories_text[:20_000])


def test_encode_iterable_keeps_the_caches_within_their_bounds(trained, tinystories_text, monkeypatch):
    from scratchlm.tokenizer import tokenizer as module

    text = tinystories_text[:200_000] + random_text(random.Random(3), 50_000, (EOT,))
    expected = trained.encode(text)
    monkeypatch.setattr(module, "STREAM_BLOCK_CHARS", 2000)
    monkeypatch.setattr(module, "MAX_CACHE_UNITS", 1500)
    monkeypatch.setattr(module, "MAX_CACHE_PRETOKENS", 1000)
    tok = Tokenizer(trained.vocab, trained.merges, [EOT])
    largest = 0
    ids = []
    for i in tok.encode_iterable(io.StringIO(text)):
        ids.append(i)
        largest = max(largest, len(tok._cache))
    assert ids == expected
    assert 1000 < largest <= 1500 and len(tok._pretokens) <= 1000 + 2000


# --- long pretokens ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    """A 1,000-token vocabulary that learned merges of long space and newline runs, and Hugging
    Face ``tokenizers`` loaded from the same vocabulary and merges."""
    tokenizers = pytest.importorskip("tokenizers")
    from scratchlm.tokenizer.train import train_bpe

    rng = random.Random(0)
    words = [_letters(rng.randrange(1, 8), seed) for seed in range(3000)]
    text = "".join(rng.choice(words) + rng.choice([" ", "\n", "\t"]) * rng.choice([1, 1, 1, 2, 3, 4, 8, 16, 32, 64])
                   for _ in range(30_000))
    path = tmp_path_factory.mktemp("long") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(path, 1000, [EOT], workers=1)
    tok = Tokenizer(vocab, merges, [EOT])
    learned = set(tok.vocab.values())
    assert {b" " * 16, b"\n" * 16, b"\t" * 16} <= learned and len(tok.merges) == 1000 - 257
    tok.save(path.parent / "tok")
    return tok, tokenizers.Tokenizer.from_file(str(path.parent / "tok" / "tokenizer.json"))


def _letters(n: int, seed: int, alphabet: str = "abcdefghijklmnopqrstuvwxyz") -> str:
    rng = random.Random(seed)
    return "".join(rng.choices(alphabet, k=n))


LONG_INPUTS = {
    "100K spaces": lambda: " " * 100_000,
    "100K newlines": lambda: "\n" * 100_000,
    "100K tabs between words": lambda: "cat" + "\t" * 100_000 + "mat",
    "1 MB of random letters": lambda: _letters(1_000_000, 1),
    "1 MB of one letter": lambda: "z" * 1_000_000,
    "1 MB of two letters": lambda: _letters(1_000_000, 2, "at"),
}


@pytest.mark.parametrize("name", LONG_INPUTS)
def test_long_pretokens_match_hf_tokenizers_in_n_log_n_time(long_runs, name):
    import time

    tok, hf = long_runs
    text = LONG_INPUTS[name]()
    fresh = Tokenizer(tok.vocab, tok.merges, tok.special_tokens)
    fresh.encode("warm up numpy")
    start = time.perf_counter()
    ids = fresh.encode(text)
    seconds = time.perf_counter() - start
    assert ids == hf.encode(text).ids
    # Generous: about 0.1-0.7 s on an idle core, and over a minute when merging was quadratic.
    assert seconds < 5, f"{name} took {seconds:.1f} s"


@pytest.mark.parametrize("bulk", [True, False], ids=["numpy rounds then heap", "heap only"])
def test_long_pretoken_merge_equals_the_per_word_loop(long_runs, gpt2_tokenizer, monkeypatch, bulk):
    from scratchlm.tokenizer import tokenizer as module

    rng = random.Random(3)
    pieces = ["a", "t", "the", "cat", " ", "  ", "\n", "é", "日本", "zz", "q"]
    words = ["".join(rng.choice(pieces) for _ in range(rng.randrange(20, 200))) for _ in range(150)]
    for tok in (long_runs[0], gpt2_tokenizer):
        tok = Tokenizer(tok.vocab, tok.merges, tok.special_tokens)
        if not bulk:
            tok._bulk = False
        long = [tok._merge_long(list(w.encode("utf-8").decode("latin-1").translate(tok._byte_chars)))
                for w in words]
        monkeypatch.setattr(module, "LONG_PRETOKEN", 1 << 30)
        assert long == [tok._merge_loop(w.encode("utf-8")) for w in words]
        monkeypatch.undo()


def test_a_merge_listed_twice_changes_nothing_for_long_pretokens(long_runs):
    tok, hf = long_runs
    merges = list(tok.merges)
    doubled = Tokenizer(tok.vocab, merges[:5] + merges[2:3] + merges[5:], tok.special_tokens)
    for text in (" " * 5000, _letters(5000, 4), "ab" * 3000):
        assert doubled.encode(text) == hf.encode(text).ids
        assert doubled._merge_long(list(text)) == tok._merge_long(list(text))
