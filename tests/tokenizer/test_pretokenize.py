from __future__ import annotations

import random
from collections import Counter

import pytest
import regex

from scratchlm.errors import UserError
from scratchlm.tokenizer.pretokenize import (
    GPT2_RE, UNIT_RE, WHITESPACE, WHITESPACE_CHARS, count_pretokens_in_range, count_pretokens_in_text,
    find_chunk_boundaries, iter_text_blocks, last_safe_cut, pretokenize, special_tokens_pattern,
    split_special,
)

from ._text import random_text


def test_pretokenize_gpt2_examples():
    assert pretokenize("Hello, world!  It's 2024.") == [
        "Hello", ",", " world", "!", " ", " It", "'s", " 2024", "."]
    assert pretokenize("a   b\n\n c") == ["a", "  ", " b", "\n\n", " c"]
    assert pretokenize("  x  ") == [" ", " x", "  "]


def test_whitespace_class_is_regex_whitespace():
    everything = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    ours = regex.findall(f"[{WHITESPACE}]", everything)
    assert ours == regex.findall(r"\s", everything)
    assert len(ours) == 25
    assert sorted(WHITESPACE_CHARS) == ours


def test_units_take_one_leading_whitespace_character():
    assert UNIT_RE.findall("one\ntwo\t three\n\nfour   five\u3000six ") == [
        "one", "\ntwo", "\t", " three", "\n", "\nfour", "  ", " five", "\u3000six", " "]


@pytest.mark.parametrize("seed", range(20))
def test_units_never_split_a_pretoken(seed):
    text = random_text(random.Random(seed), 3000)
    units = UNIT_RE.findall(text)
    assert "".join(units) == text
    assert [p for u in units for p in GPT2_RE.findall(u)] == GPT2_RE.findall(text)


def test_special_tokens_longest_match_wins():
    pattern = special_tokens_pattern(["<|a|>", "<|a|><|b|>", "|>"], capture=True)
    assert split_special("x<|a|><|b|>y<|a|>z|>", pattern) == [
        "x", "<|a|><|b|>", "y", "<|a|>", "z", "|>", ""]
    assert special_tokens_pattern([]) is None
    assert split_special("abc", None) == ["abc"]


def test_counts_never_cross_special_tokens():
    pattern = special_tokens_pattern(["<|endoftext|>"])
    counts = count_pretokens_in_text("the cat<|endoftext|> the cat<|endoftext|>", pattern)
    assert counts == Counter({"the": 1, " cat": 2, " the": 1})
    assert all("<|" not in p for p in counts)


@pytest.mark.parametrize("seed", range(10))
def test_last_safe_cut_keeps_pretokens(seed):
    rng = random.Random(seed)
    specials = ("<|endoftext|>", "<|a|>")
    text = random_text(rng, 4000, specials) + "ab\ncd" + random_text(rng, 200)
    data = text.encode("utf-8")
    pattern = special_tokens_pattern(specials)
    cut = last_safe_cut(data, [s.encode() for s in specials])
    assert 0 < cut < len(data)
    left, right = data[:cut].decode(), data[cut:].decode()
    assert count_pretokens_in_text(left, pattern) + count_pretokens_in_text(right, pattern) == \
        count_pretokens_in_text(text, pattern)


def test_last_safe_cut_rejects_straddled_and_missing():
    assert last_safe_cut(b"no newline at all", []) == -1
    # "a\nb" lies inside the special token "x\nb": not a cut.
    assert last_safe_cut(b"zx\nbz", [b"x\nb"]) == 1
    assert last_safe_cut(b"  \n  ", []) == -1


def _write(tmp_path, text: str, name="corpus.txt"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


def test_chunks_and_blocks_cover_file_exactly(tmp_path):
    rng = random.Random(0)
    docs = [random_text(rng, rng.randrange(50, 3000)) for _ in range(60)]
    text = "<|endoftext|>".join(docs)
    path = _write(tmp_path, text)
    bounds = find_chunk_boundaries(path, 8, ["<|endoftext|>"])
    data = path.read_bytes()
    assert bounds[0] == 0 and bounds[-1] == len(data) and bounds == sorted(set(bounds))
    assert len(bounds) > 3
    for b in bounds[1:-1]:
        assert data[b:].startswith(b"<|endoftext|>") or (data[b - 1:b] == b"\n")
    pieces = [c for a, b in zip(bounds, bounds[1:]) for c in iter_text_blocks(path, a, b, ["<|endoftext|>"], 1000)]
    assert "".join(pieces) == text
    total = Counter()
    for a, b in zip(bounds, bounds[1:]):
        total += count_pretokens_in_range(path, a, b, ["<|endoftext|>"])
    assert total == count_pretokens_in_text(text, special_tokens_pattern(["<|endoftext|>"]))


def test_non_utf8_names_byte_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"hello world\n" * 10 + b"caf\xe9\n")
    with pytest.raises(UserError, match=r"byte offset 123 \(byte 0xe9\)"):
        count_pretokens_in_range(path, 0, path.stat().st_size, [])


@pytest.mark.parametrize("seed", range(5))
def test_ascii_pattern_equals_gpt2_on_ascii(seed):
    from scratchlm.tokenizer.pretokenize import GPT2_ASCII_RE

    rng = random.Random(seed)
    pieces = ["'s", "'ll", "'", " ", "  ", "\n", "\t", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "ab", "Z",
              "42", "!?", "_", "-", "\x00", "\x7f"]
    text = "".join(rng.choice(pieces) if rng.random() < 0.7 else chr(rng.randrange(128)) for _ in range(5000))
    assert GPT2_ASCII_RE.findall(text) == GPT2_RE.findall(text)


@pytest.mark.parametrize("seed", range(6))
def test_joined_units_pretokenize_like_each_unit(seed):
    from scratchlm.tokenizer.pretokenize import UNITS_SEP, pretokenize_joined

    rng = random.Random(seed)
    # Mostly ASCII with a few non-ASCII units (seeds 0-2), or dense non-ASCII (3-5), so both
    # the stdlib stretches and the grouped `regex` stretches are exercised.
    text = random_text(rng, 20_000).replace(UNITS_SEP, "")
    units = list(dict.fromkeys(UNIT_RE.findall(text)))
    if seed < 3:
        units = [u for u in units if u.isascii()] + [u for u in units if not u.isascii()][:40]
        rng.shuffle(units)
    expected = []
    for unit in units:
        expected += GPT2_RE.findall(unit) + [UNITS_SEP]
    assert pretokenize_joined(UNITS_SEP.join(units)) == expected[:-1]
    ascii_units = [u for u in units if u.isascii()]
    expected = [p for u in ascii_units for p in GPT2_RE.findall(u) + [UNITS_SEP]][:-1]
    assert pretokenize_joined(UNITS_SEP.join(ascii_units)) == expected
    assert pretokenize_joined("") == []
