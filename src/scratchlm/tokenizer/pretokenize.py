"""Pretokenization: special-token splitting, GPT-2's regex, and safe places to cut a corpus.

Text is first split on special tokens (the longest wins where they overlap), then each piece is
split by GPT-2's pattern ``GPT2_PAT``; BPE merges never cross a pretoken boundary.

Speed comes from a coarser split that the pattern respects. ``UNIT_RE`` (stdlib ``re``, no
``\\p{..}`` classes, so several times faster than the ``regex`` module on the full pattern) cuts
text into *units*: a run of non-whitespace with at most one leading whitespace character, or
a run of whitespace handled exactly as GPT-2's ``\\s+(?!\\S)|\\s+``. No GPT-2 pretoken crosses a
unit boundary (no alternative of the pattern mixes whitespace with anything but one leading
space; a space before a non-space character always starts a pretoken, and any other whitespace
character there is a pretoken of its own), so pretokenizing each distinct unit once and reusing
the result gives exactly GPT-2's split. Real text has far fewer
distinct units than positions, which makes both counting (training) and caching (encoding) cheap.

Corpora are cut into byte ranges at the start of a special token or, failing one, just after a
newline between two printable ASCII characters: both are places where GPT-2's split restarts
(the second may cut a unit, a newline and the word after it, into two that give the same
pretokens), so ranges are processed independently and streamed in fixed-size blocks.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import regex

from scratchlm.errors import UserError

GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_RE = regex.compile(GPT2_PAT)

# The characters the ``regex`` module's \s matches (the Unicode White_Space property); stdlib
# ``re`` would also count U+001C..U+001F, so the class is spelled out. Tested against ``regex``.
WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
WHITESPACE_CHARS = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {
    chr(c) for c in range(0x2000, 0x200B)}
# The possessive ``++`` (Python 3.11) changes no match, since nothing after a maximal run of
# non-whitespace could match; it spares the engine its backtracking bookkeeping (findall
# 10-25% faster). Taking any one whitespace character before a word, not just a space, puts a
# line's first word in one unit with the newline before it (8% fewer units on prose).
UNIT_RE = re.compile(rf"[{WHITESPACE}]?[^{WHITESPACE}]++|[{WHITESPACE}]+(?![^{WHITESPACE}])|[{WHITESPACE}]+")

# GPT-2's pattern restricted to ASCII text, for stdlib ``re`` (faster than ``regex``): on an
# ASCII string \p{L} is [A-Za-z], \p{N} is [0-9] and \s is [\t\n\v\f\r ]. Tested
# against GPT2_RE on random ASCII.
_S = "\t\n\x0b\x0c\r "
GPT2_ASCII_RE = re.compile(
    rf"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]++| ?[0-9]++| ?[^{_S}A-Za-z0-9]++|[{_S}]+(?![^{_S}])|[{_S}]+"
)

# GPT-2's pattern for many *units* joined with NUL (``UNITS_SEP``), none of which contains NUL:
# the separator is a match of its own and no other alternative takes it, so the matches between
# two separators are the pretokens of the unit between them. A whitespace unit is one pretoken
# (``\s+`` stands for GPT-2's two whitespace alternatives, which split a run only where the unit
# split already did); the only other whitespace, a non-whitespace unit's leading character, goes
# with the character after it if it is a space and is a pretoken alone otherwise, as in GPT-2. ``pretokenize_joined`` uses the stdlib ASCII form where
# it can. Tested against GPT2_RE unit by unit.
UNITS_SEP = "\x00"
JOINED_ASCII_RE = re.compile(
    rf"\x00|'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]++| ?[0-9]++| ?[^{_S}A-Za-z0-9\x00]++|[{_S}]++"
)
JOINED_RE = regex.compile(r"\x00|'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}\x00]++|\s++")
_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")
# Non-ASCII units closer together than this go through JOINED_RE in one call.
_NEAR = 256

BLOCK_BYTES = 1 << 22  # a worker reads its byte range in blocks of this size


def pretokenize(text: str) -> list[str]:
    """GPT-2 pretokens of text that holds no special token.

    >>> pretokenize("Hello, world!  It's 2024.")
    ['Hello', ',', ' world', '!', ' ', ' It', "'s", ' 2024', '.']
    """
    return GPT2_RE.findall(text)


def pretokenize_joined(joined: str) -> list[str]:
    r"""GPT-2 pretokens of ``UNITS_SEP.join(units)`` (units free of NUL), with a NUL between units.

    ASCII stretches go through the stdlib pattern; only the units holding a non-ASCII character
    (with any short ASCII stretch between two of them) go through the ``regex`` module.

    >>> pretokenize_joined("\x00".join(["Hello,", " world", "\n\n", " naïve"]))
    ['Hello', ',', '\x00', ' world', '\x00', '\n\n', '\x00', ' naïve']
    """
    if joined.isascii():
        return JOINED_ASCII_RE.findall(joined)
    out: list[str] = []
    done = 0  # joined[:done] is pretokenized
    start = end = 0  # the pending non-ASCII stretch, from a unit's start to a separator (or the end)
    for match in _NON_ASCII_RUN.finditer(joined):
        if match.start() < end:
            continue  # in the unit already taken
        unit_start = joined.rfind(UNITS_SEP, 0, match.start()) + 1
        if unit_start - end >= _NEAR:
            if end > start:
                out += JOINED_ASCII_RE.findall(joined, done, start)
                out += JOINED_RE.findall(joined, start, end)
                done = end
            start = unit_start
        end = joined.find(UNITS_SEP, match.end())
        if end == -1:
            end = len(joined)
    if end > start:
        out += JOINED_ASCII_RE.findall(joined, done, start)
        out += JOINED_RE.findall(joined, start, end)
        done = end
    out += JOINED_ASCII_RE.findall(joined, done)
    return out


def special_tokens_pattern(special_tokens: Iterable[str], *, capture: bool = False) -> re.Pattern | None:
    """A pattern matching any special token, longest first so overlapping ones resolve to the longest.

    With ``capture``, ``pattern.split(text)`` keeps the special tokens at odd indices.
    None when there are no special tokens.
    """
    tokens = sorted(set(special_tokens), key=lambda t: (-len(t), t))
    if not tokens:
        return None
    body = "|".join(re.escape(t) for t in tokens)
    return re.compile(f"({body})" if capture else body)


def split_special(text: str, special_re: re.Pattern | None) -> list[str]:
    """Pieces of text alternating ordinary text (even indices) and special tokens (odd indices).

    ``special_re`` must come from ``special_tokens_pattern(..., capture=True)``.

    >>> split_special("a<|eot|>b", special_tokens_pattern(["<|eot|>"], capture=True))
    ['a', '<|eot|>', 'b']
    """
    if special_re is None:
        return [text]
    return special_re.split(text)


def count_pretokens_in_text(text: str, special_re: re.Pattern | None = None) -> Counter[str]:
    """Pretoken counts of text, never across a special token (``special_re`` without capture)."""
    units: Counter[str] = Counter()
    pieces = special_re.split(text) if special_re is not None else [text]
    for piece in pieces:
        units.update(UNIT_RE.findall(piece))
    return units_to_pretokens(units)


def units_to_pretokens(units: Counter[str]) -> Counter[str]:
    """Expand unit counts into pretoken counts."""
    counts: Counter[str] = Counter()
    for unit, n in units.items():
        for pretoken in GPT2_RE.findall(unit):
            counts[pretoken] += n
    return counts


# --- cutting files -------------------------------------------------------------------------

_PRINTABLE_ASCII = frozenset(range(0x21, 0x7F))


def _straddled(buf: bytes, pos: int, specials: Sequence[bytes]) -> bool:
    """Whether some occurrence of a special token starts before pos and ends after it."""
    for token in specials:
        lo = max(0, pos - len(token) + 1)
        hit = buf.find(token, lo, pos + len(token) - 1)
        if hit != -1 and hit < pos:
            return True
    return False


def last_safe_cut(buf: bytes, specials: Sequence[bytes], *, tries: int = 64) -> int:
    """The last position in buf where a corpus may be cut, or -1 if none was found.

    A cut is safe at the start of a special token, or after a newline that sits between two
    printable ASCII bytes (a pretoken boundary that no whitespace run can extend across), in
    both cases only where no special-token occurrence straddles it. Positions 0 and len(buf)
    are never returned.
    """
    candidates = []
    for token in specials:
        hit = buf.rfind(token, 1)
        if hit > 0:
            candidates.append(hit)
    for hit in sorted(candidates, reverse=True):
        if not _straddled(buf, hit, specials):
            return hit
    end = len(buf) - 1
    for _ in range(tries):
        hit = buf.rfind(b"\n", 1, end)
        if hit <= 0:
            return -1
        if buf[hit - 1] in _PRINTABLE_ASCII and buf[hit + 1] in _PRINTABLE_ASCII:
            if not _straddled(buf, hit + 1, specials):
                return hit + 1
        end = hit
    return -1


def find_chunk_boundaries(path: str | Path, num_chunks: int, special_tokens: Sequence[str]) -> list[int]:
    """Byte offsets [0, ..., size] cutting the file into at most num_chunks ranges at safe cuts.

    Each boundary is the first safe cut found at or after an even split of the file; ranges that
    would be empty are dropped, so fewer chunks come back when safe cuts are rare.
    """
    specials = [t.encode("utf-8") for t in special_tokens]
    size = Path(path).stat().st_size
    if size == 0:
        return [0]
    boundaries = [0]
    window = 1 << 16
    overlap = max([len(t) for t in specials] + [2])
    with open(path, "rb") as f:
        for i in range(1, num_chunks):
            target = max(size * i // num_chunks, boundaries[-1] + 1)
            pos = target
            found = -1
            while pos < size:
                # Read a little before the window so a cut right at its start can be checked.
                f.seek(pos - 1)
                buf = f.read(window + overlap)
                cut = _first_safe_cut(buf, specials)
                if cut != -1:
                    found = pos - 1 + cut
                    break
                pos += window
            if found == -1 or found >= size:
                break
            if found > boundaries[-1]:
                boundaries.append(found)
    boundaries.append(size)
    return boundaries


def _first_safe_cut(buf: bytes, specials: Sequence[bytes]) -> int:
    """The first safe cut in buf (same rules as last_safe_cut), or -1."""
    best = -1
    for token in specials:
        start = 1
        while True:
            hit = buf.find(token, start)
            if hit == -1 or (best != -1 and hit >= best):
                break
            if not _straddled(buf, hit, specials):
                best = hit
                break
            start = hit + 1
    start = 1
    while True:
        hit = buf.find(b"\n", start, len(buf) - 1)
        if hit == -1 or (best != -1 and hit + 1 >= best):
            break
        if buf[hit - 1] in _PRINTABLE_ASCII and buf[hit + 1] in _PRINTABLE_ASCII:
            if not _straddled(buf, hit + 1, specials):
                best = hit + 1
                break
        start = hit + 1
    return best


def decode_block(data: bytes, offset: int, path: str | Path) -> str:
    """UTF-8 text of a block read at byte offset of path; UserError naming the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}: not valid UTF-8 at byte offset {offset + exc.start} "
            f"(byte 0x{data[exc.start]:02x}); convert the file to UTF-8 first"
        ) from None


def iter_text_blocks(path: str | Path, start: int, end: int, special_tokens: Sequence[str],
                     block_bytes: int = BLOCK_BYTES) -> Iterable[str]:
    """Decoded text of bytes [start, end) of path, in blocks that end at safe cuts.

    Memory stays near block_bytes whatever the size of the range (unless the text has no safe
    cut for a long stretch, when the block grows until it finds one).
    """
    specials = [t.encode("utf-8") for t in special_tokens]
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        carry = b""
        while True:
            want = min(block_bytes, end - pos)
            chunk = f.read(want) if want > 0 else b""
            pos += len(chunk)
            data = carry + chunk
            if not data:
                return
            final = pos >= end or not chunk
            cut = len(data) if final else last_safe_cut(data, specials)
            if cut == -1:
                carry = data
                continue
            yield decode_block(data[:cut], pos - len(data), path)
            carry = data[cut:]
            if final:
                return


def count_pretokens_in_range(path: str | Path, start: int, end: int,
                             special_tokens: Sequence[str]) -> Counter[str]:
    """Pretoken counts of bytes [start, end) of a file, streamed; memory grows with distinct units only."""
    special_re = special_tokens_pattern(special_tokens)
    units: Counter[str] = Counter()
    for text in iter_text_blocks(path, start, end, special_tokens):
        pieces = special_re.split(text) if special_re is not None else [text]
        for piece in pieces:
            units.update(UNIT_RE.findall(piece))
    return units_to_pretokens(units)
