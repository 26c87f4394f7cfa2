"""Download registered datasets: streaming, resumable, checksummed, atomic.

* **Streaming** with ``urllib`` (no extra dependency), 1 MiB at a time, into ``NAME.partial``.
* **Resume.** A ``.partial`` left by an interrupted transfer is continued with an HTTP
  ``Range: bytes=N-`` request, within one call (``retries``) and across calls. A server that
  ignores the range (``200`` instead of ``206``) or answers for another offset gets a clean
  restart from byte 0, never a splice.
* **Checksum.** The sha256 of the served file is computed while it streams. When an expected
  value is known (``--sha256`` or the registry), a mismatch renames the file to ``.corrupt``
  (nothing is deleted silently) and raises. When none is known, the value is returned, printed
  by the command and written to ``FILE.sha256`` (``sha256sum`` format, naming the served file).
* **Atomic.** Only a complete, verified (and, for ``.gz`` entries, fully gunzipped) file is
  synced to disk and renamed to its final name, so a file under its final name is always whole,
  after a power cut too.
* **Errors** are one line: HTTP status and URL, connection failures, timeouts.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from scratchlm.data.registry import MIRROR_ENV, DatasetEntry, get_dataset
from scratchlm.errors import UserError
from scratchlm.fileio import check_writable_dir, write_text_atomic

BLOCK = 1 << 20
MAX_RETRY_WAIT = 60.0  # seconds: the doubling waits between retries stop growing here
USER_AGENT = "scratchlm-download/0.1"


class DownloadError(UserError):
    """A transfer that failed for a reason the user can act on (network, HTTP status, checksum)."""


class _Retryable(Exception):
    """A transient failure: the partial file is kept and the transfer is tried again."""


@dataclass(frozen=True)
class Downloaded:
    """What ``download_dataset`` did."""

    path: Path  # the final file
    sha256: str  # of the file as served (the .gz for gzipped entries)
    verified: bool  # sha256 was compared with an expected value
    fetched: bool  # False when the file was already present


def download_dataset(
    dataset: str | DatasetEntry,
    out_dir: str | os.PathLike = "data",
    *,
    mirror: str | None = None,
    sha256: str | None = None,
    progress: bool = True,
    timeout: float = 30.0,
    retries: int = 3,
    retry_wait: float = 1.0,
) -> Downloaded:
    """Download a registered dataset into ``out_dir`` and return where it is.

    ``mirror`` (or ``$SCRATCHLM_DATASET_MIRROR``) replaces the entry's base URL. ``sha256``
    overrides the registry's checksum. ``timeout`` bounds each connect and read (seconds);
    ``retries`` transient failures are resumed after ``retry_wait * 2**attempt`` seconds, at most
    ``MAX_RETRY_WAIT``.
    """
    entry = get_dataset(dataset) if isinstance(dataset, str) else dataset
    mirror = mirror or os.environ.get(MIRROR_ENV) or None
    expected = _normalize_sha(sha256) if sha256 else (entry.sha256.lower() if entry.sha256 else None)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out-dir {out} exists and is not a directory")
    final = out / entry.local_name
    checksum_file = final.with_name(final.name + ".sha256")

    if final.exists():
        return _already_present(entry, final, checksum_file, expected)
    check_writable_dir(out, f"--out-dir {out}")  # a file in the way, or a folder that takes no file
    out.mkdir(parents=True, exist_ok=True)

    served = out / entry.remote_name
    if entry.compression and served.is_file():  # downloaded by an earlier run that stopped unpacking
        source, digest = served, _sha256_of(served)
    else:
        source = served.with_name(served.name + ".partial")
        digest = _fetch(entry.url(mirror), source, timeout=timeout, retries=retries,
                        retry_wait=retry_wait, progress=progress)
    if expected and digest != expected:
        _quarantine(source, served, expected, digest)
    os.replace(source, served if entry.compression else final)

    if entry.compression == "gzip":
        _gunzip(served, final, progress=progress)
        served.unlink()
    elif entry.compression is not None:
        raise UserError(f"dataset {entry.name}: unknown compression {entry.compression!r}")
    write_text_atomic(checksum_file, f"{digest}  {entry.remote_name}\n")
    return Downloaded(final, digest, verified=expected is not None, fetched=True)


def _already_present(entry: DatasetEntry, final: Path, checksum_file: Path, expected: str | None) -> Downloaded:
    recorded = _read_checksum_file(checksum_file)
    if entry.compression is None:
        digest = _sha256_of(final) if (expected or recorded is None) else recorded
    elif recorded is not None:
        digest = recorded  # the served .gz is gone; its checksum was recorded at download time
    elif expected:
        raise DownloadError(f"{final} has no {checksum_file.name} to verify against; delete it to download again")
    else:
        digest = ""
    if expected and digest != expected:
        _quarantine(final, final, expected, digest)
    if digest and recorded is None:
        write_text_atomic(checksum_file, f"{digest}  {entry.remote_name}\n")
    return Downloaded(final, digest, verified=expected is not None, fetched=False)


# ---------------------------------------------------------------------------------------------
# Transfer


def _fetch(url: str, partial: Path, *, timeout: float, retries: int, retry_wait: float,
           progress: bool) -> str:
    """Bring ``partial`` to the full content at ``url``; returns its sha256."""
    attempt = 0
    while True:
        try:
            return _fetch_once(url, partial, timeout=timeout, progress=progress)
        except _Retryable as exc:
            if attempt >= retries:
                kept = partial.stat().st_size if partial.exists() else 0
                resume = f"; run again to resume ({kept} bytes kept in {partial.name})" if kept else ""
                raise DownloadError(f"download of {url} failed: {exc}{resume}") from None
            # (uncapped, --retries 20 slept 6 days before its last try)
            time.sleep(min(retry_wait * 2 ** attempt, MAX_RETRY_WAIT))
            attempt += 1


def _fetch_once(url: str, partial: Path, *, timeout: float, progress: bool) -> str:
    have = partial.stat().st_size if partial.exists() else 0
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # the partial is not a prefix the server can continue
            partial.unlink()
            raise _Retryable("the server refused to resume; restarting from the beginning") from None
        if exc.code < 500 and exc.code != 429:
            raise DownloadError(f"HTTP {exc.code} {exc.reason} for {url}") from None
        raise _Retryable(f"HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise _Retryable(_reason(exc.reason)) from None
    except ValueError as exc:  # no scheme (a bare folder path), a malformed host
        raise DownloadError(f"cannot download {url}: {exc}; a mirror is a base URL such as "
                            "https://host/path or file:///absolute/folder") from None
    except (OSError, http.client.HTTPException) as exc:
        raise _Retryable(_reason(exc)) from None

    with response:
        length = response.headers.get("Content-Length")
        length = int(length) if length is not None and length.isdigit() else None
        start = 0
        if have and response.status == 206:
            start, total = _parse_content_range(response.headers.get("Content-Range", ""))
            if start != have:
                partial.unlink()
                raise _Retryable(f"the server resumed at byte {start}, not {have}; restarting")
            if total is None and length is not None:
                total = have + length
        else:  # a full body: no partial, or a server that ignores Range
            total = length
        digest = hashlib.sha256()
        if start:
            _hash_into(digest, partial)
        bar = _progress_bar(progress, total, start, partial.name.removesuffix(".partial"))
        try:
            with open(partial, "ab" if start else "wb") as f:
                while True:
                    try:
                        block = response.read(BLOCK)
                    except (OSError, http.client.HTTPException) as exc:
                        raise _Retryable(_reason(exc)) from None
                    if not block:
                        break
                    f.write(block)
                    digest.update(block)
                    if bar is not None:
                        bar.update(len(block))
                f.flush()
                os.fsync(f.fileno())  # on disk before it is renamed to its final name (a power cut)
        finally:
            if bar is not None:
                bar.close()
    size = partial.stat().st_size
    if total is not None and size != total:
        if size > total:
            partial.unlink()
        raise _Retryable(f"the connection closed after {size} of {total} bytes")
    return digest.hexdigest()


def _parse_content_range(value: str) -> tuple[int, int | None]:
    """``'bytes 100-199/200' -> (100, 200)``; total None for ``*``; start -1 when unparseable."""
    match = re.fullmatch(r"\s*bytes\s+(\d+)-\d+/(\d+|\*)\s*", value)
    if not match:
        return -1, None
    return int(match.group(1)), None if match.group(2) == "*" else int(match.group(2))


def _reason(exc: object) -> str:
    if isinstance(exc, TimeoutError) or "timed out" in str(exc):
        return "timed out"
    if isinstance(exc, http.client.IncompleteRead):
        return f"the connection closed early ({len(exc.partial)} bytes of the last read)"
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text


# ---------------------------------------------------------------------------------------------
# Files


def _quarantine(path: Path, name_like: Path, expected: str, got: str) -> None:
    corrupt = name_like.with_name(name_like.name + ".corrupt")
    os.replace(path, corrupt)
    raise DownloadError(f"sha256 mismatch for {name_like.name}: expected {expected}, got {got}; "
                        f"the file was kept as {corrupt}")


def _gunzip(src: Path, dest: Path, *, progress: bool) -> None:
    partial = dest.with_name(dest.name + ".partial")
    bar = _progress_bar(progress, src.stat().st_size, 0, f"gunzip {src.name}")
    try:
        with open(src, "rb") as raw, gzip.GzipFile(fileobj=raw) as unzipped, open(partial, "wb") as f:
            done = 0
            while block := unzipped.read(BLOCK):
                f.write(block)
                if bar is not None:
                    bar.update(raw.tell() - done)
                    done = raw.tell()
            f.flush()
            os.fsync(f.fileno())  # on disk before it is renamed to its final name (a power cut)
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        partial.unlink(missing_ok=True)
        corrupt = src.with_name(src.name + ".corrupt")
        os.replace(src, corrupt)
        raise DownloadError(f"{src.name} is not a valid gzip file ({exc}); kept as {corrupt}") from None
    finally:
        if bar is not None:
            bar.close()
    os.replace(partial, dest)


def _normalize_sha(value: str) -> str:
    value = value.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise UserError(f"--sha256 must be 64 hexadecimal digits, got {value!r}")
    return value


def _read_checksum_file(path: Path) -> str | None:
    try:
        value = path.read_text().split()[0].lower()
    except (OSError, IndexError):
        return None
    return value if re.fullmatch(r"[0-9a-f]{64}", value) else None


def _hash_into(digest, path: Path) -> None:
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    _hash_into(digest, path)
    return digest.hexdigest()


def _progress_bar(enabled: bool, total: int | None, initial: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)
