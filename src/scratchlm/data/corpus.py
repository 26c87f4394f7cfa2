"""Training and validation text for a small run: the Python standard library, a file or a dataset.

The standard library's own sources are on every machine that runs scratchlm and need no
download: ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, tests and site-packages left out.
Files are ordered by a hash of their relative path (deterministic and well mixed), one in ten
goes to validation by the same hash, and documents are joined by ``<|endoftext|>``. A UTF-8
text file or the name of a registry dataset already downloaded (`scratchlm.data.registry`)
works instead. Standard library only: building a corpus imports neither torch nor numpy.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from scratchlm.errors import UserError

EOT = "<|endoftext|>"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")


def stdlib_documents() -> Iterator[tuple[str, str]]:
    """(relative path, source) of the standard library's modules, read lazily in hash order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if not _SKIP_DIRS.intersection(rel.split("/")):
            paths.append((_hash(rel), rel, path))
    for _, rel, path in sorted(paths):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield rel, text.replace(EOT, "")


def split_documents(docs: Iterable[tuple[str, str]], max_bytes: int) -> tuple[str, str]:
    """Train and validation text: one document in ten (by name hash) is held out.

    Training text (separators included) stops at `max_bytes`, validation at a tenth of it;
    documents that would overflow are skipped, and reading stops once both are nearly full.
    """
    parts: tuple[list[str], list[str]] = ([], [])
    sizes = [0, 0]
    budgets = (max_bytes, max_bytes // 10)
    sep = len(EOT.encode("utf-8"))
    for name, text in docs:
        held_out = int(_hash(name) % 10 == 0)
        size = len(text.encode("utf-8")) + (sep if parts[held_out] else 0)
        if sizes[held_out] + size <= budgets[held_out] or not parts[held_out]:
            parts[held_out].append(text)
            sizes[held_out] += size
        if all(sizes[i] >= 0.9 * budgets[i] for i in (0, 1)):
            break
    if not parts[0] or not parts[1]:
        raise UserError("the corpus is too small to split into training and validation text")
    return EOT.join(parts[0]), EOT.join(parts[1])


def read_head(path: Path, max_bytes: int) -> str:
    """The first `max_bytes` of a UTF-8 file, cut at a document or line boundary."""
    with open(path, "rb") as f:
        data = f.read(min(max_bytes, os.fstat(f.fileno()).st_size) + 1)  # (a huge max_bytes overflows read)
    head = data[:max_bytes]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason != "unexpected end of data":  # not just a character cut at max_bytes
            raise UserError(f"{path}: not valid UTF-8 (byte 0x{head[exc.start]:02x} at offset {exc.start}); "
                            "convert the file to UTF-8 first") from None
        text = head[:exc.start].decode("utf-8")
    if len(data) > max_bytes:
        cut = text.rfind(EOT)
        cut = cut if cut > len(text) // 2 else text.rfind("\n")
        text = text[:cut] if cut > 0 else text
    return text


def text_file_split(path: Path, max_bytes: int) -> tuple[str, str]:
    """Train/validation text from one file: held-out documents by hash of their index, or
    the last tenth when the file is not split into documents."""
    text = read_head(path, max_bytes + max_bytes // 10)
    if not text.replace(EOT, "").strip():
        raise UserError(f"{path}: no text to train on (the file is empty, blank or only {EOT} separators)")
    docs = [d for d in text.split(EOT) if d.strip()]
    if len(docs) >= 20:
        return split_documents([(str(i), d) for i, d in enumerate(docs)], max_bytes)
    cut = text.rfind("\n", 0, int(len(text) * 0.9)) + 1  # after a newline, or at 90% without one
    cut = cut if cut > 0 else int(len(text) * 0.9)
    return text[:cut], text[cut:]


def dataset_split(name: str, data_dir: Path, max_bytes: int) -> tuple[str, str]:
    """Train/validation text of a registry dataset already downloaded into `data_dir`."""
    from scratchlm.data.registry import DATASETS, get_dataset

    base = name.removesuffix("-train")
    train_entry = DATASETS.get(f"{base}-train") or get_dataset(name)
    train_path = data_dir / train_entry.local_name
    if not train_path.is_file():
        raise UserError(f"dataset {train_entry.name!r} is not in {data_dir}; run "
                        f"`scratchlm download {train_entry.name}` first (or pass --data-dir)")
    valid_entry = DATASETS.get(f"{base}-valid")
    if valid_entry is not None and (data_dir / valid_entry.local_name).is_file():
        return read_head(train_path, max_bytes), read_head(data_dir / valid_entry.local_name, max_bytes // 10)
    return text_file_split(train_path, max_bytes)


def build_corpus(data: str | None, data_dir: Path, max_bytes: int) -> tuple[str, str, str]:
    """(description, train text, validation text) of `data`: None for the standard library
    sources, else a UTF-8 text file or the name of a dataset downloaded into `data_dir`.
    Training text stops near `max_bytes`, validation text near a tenth of it."""
    if data is None:
        docs = stdlib_documents()
        train, valid = split_documents(docs, max_bytes)
        return f"the Python {sys.version.split()[0]} standard library sources", train, valid
    path = Path(data)
    if path.is_file():
        train, valid = text_file_split(path, max_bytes)
        return str(path), train, valid
    from scratchlm.data.registry import DATASETS

    if data in DATASETS or f"{data}-train" in DATASETS:
        train, valid = dataset_split(data, data_dir, max_bytes)
        return f"dataset {data}", train, valid
    raise UserError(f"--data {data!r} is neither a text file nor a dataset name ({', '.join(DATASETS)})")
