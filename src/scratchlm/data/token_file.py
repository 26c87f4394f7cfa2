"""The token-file format, read and checked in one place.

A token file is ``X.bin``, the ids as flat little-endian ``uint16`` (``uint32`` when the
vocabulary has more than 65,536 entries), beside ``X.json``, its sidecar::

    {"dtype": "uint16", "vocab_size": 10000, "tokenizer_hash": "...", "num_documents": 2717,
     "num_tokens": 2893342, ...}

`scratchlm encode` writes the sidecar last, so a sidecar marks a complete file.
`read_sidecar` parses and validates it; `open_checked` is what a model's reader (the trainer,
`scratchlm eval`) calls: it refuses, with a one-line `UserError` that names the file and the
fix, anything that would otherwise fail in the middle of training or train silently on the
wrong data:

* no sidecar (a raw dump, or a ``.txt`` given where a token file belongs);
* a sidecar vocabulary larger than the model's;
* an id >= the model's vocabulary (the embedding lookup would fail at the first step: an
  ``IndexError`` on CPU, a device-side assert on CUDA). Found with a chunked max over the
  memmap, so a multi-gigabyte file is streamed, never loaded whole;
* a tokenizer hash other than the run's tokenizer, when both are known.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from scratchlm.errors import UserError

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
CHUNK_TOKENS = 1 << 24  # 32-64 MB a read while scanning for the largest id
_TEXT_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json", ".csv", ".tsv")
ENCODE_HINT = "encode it with `scratchlm encode TEXT --tokenizer DIR --out OUT.bin`"


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype a token file of this vocabulary is written in: ``uint16`` when every id fits
    (vocab_size <= 65536), otherwise ``uint32``; little-endian."""
    return DTYPES["uint16"] if vocab_size <= 1 << 16 else DTYPES["uint32"]


def sidecar_path(bin_path: str | os.PathLike) -> Path:
    """``X.bin -> X.json``: where the metadata of a token file lives."""
    return Path(bin_path).with_suffix(".json")


def read_sidecar(bin_path: str | os.PathLike) -> dict[str, Any] | None:
    """The parsed sidecar of `bin_path`, or None when it has none; a malformed one is a UserError."""
    sidecar = sidecar_path(bin_path)
    if sidecar == Path(bin_path) or not sidecar.is_file():
        return None
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        meta = None
    if not isinstance(meta, dict):
        raise UserError(f"sidecar {sidecar} is not a JSON object; encode the text again with `scratchlm encode`")
    name = meta.get("dtype", "uint16")
    if not isinstance(name, str) or name not in DTYPES:
        raise UserError(f"sidecar {sidecar} names dtype {name!r}; expected one of {sorted(DTYPES)}")
    # The fields the readers compute with: a hand-edited value of the wrong type would fail deep in
    # them (int('abc'), a hash sliced as a string) instead of naming the sidecar.
    for key, least in (("vocab_size", 1), ("num_tokens", 0)):
        value = meta.get(key)
        if value is not None and (type(value) is not int or value < least):
            raise UserError(f"sidecar {sidecar}: {key} must be an integer >= {least}, got {value!r}; "
                            "encode the text again with `scratchlm encode`")
    vocab = meta.get("vocab_size")
    if vocab is not None and DTYPES[name].itemsize < token_dtype(vocab).itemsize:
        # (a uint32 file read as uint16 holds only small ids, every other one 0: nothing else catches it)
        raise UserError(f"sidecar {sidecar}: dtype {name} cannot hold the ids of a vocab_size of {vocab} "
                        f"(ids past 65,535 need uint32); write the file's dtype in it, or encode the text "
                        "again with `scratchlm encode`")
    hash_ = meta.get("tokenizer_hash")
    if hash_ is not None and not isinstance(hash_, str):
        raise UserError(f"sidecar {sidecar}: tokenizer_hash must be a string, got {hash_!r}; "
                        "encode the text again with `scratchlm encode`")
    return meta


def is_token_file(path: str | os.PathLike) -> bool:
    """True when `path` is a token file as `scratchlm encode` writes it: its sidecar is well formed
    and counts exactly the tokens the file holds (a text file beside a sidecar of its name is not)."""
    path = Path(path)
    if not path.is_file():  # (a folder such as "." or "/" has no sidecar name: with_suffix raises)
        return False
    try:
        meta = read_sidecar(path)
    except UserError:
        return False
    if meta is None or meta.get("num_tokens") is None:
        return False
    return path.stat().st_size == meta["num_tokens"] * DTYPES[meta.get("dtype", "uint16")].itemsize


def max_token_id(tokens: np.ndarray, *, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """The largest id in `tokens`, reading a memmap `chunk_tokens` at a time (never whole)."""
    largest = 0
    for start in range(0, len(tokens), chunk_tokens):
        largest = max(largest, int(np.max(tokens[start:start + chunk_tokens])))
    return largest


def open_checked(path: str | os.PathLike, *, vocab_size: int, context_length: int | None = None,
                 tokenizer_hash: str | None = None, tokenizer_dir: str | os.PathLike | None = None,
                 what: str = "token file") -> np.memmap:
    """Memory-map a token file for a model of `vocab_size`, after the checks in the module docstring.

    `what` names the setting the path came from (``"data.train_path"``), so the message points
    at it; `tokenizer_hash` is the hash of the run's tokenizer (from `tokenizer_dir`, named in
    the message), or None when the run names none.
    """
    from scratchlm.data.batch import open_tokens

    path = Path(path)
    if path.is_file() and path.suffix.lower() in _TEXT_SUFFIXES:
        raise UserError(f"{what} {path} is a text file, not a token file; {ENCODE_HINT}")
    meta = read_sidecar(path) if path.is_file() else {}
    if meta is None:
        if _looks_like_text(path):
            raise UserError(f"{what} {path} is a text file, not a token file; {ENCODE_HINT}")
        raise UserError(f"{what} {path} has no sidecar {sidecar_path(path).name} (dtype, vocab_size, tokenizer "
                        f"hash), so it cannot be checked against the model; {ENCODE_HINT}")
    tokens = open_tokens(path, context_length=context_length, meta=meta)
    vocab = meta.get("vocab_size")
    if vocab is not None and int(vocab) > vocab_size:
        raise UserError(f"{what} {path} was encoded with a vocabulary of {vocab} tokens, larger than "
                        f"model.vocab_size={vocab_size}; set model.vocab_size={vocab} or encode the data "
                        f"with a tokenizer of at most {vocab_size} tokens")
    recorded = meta.get("tokenizer_hash")
    if tokenizer_hash and recorded and recorded != tokenizer_hash:
        where = f" ({tokenizer_dir})" if tokenizer_dir else ""
        raise UserError(f"{what} {path} was encoded with another tokenizer (hash {recorded[:12]}) than this "
                        f"run's{where} (hash {tokenizer_hash[:12]}); encode the text again with the run's "
                        f"tokenizer, or set data.tokenizer_dir to the one the data was encoded with")
    largest = max_token_id(tokens)  # the one pass over the whole file, after the cheap checks
    if largest >= vocab_size:
        raise UserError(f"{what} {path} holds token id {largest}, beyond model.vocab_size={vocab_size} "
                        f"(ids must be < {vocab_size}); the file or its sidecar is wrong: {ENCODE_HINT}")
    if vocab is not None and largest >= int(vocab):
        raise UserError(f"{what} {path} holds token id {largest}, but its sidecar gives vocab_size={vocab}; "
                        f"the file or its sidecar (its dtype?) is wrong: {ENCODE_HINT}")
    return tokens


def _looks_like_text(path: Path) -> bool:
    """True when the first KB is printable UTF-8 (token ids almost never are)."""
    with open(path, "rb") as f:
        head = f.read(1024)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return bool(text) and all(c.isprintable() or c in "\n\r\t" for c in text)
