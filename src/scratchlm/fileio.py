"""Writing a file whole: a process killed mid-write leaves the old file or the new one, never a cut one."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> Path:
    """Replace the file at ``path`` with ``text`` in one step; returns the path.

    The text goes to a temporary file in the same directory (``.NAME.XXXXXXXX.tmp``, so the
    rename stays within one filesystem), which is flushed and fsynced and then renamed over
    ``path`` with ``os.replace``: a reader, or a process killed at any moment, sees either the
    old content or the new one. The directory is then fsynced too (where the system allows it),
    so the rename survives a power cut. If writing fails, the temporary file is removed and the
    old file is left as it was. The new file gets the usual permissions (0o666 less the umask).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, "w", encoding=encoding) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(path.parent)
    return path


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
