"""Byte-level BPE training.

Id layout of the vocabulary ``train_bpe`` returns: ids 0..255 are the single bytes (id == byte
value), ids 256.. the merges in the order they were learned, and the special tokens come last,
in the order given (GPT-2 puts ``<|endoftext|>`` last too). So ``vocab_size`` = 256 + number of
merges + number of special tokens; if the corpus runs out of pairs to merge first, training
stops early and the vocabulary is smaller.

Two phases:

1. Pretoken counting (``pretokenize``): the file is cut into byte ranges at special tokens,
   each range is read and counted by a worker process on its own, block by block, so memory is
   bounded by the number of distinct units/pretokens, not by the size of the file. Small files
   skip the pool.
2. The merge loop keeps pair -> count and pair -> words containing it (a superset: stale
   entries cost one wasted ``str.replace``) and updates both only around the new tokens of the
   words a merge touches. A word is a string of ``chr(token id)``, so merging is
   ``str.replace`` and finding the new tokens ``str.find``, both in C. The best pair comes from
   a heap with lazy invalidation: an entry whose count went stale is re-pushed with its current
   count when it reaches the top. Counts of existing pairs only ever fall (a merge creates
   pairs only with the new token), so the top entry, once fresh, is the true maximum.

Ties between equally frequent pairs go to the lexicographically greater pair of byte strings,
``max(pairs, key=lambda p: (count[p], vocab[p[0]], vocab[p[1]]))``. The heap is a min-heap,
so each token carries an order-reversing key: its bytes as latin-1 characters mapped
x -> 255 - x, then a terminator above every mapped byte (so a prefix sorts after its
extensions, as the reversal of "prefix sorts first" requires).
"""

from __future__ import annotations

import heapq
import os
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

from scratchlm.errors import UserError
from scratchlm.tokenizer.pretokenize import count_pretokens_in_range, find_chunk_boundaries
from scratchlm.tokenizer.worker_pool import pool_context, worker_pool

# Below this size the worker pool costs more than it saves.
SMALL_CORPUS_BYTES = 4 << 20
# Ranges per worker: more than one evens out uneven ranges and lets the progress bar move.
CHUNKS_PER_WORKER = 4
MAX_CHUNK_BYTES = 64 << 20

_REVERSE = {byte: 255 - byte for byte in range(256)}
_TERMINATOR = "\u0100"


def _reverse_key(token: bytes) -> str:
    return token.decode("latin-1").translate(_REVERSE) + _TERMINATOR


def default_workers() -> int:
    """Number of CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def train_bpe(
    input_path: str | os.PathLike,
    vocab_size: int,
    special_tokens: Sequence[str] = (),
    *,
    workers: int | None = None,
    progress: bool = False,
    timings: dict[str, float] | None = None,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE tokenizer on a UTF-8 text file.

    Returns (vocab, merges): vocab maps id -> token bytes (layout in the module docstring),
    merges lists the learned (left, right) pairs in order. ``workers`` processes count
    pretokens (default: all cores; 1 or a small file runs in this process); ``progress`` shows
    tqdm bars on stderr; ``timings``, if given, receives ``pretokenize_s``, ``merge_s`` and
    ``workers`` (processes actually used).

    Raises UserError for a missing or unreadable file, a file that is not UTF-8 (naming the
    byte offset), a corpus with no text outside special tokens, or ``vocab_size`` smaller than
    256 + the number of special tokens.
    """
    path = Path(input_path)
    specials = list(dict.fromkeys(special_tokens))
    if any(not isinstance(t, str) or not t for t in specials):
        raise UserError("special tokens must be non-empty strings")
    for token in specials:
        try:
            token.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: bytes on the command line that are not UTF-8
            raise UserError(f"special token {token!r} is not valid UTF-8 text") from None
    if vocab_size < 256 + len(specials):
        raise UserError(
            f"vocab_size {vocab_size} is too small: it must be at least 256 (bytes) + "
            f"{len(specials)} (special tokens) = {256 + len(specials)}"
        )
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if path.is_dir():
        raise UserError(f"{path}: is a directory, expected a text file")
    if not os.access(path, os.R_OK):
        raise UserError(f"{path}: permission denied")

    t0 = time.perf_counter()
    used: list[int] = []
    counts = count_pretokens(path, specials, workers=workers, progress=progress, used_workers=used)
    if not counts:
        raise UserError(f"{path}: the corpus is empty (no text outside special tokens)")
    t1 = time.perf_counter()
    num_merges = vocab_size - 256 - len(specials)
    merges = merge_pretokens(counts, num_merges, progress=progress)
    t2 = time.perf_counter()
    if timings is not None:
        timings["pretokenize_s"] = t1 - t0
        timings["merge_s"] = t2 - t1
        timings["workers"] = used[0]

    vocab = {i: bytes([i]) for i in range(256)}
    for left, right in merges:
        vocab[len(vocab)] = left + right
    for token in specials:
        vocab[len(vocab)] = token.encode("utf-8")
    return vocab, merges


def count_pretokens(path: str | os.PathLike, special_tokens: Sequence[str], *,
                    workers: int | None = None, progress: bool = False,
                    used_workers: list[int] | None = None) -> Counter[str]:
    """Pretoken counts of a whole file, in parallel over byte ranges cut at special tokens.

    ``used_workers``, if given, receives the number of processes that counted.
    """
    path = Path(path)
    size = path.stat().st_size
    workers = default_workers() if workers is None else max(1, int(workers))
    used = used_workers if used_workers is not None else []
    if workers == 1 or size < SMALL_CORPUS_BYTES:
        used.append(1)
        return count_pretokens_in_range(path, 0, size, special_tokens)

    num_chunks = max(workers * CHUNKS_PER_WORKER, -(-size // MAX_CHUNK_BYTES))
    bounds = find_chunk_boundaries(path, num_chunks, special_tokens)
    ranges = list(zip(bounds[:-1], bounds[1:]))
    total: Counter[str] = Counter()
    used.append(min(workers, len(ranges)))
    with worker_pool(used[-1], pool_context()) as pool:
        # The bar comes after the pool: tqdm starts a monitor thread, and fork wants none.
        bar = _progress_bar(progress, total=len(ranges), desc="pretokenize", unit="chunk")
        futures = [pool.submit(count_pretokens_in_range, path, a, b, list(special_tokens)) for a, b in ranges]
        for future in futures:
            total.update(future.result())
            bar.update(1)
    bar.close()
    return total


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(enabled: bool, **kwargs):
    if not enabled:
        return _NoBar()  # a disabled tqdm still starts its monitor thread
    from tqdm import tqdm

    return tqdm(leave=True, dynamic_ncols=True, **kwargs)


def merge_pretokens(counts: dict[str, int] | dict[bytes, int], num_merges: int, *,
                    progress: bool = False) -> list[tuple[bytes, bytes]]:
    """Learn up to num_merges merges from pretoken counts (str keys are UTF-8 encoded)."""
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    rkeys: list[str] = [_reverse_key(t) for t in vocab]
    words, freqs = _words_of(counts)
    pair_words, pair_counts = _index_pairs(words, freqs)
    heap = [(-n, rkeys[ord(p[0])], rkeys[ord(p[1])], p) for p, n in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[bytes, bytes]] = []
    bar = _progress_bar(progress, total=num_merges, desc="merges", unit="merge")
    while len(merges) < num_merges:
        best = _pop_best(heap, pair_counts)
        if best is None:
            break  # nothing left to merge
        a, b = ord(best[0]), ord(best[1])
        new = len(vocab)
        vocab.append(vocab[a] + vocab[b])
        rkeys.append(_reverse_key(vocab[new]))
        merges.append((vocab[a], vocab[b]))
        fresh = _apply_merge(best, chr(new), words, freqs, pair_words, pair_counts)
        for pair, n in fresh.items():
            heapq.heappush(heap, (-n, rkeys[ord(pair[0])], rkeys[ord(pair[1])], pair))
        if len(merges) % 64 == 0:
            bar.update(64)
    bar.update(len(merges) % 64)
    bar.close()
    return merges


def _words_of(counts: dict[str, int] | dict[bytes, int]) -> tuple[list[str], list[int]]:
    """The pretokens as words (one character per token, chr(id)) with their counts.

    A word is a str with one character per token, chr(token id): merging a pair in a word is
    then str.replace, which replaces non-overlapping occurrences left to right exactly as BPE
    does, and finding the new token is str.find, both in C. Pairs are 2-character strings.
    Latin-1 decoding maps each byte to the character of its id. Single bytes, which have no
    pair to merge, are left out.
    """
    words: list[str] = []
    freqs: list[int] = []
    for pretoken, n in counts.items():
        data = pretoken.encode("utf-8") if isinstance(pretoken, str) else pretoken
        if len(data) > 1:
            words.append(data.decode("latin-1"))
            freqs.append(n)
    return words, freqs


def _index_pairs(words: list[str], freqs: list[int]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """pair -> indices of the words holding it, and pair -> count (weighted by word counts).

    The word lists are a superset (a word may be listed twice or have lost the pair since),
    which costs a wasted str.replace at most and saves keeping the index exact.
    """
    pair_words: dict[str, list[int]] = {}
    for wi, word in enumerate(words):
        for k in range(len(word) - 1):
            pair = word[k:k + 2]
            where = pair_words.get(pair)
            if where is None:
                pair_words[pair] = [wi]
            else:
                where.append(wi)
    # A pair listed twice for a word occurs twice in it, so summing over the list counts right.
    pair_counts = {p: sum(map(freqs.__getitem__, where)) for p, where in pair_words.items()}
    return pair_words, pair_counts


def _apply_merge(best: str, N: str, words: list[str], freqs: list[int],
                 pair_words: dict[str, list[int]], pair_counts: dict[str, int]) -> dict[str, int]:
    """Merge the pair ``best`` into the new token N in every word holding it, updating the pair
    index and counts; returns the counts of the pairs with N, which did not exist before."""
    A, B = best[0], best[1]
    fresh: defaultdict[str, int] = defaultdict(int)
    fresh_words: defaultdict[str, list[int]] = defaultdict(list)
    for wi in pair_words.pop(best):
        word = words[wi]
        merged = word.replace(best, N)
        if len(merged) == len(word):
            continue  # listed twice, or lost the pair to an earlier merge
        words[wi] = merged
        n = freqs[wi]
        last = len(merged) - 1
        # Around each new token only the neighbouring pairs changed:
        # (left, a) -> (left, new) and (b, right) -> (new, right).
        j = merged.find(N)
        while j != -1:
            if j > 0:
                left = merged[j - 1]
                if left == N:
                    # Two occurrences side by side: the old pair between them was (b, a);
                    # (new, new) is counted as the right pair of the first one.
                    pair_counts[B + A] -= n
                else:
                    pair_counts[left + A] -= n
                    pair = left + N
                    fresh[pair] += n
                    fresh_words[pair].append(wi)
            if j < last:
                right = merged[j + 1]
                if right != N:
                    pair_counts[B + right] -= n
                pair = N + right
                fresh[pair] += n
                fresh_words[pair].append(wi)
            j = merged.find(N, j + 1)
    del pair_counts[best]
    pair_counts.update(fresh)
    pair_words.update(fresh_words)
    return fresh


def _pop_best(heap: list, pair_counts: dict[str, int]) -> str | None:
    """The most frequent pair (ties: greatest bytes), discarding or refreshing stale entries."""
    while heap:
        neg, ka, kb, pair = heap[0]
        current = pair_counts.get(pair, 0)
        if current == -neg:
            if current <= 0:
                heapq.heappop(heap)
                continue
            return pair
        if current > 0:
            heapq.heapreplace(heap, (-current, ka, kb, pair))
        else:
            heapq.heappop(heap)
    return None
