"""Writing a file whole: a process killed mid-write leaves the old file or the new one, never a cut one."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from glob import escape as glob_escape
from pathlib import Path
from typing import IO, Any

from scratchlm.errors import UserError


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


def resolve_path(path: str | os.PathLike, what: str) -> Path:
    """`Path(path).resolve()`; a symbolic link loop on the way is a UserError naming `what`
    (such as ``--out F``)."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError):  # RuntimeError before Python 3.13
        raise UserError(f"{what}: a symbolic link on its path leads back to itself") from None


def check_writable_dir(directory: str | os.PathLike, what: str) -> None:
    """Refuse, with a UserError naming ``what`` (such as ``--out results.jsonl``), a ``directory``
    that files cannot be written into: one that exists and takes no new file, or one that is
    missing and cannot be created there. For a command to call before long work that writes
    there at the end. Checked by creating (and removing) an empty temporary file in the directory,
    or in its nearest existing ancestor: unlike `os.access`, that also catches a read-only file
    system or /proc, and is right for root too. Nothing is created or left behind."""
    directory = Path(directory)
    try:
        os.stat(directory)
    except (FileNotFoundError, NotADirectoryError):
        pass  # (made later, or a file in the way: found below)
    except OSError as exc:  # a symbolic link that leads back to itself, which exists() calls missing
        raise UserError(f"{what}: {exc.strerror}: {directory}") from None
    existing = next(p for p in (directory, *directory.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"{what}: {existing} is a file, not a directory")
    probe = temporary_name(existing / "write-check")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        where = (f"cannot write in {existing}" if existing == directory
                 else f"cannot create {directory}: cannot write in {existing}")
        raise UserError(f"{what}: {where} ({exc.strerror or exc})") from exc
    os.unlink(probe)


def move_aside(path: Path, tag: str) -> Path:
    """Rename the directory ``path`` to its hidden sibling ``.NAME.TAG`` and return that path, to
    be put back or deleted later. One left there by a process killed before it did either is the
    older of the two and is deleted first."""
    aside = path.with_name(f".{path.name}.{tag}")
    if aside.exists():
        shutil.rmtree(aside)
    path.rename(aside)
    return aside


def temporary_name(path: Path) -> Path:
    """A fresh hidden sibling of ``path`` to write before renaming over it (matches `TEMPORARY_GLOB`)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


# What a writer killed mid-write may leave next to the file it was replacing (for copies to skip).
TEMPORARY_GLOB = ".*.tmp"


def copy_tree_atomic(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Make ``dst`` a copy of the directory ``src`` in one step; returns ``dst``.

    The files are copied (skipping `TEMPORARY_GLOB` names, what a writer killed in ``src`` may
    have left) into a new directory that then replaces ``dst`` as `replacing_tree` says: ``dst``
    ends up exactly a copy of ``src`` (nothing of the old copy is kept), a process killed during
    the copy leaves the old ``dst`` as it was, and leftovers of an earlier kill are removed by
    the next copy.
    """
    with replacing_tree(dst) as staging:
        shutil.copytree(src, staging, ignore=shutil.ignore_patterns(TEMPORARY_GLOB), dirs_exist_ok=True)
    return Path(dst)


@contextlib.contextmanager
def replacing_tree(dst: str | os.PathLike) -> Iterator[Path]:
    """A new empty directory to fill, which replaces the directory ``dst`` in one step when the
    ``with`` block ends.

    The directory is a temporary sibling of ``dst`` (``.NAME.XXXXXXXX.tmp``). When the block
    ends normally its files are fsynced and it is put in place: a previous ``dst`` is swapped
    with it in one atomic step where the system can (Linux's `renameat2` exchange,
    `exchange_paths`) and removed after, so there is never a moment without a ``dst``.
    Elsewhere the previous ``dst`` is renamed aside just before the new one is renamed in: only
    between those two renames is there no ``dst``, and then the old one is in a hidden
    ``.NAME.XXXXXXXX.tmp`` sibling. When the block raises, or the process is killed before the
    swap, ``dst`` is left as it was; leftovers of an earlier kill are removed first.
    """
    dst = Path(dst)
    for stale in dst.parent.glob(f".{glob_escape(dst.name)}.*.tmp"):
        _remove(stale)
    staging, old = temporary_name(dst), None
    try:
        staging.mkdir(parents=True)
        yield staging
        for directory, _, files in os.walk(staging):
            for name in files:
                fd = os.open(Path(directory) / name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            _fsync_directory(Path(directory))
        if (dst.exists() or dst.is_symlink()) and exchange_paths(staging, dst):
            old, staging = staging, None  # (the swap put the old dst where the new one was)
        else:
            if dst.exists() or dst.is_symlink():
                old = temporary_name(dst)
                os.rename(dst, old)
            os.rename(staging, dst)
    except BaseException:
        if old is not None and not (dst.exists() or dst.is_symlink()):
            with contextlib.suppress(OSError):
                os.rename(old, dst)  # the new one did not take its place: the old one goes back
        if staging is not None:
            _remove(staging)
        raise
    _fsync_directory(dst.parent)
    if old is not None:
        _remove(old)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths in one atomic step (Linux `renameat2` with RENAME_EXCHANGE).

    Returns False, changing nothing, where the system or the file system has no such call
    (another OS, an old C library or kernel, a file system that refuses it); other failures
    raise OSError."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(b))


def _remove(path: Path) -> None:
    """Remove a file, a link or a directory tree; whatever cannot be removed is left."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


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
