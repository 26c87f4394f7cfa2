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

A special token whose literal text is also an ordinary token's text form (``#`` is byte 0x23's,
``é`` byte 0xe9's, ``Ġthe`` that of ``b" the"``) cannot have its own key in vocab.json: the
ordinary token keeps the key and the special token is only in special_tokens.json, whose ids
``load_tokenizer`` reads, so saving and loading give back the same tokenizer. A Hugging Face
tokenizer.json cannot hold such a pair apart either (an added token whose text is in the model's
vocabulary takes that token's id), so none is written for such a tokenizer.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scratchlm.errors import UserError
from scratchlm.fileio import replacing_tree, write_text_atomic
from scratchlm.tokenizer.bytes_unicode import text_to_token, token_to_text
from scratchlm.tokenizer.pretokenize import GPT2_PAT

if TYPE_CHECKING:
    from scratchlm.tokenizer.tokenizer import Tokenizer

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
SPECIAL_TOKENS_FILE = "special_tokens.json"
HF_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (VOCAB_FILE, MERGES_FILE, SPECIAL_TOKENS_FILE, HF_TOKENIZER_FILE)

log = logging.getLogger("scratchlm.tokenizer")

# The largest id a Tokenizer can hold: it handles a token as the character chr(id).
MAX_TOKEN_ID = 0x10FFFF


def _read_text(path: str | os.PathLike, what: str) -> str:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: {what} not found" if not path.exists() else f"{path}: not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not valid UTF-8 at byte offset {exc.start}") from None


def read_vocab_json(path: str | os.PathLike, special_tokens: Sequence[str] = (),
                    special_ids: Mapping[str, int] | None = None) -> dict[int, bytes]:
    """id -> token bytes from a GPT-2-style vocab.json.

    With ``special_ids`` (token -> id, as special_tokens.json records them) the entries at those
    ids are the special tokens, and a special token whose text vocab.json gives to an ordinary
    token (see the module's docstring) is added at its id; ``special_tokens`` is then not used.
    Without them (GPT-2's own encoder.json), entries equal to a special token are read as
    literal UTF-8. Entries not in byte-to-unicode form are read as literal UTF-8 either way.
    """
    try:
        raw = json.loads(_read_text(path, "vocab file"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a JSON object mapping token text to id")
    special_at = {i: t for t, i in (special_ids or {}).items()}
    specials = set(special_tokens) if special_ids is None else set()
    vocab: dict[int, bytes] = {}
    for text, i in raw.items():
        _check_utf8(text, path)
        if not isinstance(i, int) or not 0 <= i <= MAX_TOKEN_ID:
            raise UserError(f"{path}: id of {text!r} must be an integer from 0 to {MAX_TOKEN_ID:,}, got {i!r}")
        if i in vocab:
            raise UserError(f"{path}: id {i} appears twice")
        if i in special_at:
            token = special_at[i].encode("utf-8")
            if text != special_at[i] and _text_form_bytes(text) != token:
                raise UserError(f"{path}: id {i} is {text!r}, but {SPECIAL_TOKENS_FILE} gives it to the special "
                                f"token {special_at[i]!r}")
            vocab[i] = token
        elif text in specials:
            vocab[i] = text.encode("utf-8")
        else:
            vocab[i] = _text_form_bytes(text)
    for i, token in sorted(special_at.items()):
        if i not in vocab:
            if token not in raw:  # (else the ordinary token raw[token] has its text)
                raise UserError(f"{path}: has no id {i}, which {SPECIAL_TOKENS_FILE} gives to {token!r}")
            vocab[i] = token.encode("utf-8")
    return vocab


def _check_utf8(text: str, path: str | os.PathLike) -> None:
    """UserError for a JSON string that holds a lone surrogate (``"\\udcff"``): no UTF-8 text does."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{path}: {text!r} is not valid UTF-8 text (a lone surrogate)") from None


def _text_form_bytes(text: str) -> bytes:
    """The bytes of a vocab.json entry: its byte-to-unicode form, or else its literal UTF-8."""
    try:
        return text_to_token(text)
    except ValueError:
        return text.encode("utf-8")


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


def _vocab_texts(vocab: dict[int, bytes],
                 special_ids: Mapping[str, int] | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """vocab.json's ``{text: id}`` (in id order), and the special tokens it leaves out.

    Ordinary tokens are in byte-to-unicode form, special tokens (``special_ids``: token -> id)
    their literal text. A special token whose text is also an ordinary token's is left out (the
    second dict maps it to that ordinary token's id): a JSON object holds a key once, and the
    ordinary token keeps it. Two ordinary tokens with the same bytes raise ``UserError``, since
    only one of them could be written.
    """
    special_at = {i: t for t, i in (special_ids or {}).items() if i in vocab}
    texts: dict[str, int] = {}
    for i in sorted(vocab):
        if i not in special_at:
            text = token_to_text(vocab[i])
            if text in texts:
                raise UserError(f"ids {texts[text]} and {i} of the vocabulary are the same token "
                                f"{vocab[i]!r}; a vocab.json can hold only one of them")
            texts[text] = i
    left_out = {t: texts[t] for t in special_at.values() if t in texts}
    texts.update((t, i) for i, t in special_at.items() if t not in left_out)
    return dict(sorted(texts.items(), key=lambda item: item[1])), left_out


def write_vocab_json(vocab: dict[int, bytes], path: str | os.PathLike,
                     special_ids: Mapping[str, int] | None = None) -> None:
    """Write id -> bytes as GPT-2's vocab.json (special tokens as literal text; see ``_vocab_texts``)."""
    texts, _ = _vocab_texts(vocab, special_ids)
    _write_vocab_texts(texts, path)


def _write_vocab_texts(texts: dict[str, int], path: str | os.PathLike) -> None:
    """vocab.json from `_vocab_texts`'s ``{text: id}``."""
    write_text_atomic(path, json.dumps(texts, ensure_ascii=False, indent=0) + "\n")


def write_merges_txt(merges: Sequence[tuple[bytes, bytes]], path: str | os.PathLike) -> None:
    """Write merges as GPT-2's merges.txt."""
    lines = ["#version: 0.2"] + [f"{token_to_text(a)} {token_to_text(b)}" for a, b in merges]
    write_text_atomic(path, "\n".join(lines) + "\n")


def read_special_tokens_json(path: str | os.PathLike) -> list[str]:
    """Special tokens from special_tokens.json (a list of strings is also accepted)."""
    return [token for token, _ in _special_token_entries(path)]


def _special_token_entries(path: str | os.PathLike) -> list[tuple[str, int | None]]:
    """(token, id) of each special token in special_tokens.json; the id is None where none is given."""
    try:
        raw = json.loads(_read_text(path, "special tokens file"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    entries = raw.get("special_tokens", []) if isinstance(raw, dict) else raw
    if not isinstance(entries, list):
        raise UserError(f"{path}: expected a list of special tokens")
    out: list[tuple[str, int | None]] = []
    for entry in entries:
        token = entry.get("token") if isinstance(entry, dict) else entry
        i = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(token, str) or not token or (i is not None and (not isinstance(i, int) or i < 0)):
            raise UserError(f"{path}: bad special token entry {entry!r}")
        if i is not None and i > MAX_TOKEN_ID:
            raise UserError(f"{path}: id {i} of {token!r} is too large (at most {MAX_TOKEN_ID:,})")
        _check_utf8(token, path)
        out.append((token, i))
    ids = [i for _, i in out if i is not None]
    if ids and len(ids) != len(out):  # (load_tokenizer would drop the ids given)
        raise UserError(f"{path}: some special tokens have an id and some do not; give every one an id, or none")
    if len(set(ids)) != len(ids):
        raise UserError(f"{path}: two special tokens have the same id")
    return out


def hf_unsupported(tokenizer: Tokenizer) -> str | None:
    """Why a Hugging Face tokenizer.json cannot hold the tokenizer (see the module's docstring), or None."""
    _, left_out = _vocab_texts(tokenizer.vocab, tokenizer.special_token_ids)
    return _no_hf_file(tokenizer, left_out) if left_out else None


def _no_hf_file(tokenizer: Tokenizer, left_out: dict[str, int]) -> str:
    """Why a Hugging Face tokenizer.json cannot hold the tokenizer (``left_out`` from ``_vocab_texts``)."""
    special, i = next(iter(left_out.items()))
    return (f"the special token {special!r} (id {tokenizer.special_token_ids[special]}) has the text of token "
            f"{i}, which a Hugging Face {HF_TOKENIZER_FILE} cannot hold apart")


def hf_tokenizer_json(tokenizer: Tokenizer) -> dict[str, Any]:
    """The tokenizer as a Hugging Face ``tokenizers`` tokenizer.json document.

    Pre-tokenization is GPT-2's regex (Split, isolated) followed by ByteLevel without its own
    regex; the BPE model has the byte-level vocabulary and the merges, with ``ignore_merges``
    (a pretoken that is a whole token maps to it, as here and in tiktoken); special tokens are
    added tokens, matched before pre-tokenization (longest first, as here). ``UserError`` for
    a tokenizer that a tokenizer.json cannot hold.
    """
    vocab, left_out = _vocab_texts(tokenizer.vocab, tokenizer.special_token_ids)
    if left_out:
        raise UserError(_no_hf_file(tokenizer, left_out))
    return _hf_document(tokenizer, vocab)


def _hf_document(tokenizer: Tokenizer, vocab: dict[str, int]) -> dict[str, Any]:
    special_ids = tokenizer.special_token_ids
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
    """Write the four tokenizer files into directory (created if needed), all or nothing.

    They are written into a new temporary sibling of directory, which then takes its place in
    one step (`scratchlm.fileio.replacing_tree`): a save cut off partway leaves the tokenizer
    that was there before (or none), never a mix of old and new files that would load as a
    wrong tokenizer. Whatever else directory holds (train-bpe's train_bpe.json, say) is
    hard-linked into the new one. Where the directory cannot be replaced so (it holds a folder,
    is a mount point or holds the working directory, or its file system has no hard links) the
    files are written into it one by one, each whole, as before.

    tokenizer.json is left out (and an older one removed), with a warning, for a tokenizer
    that has a special token with an ordinary token's text (see the module's docstring).
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory")
    texts, left_out = _vocab_texts(tokenizer.vocab, tokenizer.special_token_ids)  # (may refuse: nothing written yet)
    target = out.resolve()  # (a link to a directory stays one; "." gets a name)
    try:
        with replacing_tree(target) as staging:
            _link_other_files(target, staging)
            _write_tokenizer_files(tokenizer, texts, left_out, staging)
    except _CannotReplace:
        out.mkdir(parents=True, exist_ok=True)
        _write_tokenizer_files(tokenizer, texts, left_out, out)
    if left_out:
        log.warning("%s: no %s written: %s", out, HF_TOKENIZER_FILE, _no_hf_file(tokenizer, left_out))


class _CannotReplace(Exception):
    """The tokenizer directory cannot be replaced whole (see ``save_tokenizer``)."""


def _link_other_files(directory: Path, into: Path) -> None:
    """Hard-link into ``into`` whatever ``directory`` holds besides a tokenizer's files; raise
    _CannotReplace where that would not be all of it."""
    if not directory.exists():
        return
    if os.path.ismount(directory) or Path.cwd().is_relative_to(directory):
        raise _CannotReplace
    for entry in directory.iterdir():
        if entry.name in TOKENIZER_FILES:
            continue
        if entry.is_dir() and not entry.is_symlink():
            raise _CannotReplace
        try:
            os.link(entry, into / entry.name, follow_symlinks=False)
        except OSError as exc:
            raise _CannotReplace from exc


def _write_tokenizer_files(tokenizer: Tokenizer, texts: dict[str, int], left_out: dict[str, int], out: Path) -> None:
    _write_vocab_texts(texts, out / VOCAB_FILE)
    write_merges_txt(tokenizer.merges, out / MERGES_FILE)
    specials = {"special_tokens": [{"token": t, "id": tokenizer.special_token_ids[t]}
                                   for t in tokenizer.special_tokens]}
    write_text_atomic(out / SPECIAL_TOKENS_FILE, json.dumps(specials, ensure_ascii=False, indent=2) + "\n")
    if left_out:
        (out / HF_TOKENIZER_FILE).unlink(missing_ok=True)
    else:
        write_text_atomic(out / HF_TOKENIZER_FILE,
                          json.dumps(_hf_document(tokenizer, texts), ensure_ascii=False) + "\n")


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
    entries = _special_token_entries(src / SPECIAL_TOKENS_FILE) if has_specials else []
    specials = [token for token, _ in entries]
    if all(i is not None for _, i in entries):
        # The special tokens are the ids special_tokens.json gives them, whatever vocab.json's text.
        ids = dict(entries)
        vocab = read_vocab_json(src / VOCAB_FILE, special_ids=ids)
        tokenizer = Tokenizer(vocab, read_merges_txt(src / MERGES_FILE), specials)
        for token, i in ids.items():
            if tokenizer.special_token_ids[token] != i:
                raise UserError(f"{src}: {SPECIAL_TOKENS_FILE} gives {token!r} id {i}, but {VOCAB_FILE} also has "
                                f"it at id {tokenizer.special_token_ids[token]}")
    else:  # a list of special tokens without ids
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
