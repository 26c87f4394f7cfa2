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
