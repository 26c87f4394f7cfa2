"""Tokenizer files: GPT-2's vocab.json + merges.txt, special_tokens.json, and HF tokenizer.json.

A tokenizer directory holds:

- ``vocab.json``: ``{token text: id}`` with tokens in GPT-2's byte-to-unicode text form
  (``bytes_unicode``); special tokens appear as their literal text, as ``<|endoftext|>`` does
  in GPT-2's ``encoder.json``.
- ``merges.txt``: a ``#version: 0.2`` line, then one merge per line, ``left right`` in text form,
  in priority order.
- ``special_tokens.json``: ``{"special_tokens": [{"token": "<|endoftext|>", "id": 50256}, ...]}``.
- ``tokenizer.json``: the same tokenizer for the Hugging Face ``tokenizers`` library (GPT-2
  split regex, byte-level alphabet, BPE model, special tokens as added tokens); it gives the
  same ids. It is written for other tools and never read back here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scratchlm.errors import UserError
from scratchlm.fileio import write_text_atomic
from scratchlm.tokenizer.bytes_unicode import text_to_token, token_to_text
from scratchlm.tokenizer.pretokenize import GPT2_PAT

if TYPE_CHECKING:
    from scratchlm.tokenizer.tokenizer import Tokenizer

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
SPECIAL_TOKENS_FILE = "special_tokens.json"
HF_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (VOCAB_FILE, MERGES_FILE, SPECIAL_TOKENS_FILE, HF_TOKENIZER_FILE)


def _read_text(path: str | os.PathLike, what: str) -> str:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: {what} not found" if not path.exists() else f"{path}: not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not valid UTF-8 at byte offset {exc.start}") from None


def read_vocab_json(path: str | os.PathLike, special_tokens: Sequence[str] = ()) -> dict[int, bytes]:
    """id -> token bytes from a GPT-2-style vocab.json.

    Entries equal to a special token, or not in byte-to-unicode form, are read as literal UTF-8.
    """
    try:
        raw = json.loads(_read_text(path, "vocab file"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a JSON object mapping token text to id")
    specials = set(special_tokens)
    vocab: dict[int, bytes] = {}
    for text, i in raw.items():
        if not isinstance(i, int) or i < 0:
            raise UserError(f"{path}: id of {text!r} must be a non-negative integer, got {i!r}")
        if i in vocab:
            raise UserError(f"{path}: id {i} appears twice")
        if text in specials:
            vocab[i] = text.encode("utf-8")
            continue
        try:
            vocab[i] = text_to_token(text)
        except ValueError:
            vocab[i] = text.encode("utf-8")
    return vocab


def read_merges_txt(path: str | os.PathLike) -> list[tuple[bytes, bytes]]:
    """Merges from a GPT-2-style merges.txt (an optional ``#version`` first line, then pairs)."""
    merges: list[tuple[bytes, bytes]] = []
    for lineno, line in enumerate(_read_text(path, "merges file").split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise UserError(f"{path}:{lineno}: expected two tokens separated by one space, got {line!r}")
        try:
            merges.append((text_to_token(parts[0]), text_to_token(parts[1])))
        except ValueError as exc:
            raise UserError(f"{path}:{lineno}: {exc}") from None
    return merges


def write_vocab_json(vocab: dict[int, bytes], path: str | os.PathLike,
                     special_ids: dict[str, int] | None = None) -> None:
    """Write id -> bytes as GPT-2's vocab.json (special tokens as literal text)."""
    literal = {i: t for t, i in (special_ids or {}).items()}
    out: dict[str, int] = {}
    for i in sorted(vocab):
        text = literal.get(i)
        if text is None:
            text = token_to_text(vocab[i])
        out.setdefault(text, i)
    write_text_atomic(path, json.dumps(out, ensure_ascii=False, indent=0) + "\n")


def write_merges_txt(merges: Sequence[tuple[bytes, bytes]], path: str | os.PathLike) -> None:
    """Write merges as GPT-2's merges.txt."""
    lines = ["#version: 0.2"] + [f"{token_to_text(a)} {token_to_text(b)}" for a, b in merges]
    write_text_atomic(path, "\n".join(lines) + "\n")


def read_special_tokens_json(path: str | os.PathLike) -> list[str]:
    """Special tokens from special_tokens.json (a list of strings is also accepted)."""
    try:
        raw = json.loads(_read_text(path, "special tokens file"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    entries = raw.get("special_tokens", []) if isinstance(raw, dict) else raw
    if not isinstance(entries, list):
        raise UserError(f"{path}: expected a list of special tokens")
    tokens = []
    for entry in entries:
        token = entry.get("token") if isinstance(entry, dict) else entry
        if not isinstance(token, str) or not token:
            raise UserError(f"{path}: bad special token entry {entry!r}")
        tokens.append(token)
    return tokens


def hf_tokenizer_json(tokenizer: Tokenizer) -> dict[str, Any]:
    """The tokenizer as a Hugging Face ``tokenizers`` tokenizer.json document.

    Pre-tokenization is GPT-2's regex (Split, isolated) followed by ByteLevel without its own
    regex; the BPE model has the byte-level vocabulary and the merges, with ``ignore_merges``
    (a pretoken that is a whole token maps to it, as here and in tiktoken); special tokens are
    added tokens, matched before pre-tokenization (longest first, as here).
    """
    special_ids = tokenizer.special_token_ids
    special_by_id = {i: t for t, i in special_ids.items()}
    vocab: dict[str, int] = {}
    for i in sorted(tokenizer.vocab):
        text = special_by_id.get(i)
        vocab.setdefault(token_to_text(tokenizer.vocab[i]) if text is None else text, i)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": special_ids[t], "content": t, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for t in tokenizer.special_tokens
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": GPT2_PAT}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": [[token_to_text(a), token_to_text(b)] for a, b in tokenizer.merges],
        },
    }


def save_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike) -> None:
    """Write the four tokenizer files into directory (created if needed)."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    write_vocab_json(tokenizer.vocab, out / VOCAB_FILE, tokenizer.special_token_ids)
    write_merges_txt(tokenizer.merges, out / MERGES_FILE)
    specials = {"special_tokens": [{"token": t, "id": tokenizer.special_token_ids[t]}
                                   for t in tokenizer.special_tokens]}
    write_text_atomic(out / SPECIAL_TOKENS_FILE, json.dumps(specials, ensure_ascii=False, indent=2) + "\n")
    write_text_atomic(out / HF_TOKENIZER_FILE, json.dumps(hf_tokenizer_json(tokenizer), ensure_ascii=False) + "\n")


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a directory written by ``save_tokenizer``."""
    from scratchlm.tokenizer.tokenizer import Tokenizer

    src = Path(directory)
    if not src.is_dir():
        raise UserError(f"{src}: tokenizer directory not found" if not src.exists()
                        else f"{src}: not a directory (expected a tokenizer directory)")
    for name in (VOCAB_FILE, MERGES_FILE):
        if not (src / name).is_file():
            raise UserError(f"{src}: not a tokenizer directory (no {name})")
    has_specials = (src / SPECIAL_TOKENS_FILE).is_file()
    specials = read_special_tokens_json(src / SPECIAL_TOKENS_FILE) if has_specials else []
    tokenizer = Tokenizer.from_files(src / VOCAB_FILE, src / MERGES_FILE, specials)
    # Every longer ordinary token comes from a merge: one that none makes could never be produced.
    made = {left + right for left, right in tokenizer.merges}
    special_ids = set(tokenizer.special_token_ids.values())
    for i, token in sorted(tokenizer.vocab.items()):
        if len(token) > 1 and i not in special_ids and token not in made:
            why = (f"or it is a special token and {SPECIAL_TOKENS_FILE} (missing) must list it" if not has_specials
                   else "or does not belong to this vocab.json")
            raise UserError(f"{src}: {VOCAB_FILE} has {token.decode('utf-8', 'backslashreplace')!r} (id {i}), "
                            f"which no merge in {MERGES_FILE} makes: {MERGES_FILE} is incomplete, {why}")
    return tokenizer
