"""What a vocabulary says about the data: compression, token lengths, usage on a sample."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from scratchlm.errors import UserError
from scratchlm.tokenizer.tokenizer import Tokenizer


def read_sample(path: str | os.PathLike, max_bytes: int) -> str:
    """The first max_bytes of a UTF-8 file (less a character that max_bytes cuts off at the end)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: sample file not found" if not path.exists() else f"{path}: not a file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(min(max_bytes, size))  # (a huge max_bytes overflows read)
    if b"\x00" in data:  # text has no NUL bytes; a token file (uint16 ids below 256) has many
        raise UserError(f"{path}: binary data (NUL bytes), not a text sample; tokenizer-stats reads UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if len(data) < size and exc.start >= len(data) - 3 and exc.reason == "unexpected end of data":
            return data[:exc.start].decode("utf-8")
        raise UserError(f"{path}: not valid UTF-8 at byte offset {exc.start}") from None


def _show(token: bytes) -> str:
    return repr(token.decode("utf-8", errors="backslashreplace"))


def tokenizer_stats(tokenizer: Tokenizer, text: str, *, top: int = 20) -> dict[str, Any]:
    """Compression and vocabulary usage of tokenizer on text, as a JSON-ready dict.

    Keys: sample sizes, ``bytes_per_token`` / ``chars_per_token``, ``vocab_used_fraction``
    (distinct ids seen / vocabulary size), the longest tokens of the vocabulary, histograms of
    token length in bytes (over the vocabulary and over the sample's tokens), the most frequent
    tokens, and how many tokens the sample never uses.
    """
    ids = tokenizer.encode(text)
    counts = Counter(ids)
    vocab = tokenizer.vocab
    num_bytes = len(text.encode("utf-8"))
    specials = set(tokenizer.special_token_ids.values())
    ordinary = [i for i in vocab if i not in specials]

    vocab_lengths = Counter(len(vocab[i]) for i in ordinary)
    sample_lengths: Counter[int] = Counter()
    for i, n in counts.items():
        sample_lengths[len(vocab[i])] += n
    longest = sorted(ordinary, key=lambda i: (-len(vocab[i]), i))[:top]
    frequent = counts.most_common(top)
    return {
        "vocab_size": tokenizer.vocab_size,
        "num_merges": len(tokenizer.merges),
        "special_tokens": dict(tokenizer.special_token_ids),
        "tokenizer_hash": tokenizer.hash,
        "sample_bytes": num_bytes,
        "sample_chars": len(text),
        "num_tokens": len(ids),
        "bytes_per_token": num_bytes / len(ids) if ids else 0.0,
        "chars_per_token": len(text) / len(ids) if ids else 0.0,
        "distinct_tokens_used": len(counts),
        "vocab_used_fraction": len(counts) / len(vocab),
        "unused_tokens": len(vocab) - len(counts),
        "mean_token_bytes_vocab": sum(len(vocab[i]) for i in ordinary) / max(1, len(ordinary)),
        "longest_tokens": [{"id": i, "bytes": len(vocab[i]), "token": _show(vocab[i])} for i in longest],
        "most_frequent_tokens": [
            {"id": i, "count": n, "fraction": n / len(ids), "token": _show(vocab[i])} for i, n in frequent
        ],
        "token_bytes_histogram_vocab": {str(k): vocab_lengths[k] for k in sorted(vocab_lengths)},
        "token_bytes_histogram_sample": {str(k): sample_lengths[k] for k in sorted(sample_lengths)},
    }


SHOWN_SPECIAL_TOKENS = 10  # the report names this many special tokens, then counts the rest


def format_stats(stats: dict[str, Any]) -> str:
    """A human-readable report of tokenizer_stats output."""
    specials = list(stats["special_tokens"])
    shown = ", ".join(specials[:SHOWN_SPECIAL_TOKENS]) or "none"
    if len(specials) > SHOWN_SPECIAL_TOKENS:  # (70,000 of them made one line of a megabyte)
        shown += f", ... ({len(specials):,} in all; --json lists them)"
    lines = [
        f"vocabulary      {stats['vocab_size']:,} ids ({stats['num_merges']:,} merges, special: {shown})",
        f"hash            {stats['tokenizer_hash'][:16]}",
        f"sample          {stats['sample_bytes']:,} bytes, {stats['sample_chars']:,} chars "
        f"-> {stats['num_tokens']:,} tokens",
        f"compression     {stats['bytes_per_token']:.3f} bytes/token, {stats['chars_per_token']:.3f} chars/token",
        f"vocab used      {stats['distinct_tokens_used']:,} distinct ids = {stats['vocab_used_fraction']:.1%} "
        f"of the vocabulary ({stats['unused_tokens']:,} never seen in the sample)",
        "",
        "token length (bytes)   in vocab   in sample",
    ]
    vocab_hist = stats["token_bytes_histogram_vocab"]
    sample_hist = stats["token_bytes_histogram_sample"]
    total = max(1, stats["num_tokens"])
    for k in sorted({*vocab_hist, *sample_hist}, key=int):
        lines.append(f"  {k:>18}   {vocab_hist.get(k, 0):>8,}   {sample_hist.get(k, 0) / total:>8.1%}")
    lines += ["", "most frequent tokens"]
    for entry in stats["most_frequent_tokens"]:
        lines.append(f"  {entry['id']:>7}  {entry['fraction']:>6.2%}  {entry['token']}")
    lines += ["", "longest tokens"]
    for entry in stats["longest_tokens"]:
        lines.append(f"  {entry['id']:>7}  {entry['bytes']:>3} B  {entry['token']}")
    return "\n".join(lines)
