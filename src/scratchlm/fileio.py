"""Writing a file whole: a process killed mid-write leaves the old file or the new one, never a cut one."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def write_text_atomic(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> Path:
    """Replace the file at ``path`` with ``text`` in one step; returns the path.

    The text goes to a temporary file in the same directory (``.NAME.XXXXXXXX.tmp``, so the
    rename stays within one filesystem), which is flushed and fsynced and then renamed over
    ``path`` with ``os.replace``: a reader, or a process killed at any moment, sees either the
    old content or the new one. The directory is then fsynced too (where the system allows it),
    so the rename survives a power cut. If writing fails, the temporary file is removed and the
    old file is left as it was. The new file gets the usual permissions (0o666 less the umask).
    """
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)
    return Path(path)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """A file to stream into that replaces ``path`` in one step when the ``with`` block ends.

    ``mode`` is ``"w"`` (text, in ``encoding``) or ``"wb"``. What is written goes to a temporary
    file next to ``path``, as in `write_text_atomic`; when the block ends normally it is flushed,
    fsynced and renamed over ``path``. When the block raises (or the process is killed), the
    temporary file is removed (or left as a hidden ``.NAME.XXXXXXXX.tmp``) and ``path`` keeps its
    old content. For output too large to build as one string first::

        with atomic_open(out / "records.jsonl") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    tmp = temporary_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(path.parent)


def temporary_name(path: Path) -> Path:
    """A fresh hidden sibling of ``path`` to write before renaming over it (matches `TEMPORARY_GLOB`)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


# What a writer killed mid-write may leave next to the file it was replacing (for copies to skip).
TEMPORARY_GLOB = ".*.tmp"


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # (Windows cannot open a directory)
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    finally:
        os.close(fd)
