"""Seeded random text for tokenizer tests (a stand-in for property-based testing)."""

from __future__ import annotations

import random
import unicodedata

# Pieces that exercise GPT-2's pattern: contractions, whitespace runs of every kind, digits,
# punctuation, letters from several scripts, combining marks, emoji, and the whitespace
# characters where `re` and `regex` disagree.
PIECES = [
    "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'x", " ", "  ", "   ", "\n", "\n\n", " \n",
    "\t", "\r\n", "\u3000", "\xa0", "\x1c", "\x1f", "\x85", "\u2028", "hello", "World", "ab",
    "123", "4", "²", "½", "٣", "!", "?!", "...", "--", "\"", "(", ")", "é", "naïve", "日本語", "한국어",
    "Ελληνικά", "العربية", "e\u0301", "😀", "👍🏽", "\u200d", "_", "$", "€", "<", "|", ">",
]


def random_text(rng: random.Random, length: int, specials: tuple[str, ...] = ()) -> str:
    """A string built from random pieces and random assigned code points."""
    out = []
    pieces = PIECES + list(specials)
    while sum(map(len, out)) < length:
        r = rng.random()
        if r < 0.7:
            out.append(rng.choice(pieces))
        elif r < 0.9:
            out.append(chr(rng.randrange(32, 0x250)))
        else:
            # Only code points assigned in Python's (older) Unicode database: the `regex` module
            # and tiktoken's Rust regex ship different Unicode versions, and a letter added in
            # between is \p{L} for one and punctuation for the other.
            c = chr(rng.randrange(0, 0x110000))
            if unicodedata.category(c) in ("Cn", "Cs"):
                c = "A"
            out.append(c)
    return "".join(out)
