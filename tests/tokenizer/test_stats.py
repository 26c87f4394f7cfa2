from __future__ import annotations

import pytest

from scratchlm.errors import UserError
from scratchlm.tokenizer.stats import read_sample


def test_read_sample_drops_only_a_character_that_max_bytes_cuts(tmp_path):
    sample = tmp_path / "sample.txt"
    sample.write_bytes("café".encode("utf-8"))
    assert read_sample(sample, 4) == "caf"  # the cut fell inside "é"
    assert read_sample(sample, 100) == "café"
    # A file that itself ends inside a character is not UTF-8 (was read without a word, less that byte).
    sample.write_bytes(b"caf\xc3")
    with pytest.raises(UserError, match="not valid UTF-8 at byte offset 3"):
        read_sample(sample, 100)


def test_the_report_names_the_first_special_tokens_and_counts_the_rest():
    # Every special token was listed: a tokenizer with 70,000 of them printed a line of a megabyte.
    from scratchlm.tokenizer.stats import format_stats, tokenizer_stats
    from scratchlm.tokenizer.tokenizer import Tokenizer

    specials = [f"<|s{i}|>" for i in range(1000)]
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], specials)
    first = format_stats(tokenizer_stats(tokenizer, "hello<|s5|>")).splitlines()[0]
    assert first.endswith("special: <|s0|>, <|s1|>, <|s2|>, <|s3|>, <|s4|>, <|s5|>, <|s6|>, <|s7|>, <|s8|>, "
                          "<|s9|>, ... (1,000 in all; --json lists them))")
    few = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    assert format_stats(tokenizer_stats(few, "hello")).splitlines()[0].endswith("special: <|endoftext|>)")
