"""Encode a text corpus into a flat token file, on all cores, in constant memory.

Output: ``OUT.bin``, the token ids as little-endian ``uint16`` (``uint32`` when the vocabulary
has more than 65,536 entries), and ``OUT.json``, a sidecar::

    {"dtype": "uint16", "vocab_size": 10000, "tokenizer_hash": "...", "num_documents": 2717,
     "num_tokens": 2893342, "source": "/abs/path/valid.txt", "source_bytes": 10702112}

Design decisions:

* **Parallel output is byte-identical to encoding the whole text at once.** The file is cut
  only where tokenization is provably additive: at the start of a document-separator special
  token (``<|endoftext|>`` when the tokenizer has it), because special tokens are split out
  before pretokenization; or, in a file without separators, after a lone ``"\\n"`` that sits
  between two non-whitespace characters, where the GPT-2 pretokenizer always emits ``"\\n"`` as
  its own piece whatever follows (a run of whitespace would not be safe: ``"\\n\\n\\n"`` splits
  as ``"\\n\\n" + "\\n"`` before a letter but whole at the end of a string). A cut never falls
  inside an occurrence of any special token.
* **Streaming.** The parent process only scans small windows to place the cuts; each worker
  reads its own chunk, encodes it and writes ``OUT.bin.parts/part_NNNNNN.bin``; the parent
  appends finished parts in order and deletes them, so memory stays at a few chunks whatever
  the corpus size.
* **Atomic and resumable.** Tokens go to ``OUT.bin.partial``; ``OUT.bin.parts/state.json``
  records the cut plan and how many parts have been appended. An interrupted run resumes from
  there (same input file, size and mtime, same tokenizer); anything else starts over. A run
  stopped by a signal or a dead worker keeps these files for that resume (the error says so);
  a run that fails on input that is not UTF-8 removes them, since the same call would only
  fail again (and ``errors="replace"`` makes a different plan). Only
  after the rename to ``OUT.bin`` is the sidecar written (old sidecars are removed first, and
  put back when the input turns out not to be UTF-8), so a token file with a sidecar is always
  complete, and ``open_tokens`` checks the size against it. Only a token file (`is_token_file`)
  or what an interrupted run left is replaced: any other file at ``OUT.bin`` or ``OUT.json`` is
  a ``UserError``, as is a token file given as the input.
* **UTF-8.** Input must be UTF-8 (``errors="strict"``, the default: a bad byte raises a
  ``UserError`` naming its offset and both spellings of the fix, ``--errors replace`` for the
  command line and ``errors="replace"`` for Python); ``errors="replace"`` encodes invalid bytes
  as U+FFFD instead. An empty input file is a ``UserError``.
  Cuts fall on ASCII bytes, so decoding chunk by chunk equals decoding the whole file.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import regex

from scratchlm.data.token_file import is_token_file, sidecar_path, token_dtype
from scratchlm.errors import UserError
from scratchlm.fileio import check_writable_dir, resolve_path, write_text_atomic
from scratchlm.tokenizer.worker_pool import pool_context, worker_pool

DOCUMENT_SEPARATOR = "<|endoftext|>"
_SCAN_BLOCK = 1 << 20  # bytes read at a time while looking for a safe cut
_STATE_VERSION = 1
_WHITESPACE = regex.compile(r"\s")


class _InvalidInput(UserError):
    """The input is not UTF-8 (errors="strict"): rerunning the same call cannot succeed."""


@dataclass(frozen=True)
class _Plan:
    """Everything a resumed run must share with the interrupted one."""

    source: str
    source_bytes: int
    source_mtime_ns: int
    tokenizer_hash: str
    dtype: str
    errors: str
    bounds: tuple[int, ...]  # cut offsets, first 0 and last source_bytes

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "bounds": list(self.bounds)}


def encode_corpus(
    input_path: str | os.PathLike,
    tokenizer_or_dir: Any,
    out_path: str | os.PathLike,
    *,
    num_workers: int | None = None,
    chunk_bytes: int | None = None,
    errors: str = "strict",
    progress: bool = True,
) -> dict[str, Any]:
    """Encode the UTF-8 text file ``input_path`` to ``out_path`` (.bin) plus its .json sidecar.

    ``tokenizer_or_dir`` is a ``Tokenizer`` or a tokenizer directory. ``num_workers`` defaults
    to the usable CPU count; ``chunk_bytes`` (the target size of one unit of work) defaults to
    a size that gives every worker several chunks. Returns the sidecar dict plus
    ``seconds`` and ``encoded_bytes`` (the work of this call, for throughput figures).

    An interrupted run (Ctrl-C, a killed process, a worker that died) leaves ``OUT.bin.partial``
    and ``OUT.bin.parts/``, and the same call again resumes from them; input that is not UTF-8
    (with ``errors="strict"``) removes them, as rerunning the same call could only fail again.
    """
    if errors not in ("strict", "replace"):
        raise UserError(f"errors must be 'strict' or 'replace', not {errors!r}")
    source = _check_input(Path(input_path))
    named = os.fspath(out_path)
    if named.endswith(("/", os.sep)):  # (Path drops the slash: "data/" would become the file "data")
        raise UserError(f"output path {named} names a directory (give a file name such as "
                        f"{Path(named) / 'train.bin'})")
    files = _OutputFiles.of(_check_output(Path(out_path), source))
    tokenizer, tokenizer_arg = _resolve_tokenizer(tokenizer_or_dir)
    workers = _default_workers() if num_workers is None else int(num_workers)
    if workers < 1:
        raise UserError(f"--workers must be at least 1, not {workers}")
    stat = source.stat()
    if stat.st_size == 0:
        raise UserError(f"input file is empty: {source} (nothing to encode; check the path)")
    if chunk_bytes is None:
        chunk_bytes = min(16 << 20, max(1 << 20, stat.st_size // (4 * workers) + 1))
    if chunk_bytes < 1:
        raise UserError(f"chunk_bytes must be positive, not {chunk_bytes}")

    dtype = token_dtype(int(tokenizer.vocab_size))
    _check_replaceable(files)
    plan, state = _start_or_resume(files, source, stat, tokenizer, dtype, errors, chunk_bytes)
    # A sidecar is the mark of a complete token file: remove the old one before touching tokens
    # (once the resume state exists, so an OUT.bin without either is never one of ours).
    old_sidecar = files.sidecar.read_text(encoding="utf-8") if files.sidecar.is_file() else None
    files.sidecar.unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        encoded_bytes = _encode_parts(plan, state, files, tokenizer, tokenizer_arg, workers, progress)
    except _InvalidInput:
        files.discard()
        if old_sidecar is not None:  # the previous token file was not replaced: it is complete again
            write_text_atomic(files.sidecar, old_sidecar)
        raise
    except BrokenProcessPool:
        raise UserError(f"an encoding worker died (out of memory? try fewer --workers); the chunks "
                        f"finished so far are kept in {files.parts_dir}, and running the same "
                        "command again resumes from them") from None
    elapsed = time.perf_counter() - t0
    meta = _finish(files, plan, state, tokenizer)
    return {**meta, "seconds": elapsed, "encoded_bytes": encoded_bytes}


@dataclass(frozen=True)
class _OutputFiles:
    """The token file and what is written on the way to it."""

    out: Path  # OUT.bin, only ever replaced by a complete file
    partial: Path  # OUT.bin.partial, the parts appended so far
    parts_dir: Path  # OUT.bin.parts/: finished parts not yet appended, and state.json
    sidecar: Path  # OUT.json, written last

    @classmethod
    def of(cls, out: Path) -> _OutputFiles:
        return cls(out, out.with_name(out.name + ".partial"), out.with_name(out.name + ".parts"),
                   sidecar_path(out))

    def discard(self) -> None:
        """Remove the resume state and the partial token file."""
        shutil.rmtree(self.parts_dir, ignore_errors=True)
        self.partial.unlink(missing_ok=True)


def _start_or_resume(files: _OutputFiles, source: Path, stat: os.stat_result, tokenizer: Any,
                     dtype: np.dtype, errors: str, chunk_bytes: int) -> tuple[_Plan, dict[str, Any]]:
    """The cut plan and append state: an interrupted run's if it can resume, else a fresh one."""
    plan = _load_resumable_plan(files.parts_dir, files.partial, source, stat, str(tokenizer.hash), dtype, errors)
    if plan is not None:
        state = json.loads((files.parts_dir / "state.json").read_text())
        with open(files.partial, "r+b") as f:  # drop bytes appended after the last recorded state
            f.truncate(state["offset"])
        return plan, state
    files.discard()
    separator, special = _document_separator(tokenizer)
    bounds = _find_bounds(source, stat.st_size, chunk_bytes, separator, special)
    plan = _Plan(str(source), stat.st_size, stat.st_mtime_ns, str(tokenizer.hash), dtype.name,
                 errors, tuple(bounds))
    files.parts_dir.mkdir(parents=True)
    state = {"version": _STATE_VERSION, "plan": plan.to_json(), "appended": 0,
             "offset": 0, "num_tokens": 0, "num_documents": 0, "last_in_document": False}
    _write_json(files.parts_dir / "state.json", state)
    return plan, state


def _document_separator(tokenizer: Any) -> tuple[str | None, list[str]]:
    """The special token that separates documents (``<|endoftext|>`` if the tokenizer has it,
    else its first special token, or None), and all its special tokens."""
    special = _special_tokens(tokenizer)
    separator = DOCUMENT_SEPARATOR if DOCUMENT_SEPARATOR in special else (special[0] if special else None)
    return separator, special


def _encode_parts(plan: _Plan, state: dict[str, Any], files: _OutputFiles, tokenizer: Any,
                  tokenizer_arg: Any, workers: int, progress: bool) -> int:
    """Encode the chunks not done yet and append all parts, in order, to the partial file.

    Returns the number of source bytes encoded by this call.
    """
    dtype = np.dtype(plan.dtype)
    num_chunks = len(plan.bounds) - 1
    todo = [i for i in range(state["appended"], num_chunks) if not _part_done(files.parts_dir, i, dtype)]
    jobs = [(i, plan.bounds[i], plan.bounds[i + 1]) for i in todo]
    encoded = sum(end - start for _, start, end in jobs)
    separator, _ = _document_separator(tokenizer)
    separator_id = _special_id(tokenizer, separator) if separator is not None else None

    workers = min(workers, max(1, len(jobs)))
    context = pool_context()  # before the progress bar, whose monitor thread rules out fork
    bar = _progress_bar(plan.source_bytes, plan.source_bytes - encoded, progress, files.out.name)
    try:
        finished = _run_jobs(jobs, plan.source, str(files.parts_dir), plan.errors, dtype.str, separator_id,
                             int(tokenizer.vocab_size), tokenizer, tokenizer_arg, workers, context)
        with open(files.partial, "ab") as sink, closing(finished):
            # parts finish in any order; append them in file order as soon as the next is ready
            ready = set(range(state["appended"], num_chunks)) - set(todo)
            for index in finished:
                ready.add(index)
                if bar is not None:
                    bar.update(plan.bounds[index + 1] - plan.bounds[index])
                _append_ready(sink, files.parts_dir, state, ready)
            _append_ready(sink, files.parts_dir, state, ready)  # parts found complete on disk when resuming
            os.fsync(sink.fileno())
    finally:
        if bar is not None:
            bar.close()
    if state["appended"] != num_chunks:
        raise RuntimeError(f"encoded {state['appended']} of {num_chunks} chunks")  # a bug, not user input
    return encoded


def _append_ready(sink, parts_dir: Path, state: dict[str, Any], ready: set[int]) -> None:
    """Append the parts that are next in file order and finished, recording each in state.json."""
    while state["appended"] in ready:
        _append_part(sink, parts_dir, state)
        _write_json(parts_dir / "state.json", state)


def _finish(files: _OutputFiles, plan: _Plan, state: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Rename the partial file into place, then write its sidecar; the sidecar's fields."""
    os.replace(files.partial, files.out)
    meta = {
        "dtype": plan.dtype,
        "vocab_size": int(tokenizer.vocab_size),
        "tokenizer_hash": str(tokenizer.hash),
        "num_documents": int(state["num_documents"]),
        "num_tokens": int(state["num_tokens"]),
        "source": plan.source,
        "source_bytes": plan.source_bytes,
    }
    _write_json(files.sidecar, meta)
    shutil.rmtree(files.parts_dir, ignore_errors=True)
    return meta


# ---------------------------------------------------------------------------------------------
# Checks


def _check_input(path: Path) -> Path:
    if not path.exists():
        raise UserError(f"input file not found: {path}")
    if path.is_dir():
        raise UserError(f"input is a directory, not a text file: {path}")
    if is_token_file(path):
        raise UserError(f"input is a token file (written by `scratchlm encode`), not a text file: {path}")
    return path.resolve()


def _check_output(path: Path, source: Path) -> Path:
    if path.is_dir():
        raise UserError(f"output path is a directory: {path} (give a file name such as {path / 'train.bin'})")
    if path.suffix == ".json":
        raise UserError(f"output path {path} ends in .json, the name reserved for its sidecar")
    resolved = resolve_path(path, f"output {path}")
    sidecar = resolve_path(sidecar_path(path), f"output {path}")
    if source in (resolved, sidecar):
        raise UserError(f"output {path} would overwrite the input")
    # A file in the way, or a folder that takes no file; a missing folder is made with the parts folder.
    check_writable_dir(path.parent, f"output {path}")
    return resolved


def _check_replaceable(files: _OutputFiles) -> None:
    """Refuse to replace anything but a token file and its sidecar, or what an interrupted run left."""
    if is_token_file(files.out) or files.partial.exists() or files.parts_dir.exists():
        return
    for path in (files.out, files.sidecar):
        if path.exists():
            raise UserError(f"{path} exists and is not a token file or its sidecar (written by `scratchlm "
                            f"encode`); encoding to {files.out} would replace it: remove it or choose "
                            "another output path")


def _resolve_tokenizer(tokenizer_or_dir: Any) -> tuple[Any, Any]:
    """The tokenizer object, and what workers receive to rebuild it (a directory or the object)."""
    if isinstance(tokenizer_or_dir, (str, os.PathLike)):
        directory = Path(tokenizer_or_dir)
        if not directory.is_dir():
            raise UserError(f"tokenizer directory not found: {directory}" if not directory.exists()
                            else f"tokenizer is not a directory: {directory} (expected a tokenizer directory)")
        return _load_tokenizer(str(directory)), str(directory)
    for attr in ("encode", "vocab_size", "hash"):
        if not hasattr(tokenizer_or_dir, attr):
            raise UserError(f"expected a Tokenizer or a tokenizer directory, got {type(tokenizer_or_dir).__name__}")
    return tokenizer_or_dir, tokenizer_or_dir


def _load_tokenizer(directory: str) -> Any:
    from scratchlm.tokenizer.tokenizer import Tokenizer

    return Tokenizer.load(directory)


def _special_tokens(tokenizer: Any) -> list[str]:
    tokens = getattr(tokenizer, "special_tokens", None) or []
    if isinstance(tokens, dict):
        tokens = list(tokens)
    return [str(t) for t in tokens]


def _special_id(tokenizer: Any, token: str) -> int:
    ids = tokenizer.encode(token)
    if len(ids) != 1:
        raise RuntimeError(f"special token {token!r} encodes to {ids}, not one id")
    return int(ids[0])


def _default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------
# Cut plan


def _find_bounds(path: Path, size: int, chunk_bytes: int, separator: str | None,
                 special: list[str]) -> list[int]:
    """Cut offsets ``[0, ..., size]``, each the first safe cut at or after a multiple of chunk_bytes."""
    sep = separator.encode("utf-8") if separator else None
    specials = [s.encode("utf-8") for s in special]
    bounds = [0]
    with open(path, "rb") as f:
        target = chunk_bytes
        while target < size:
            cut = _next_safe_cut(f, max(target, bounds[-1] + 1), size, sep, specials)
            if cut is None:
                break
            bounds.append(cut)
            target = cut + chunk_bytes
    bounds.append(size)
    return bounds


def _next_safe_cut(f, start: int, size: int, sep: bytes | None, specials: list[bytes]) -> int | None:
    """The first offset >= start where the text may be cut without changing its tokens."""
    margin = max([len(s) for s in specials] + [4]) + 4
    pos = start
    while pos < size:
        lo = max(0, pos - margin)
        f.seek(lo)
        window = f.read(_SCAN_BLOCK + 2 * margin)
        for cut in _candidate_cuts(window, lo, pos, min(pos + _SCAN_BLOCK, size), sep):
            if _is_safe(window, cut - lo, sep, specials):
                return cut
        pos += _SCAN_BLOCK
    return None


def _candidate_cuts(window: bytes, lo: int, begin: int, end: int, sep: bytes | None) -> Iterator[int]:
    """Offsets in [begin, end), ascending, of separator starts and of bytes right after a newline."""
    b, e = begin - lo, end - lo
    k = b
    while k < e:
        j = window.find(b"\n", max(k - 1, 0), e - 1)
        after_newline = j + 1 if j >= 0 else e
        at_sep = window.find(sep, k, e) if sep else -1
        cut = min(after_newline, at_sep if at_sep >= 0 else e)
        if cut >= e:
            return
        yield lo + cut
        k = cut + 1


def _is_safe(window: bytes, k: int, sep: bytes | None, specials: list[bytes]) -> bool:
    """Whether cutting ``window`` before byte k leaves the encoding unchanged (see module doc)."""
    for s in specials:
        # any occurrence found in this range starts before k and ends after it
        if window.find(s, max(0, k - len(s) + 1), k + len(s) - 1) != -1:
            return False
    if sep and window.startswith(sep, k):
        return True
    if k < 2 or k >= len(window) or window[k - 1] != 0x0A:
        return False
    after = _char_at(window, k)
    before = _char_ending_at(window, k - 1)
    return (after is not None and before is not None and not _WHITESPACE.match(after)
            and not _WHITESPACE.match(before))


def _char_at(buf: bytes, k: int) -> str | None:
    return buf[k:k + 4].decode("utf-8", errors="ignore")[:1] or None


def _char_ending_at(buf: bytes, end: int) -> str | None:
    start = end - 1
    while start > 0 and end - start < 4 and 0x80 <= buf[start] < 0xC0:  # UTF-8 continuation bytes
        start -= 1
    text = buf[start:end].decode("utf-8", errors="ignore")
    return text[-1:] or None


# ---------------------------------------------------------------------------------------------
# Workers


_worker_tokenizer: Any = None


def _init_worker(tokenizer_arg: Any) -> None:
    global _worker_tokenizer
    _worker_tokenizer = _load_tokenizer(tokenizer_arg) if isinstance(tokenizer_arg, str) else tokenizer_arg


def _encode_chunk(job: tuple[int, int, int], source: str, parts_dir: str, errors: str, dtype: str,
                  separator_id: int | None, vocab_size: int, tokenizer: Any = None) -> int:
    """Encode bytes [start, end) of the source into part file ``index``; returns the index."""
    index, start, end = job
    tokenizer = tokenizer if tokenizer is not None else _worker_tokenizer
    with open(source, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    try:
        text = data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise _InvalidInput(f"{source} is not valid UTF-8: byte 0x{data[exc.start]:02x} at offset "
                            f"{start + exc.start} (to encode bad bytes as U+FFFD instead, pass --errors "
                            "replace on the command line, errors='replace' from Python)") from None
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise RuntimeError(f"tokenizer produced an id outside [0, {vocab_size})")
    tokens = ids.astype(dtype)
    stats = _document_stats(ids, separator_id)
    part = Path(parts_dir) / f"part_{index:06d}.bin"
    tmp = part.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(tokens.tobytes())
    os.replace(tmp, part)
    _write_json(part.with_suffix(".json"), {"num_tokens": int(tokens.size), **stats})
    return index


def _document_stats(ids: np.ndarray, separator_id: int | None) -> dict[str, Any]:
    """Runs of non-separator tokens in a chunk, and whether the chunk starts/ends inside one.

    ``[5, 6, SEP, 7] -> {"runs": 2, "first_in_document": True, "last_in_document": True}``;
    the counts of consecutive chunks add up, minus one where a document spans the cut.
    """
    if ids.size == 0:
        return {"runs": 0, "first_in_document": False, "last_in_document": False}
    inside = np.ones(ids.size, dtype=bool) if separator_id is None else ids != separator_id
    starts = inside.copy()
    starts[1:] &= ~inside[:-1]
    return {"runs": int(starts.sum()), "first_in_document": bool(inside[0]),
            "last_in_document": bool(inside[-1])}


def _run_jobs(jobs: list[tuple[int, int, int]], source: str, parts_dir: str, errors: str, dtype: str,
              separator_id: int | None, vocab_size: int, tokenizer: Any, tokenizer_arg: Any,
              workers: int, context: multiprocessing.context.BaseContext) -> Iterator[int]:
    """Yield the index of each finished chunk, in completion order."""
    common = (source, parts_dir, errors, dtype, separator_id, vocab_size)
    if workers <= 1:
        for job in jobs:
            yield _encode_chunk(job, *common, tokenizer=tokenizer)
        return
    # An executor rather than a Pool: a worker that dies raises BrokenProcessPool instead of hanging.
    # A forked worker inherits the loaded tokenizer; a spawned one reloads it from its directory.
    shared = tokenizer if context.get_start_method() == "fork" else tokenizer_arg
    with worker_pool(workers, context, initializer=_init_worker, initargs=(shared,)) as pool:
        futures = [pool.submit(_encode_chunk, job, *common) for job in jobs]
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


# ---------------------------------------------------------------------------------------------
# Parts, state and resume


def _part_done(parts_dir: Path, index: int, dtype: np.dtype) -> bool:
    part = parts_dir / f"part_{index:06d}.bin"
    meta = part.with_suffix(".json")
    if not (part.is_file() and meta.is_file()):
        return False
    try:
        num_tokens = json.loads(meta.read_text())["num_tokens"]
    except (ValueError, KeyError):
        return False
    return part.stat().st_size == num_tokens * dtype.itemsize


def _append_part(sink, parts_dir: Path, state: dict[str, Any]) -> None:
    index = state["appended"]
    part = parts_dir / f"part_{index:06d}.bin"
    meta = json.loads(part.with_suffix(".json").read_text())
    with open(part, "rb") as f:
        shutil.copyfileobj(f, sink, 1 << 20)
    # no fsync per part: a resume checks that the partial file is at least ``offset`` long
    sink.flush()
    state["offset"] = sink.tell()
    state["num_tokens"] += meta["num_tokens"]
    runs = meta["runs"] - (1 if state["last_in_document"] and meta["first_in_document"] else 0)
    state["num_documents"] += runs
    if meta["num_tokens"]:
        state["last_in_document"] = meta["last_in_document"]
    state["appended"] = index + 1
    part.unlink()
    part.with_suffix(".json").unlink()


def _load_resumable_plan(parts_dir: Path, partial: Path, source: Path, stat: os.stat_result,
                         tokenizer_hash: str, dtype: np.dtype, errors: str) -> _Plan | None:
    """The plan of an interrupted run over the same input and tokenizer, or None."""
    try:
        state = json.loads((parts_dir / "state.json").read_text())
        p = state["plan"]
        plan = _Plan(p["source"], p["source_bytes"], p["source_mtime_ns"], p["tokenizer_hash"],
                     p["dtype"], p["errors"], tuple(p["bounds"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    same = (state.get("version") == _STATE_VERSION and plan.source == str(source)
            and plan.source_bytes == stat.st_size and plan.source_mtime_ns == stat.st_mtime_ns
            and plan.tokenizer_hash == tokenizer_hash and plan.dtype == dtype.name
            and plan.errors == errors and partial.is_file()
            and partial.stat().st_size >= state["offset"])
    return plan if same else None


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def _progress_bar(total: int, initial: int, enabled: bool, name: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"encode {name}", smoothing=0.1)
