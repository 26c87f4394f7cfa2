"""BPE merges applied to many pretokens at once, with numpy.

Encoding text meets each distinct pretoken once; with a cold cache that is tens of thousands of
short words, and a Python merge loop per word costs microseconds per step. Here all the words
go through the merge loop together, one *round* at a time, as flat arrays:

1. the rank of every adjacent pair (a hash table of the merge keys ``left * K + right``), once;
2. each word's lowest rank (``minimum.reduceat``); a word with no mergeable pair is finished
   and leaves the arrays, so later rounds only see the words still merging;
3. in each remaining word, every occurrence of its lowest-ranked pair is merged, left to right
   and without overlap (``a a a`` -> ``aa a``), and only the ranks of the pairs next to a new
   token are looked up again.

Step 3 merges all occurrences of the best pair in one round, while tiktoken merges the leftmost
one and looks again. The two agree when no merge creates a pair ranked below itself: then the
pairs next to a new token rank after the merge that made it, and the next best pair is the
same pair again, further right. Vocabularies learned by BPE have this property (a token is used
only by merges learned after it was made); ``BulkMerger.exact_for`` checks it, and the
tokenizer keeps its per-word loop for merge lists without it.

>>> m = BulkMerger([(97, 98), (256, 99)], [256, 257], list(range(256)))  # ab, then abc
>>> [[ord(c) for c in w] for w in m.merge([b"abcab", b"cab"])]
[[257, 256], [99, 256]]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

_NONE = np.iinfo(np.int32).max  # rank of a pair that is not merged
_UTF32 = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"  # native uint32 as text


class BulkMerger:
    """Merge pairs in rank order (``pairs[r]`` of ids becomes ``merged[r]``) over many words.

    ``byte_ids[b]`` is the id of the single byte b.
    """

    def __init__(self, pairs: Sequence[tuple[int, int]] | np.ndarray, merged: Sequence[int] | np.ndarray,
                 byte_ids: Sequence[int]) -> None:
        pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
        merged = np.asarray(merged, np.int64)
        self._base = int(max(pairs.max(initial=0), merged.max(initial=0), max(byte_ids))) + 1
        self._table = PairTable(pairs[:, 0] * self._base + pairs[:, 1], np.arange(len(pairs), dtype=np.int32),
                                _NONE)
        self._merged_by_rank = merged.astype(np.int32)
        self._byte_ids = np.asarray(byte_ids, np.int32)

    @staticmethod
    def exact_for(pairs: Sequence[tuple[int, int]] | np.ndarray, merged: Sequence[int] | np.ndarray) -> bool:
        """Whether every merge that uses a token ranks after every merge that makes it."""
        pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
        merged = np.asarray(merged, np.int64)
        if not len(merged):
            return True
        made_last = np.full(int(max(pairs.max(), merged.max())) + 1, -1, np.int64)
        np.maximum.at(made_last, merged, np.arange(len(merged)))
        rank = np.arange(len(pairs))
        return bool((made_last[pairs[:, 0]] < rank).all() and (made_last[pairs[:, 1]] < rank).all())

    def merge(self, words: Sequence[bytes]) -> list[str]:
        """The merged tokens of each word (a pretoken's bytes), as a string of chr(id) per token."""
        lengths = np.fromiter(map(len, words), np.int64, len(words))
        return self._merge(np.frombuffer(b"".join(words), np.uint8), lengths)

    def merge_text(self, words: Sequence[str]) -> list[str]:
        """``merge`` of the UTF-8 bytes of each word, encoded all at once."""
        n = len(words)
        data = "".join(words).encode("utf-8")
        lengths = np.fromiter(map(len, words), np.int64, n)
        if len(data) == int(lengths.sum()):  # all ASCII: a character is a byte
            return self._merge(np.frombuffer(data, np.uint8), lengths)
        # Byte lengths from the positions of NUL separators, where no word holds a NUL.
        data = np.frombuffer("\x00".join(words).encode("utf-8"), np.uint8)
        nul = np.flatnonzero(data == 0)
        if len(nul) != n - 1:
            lengths = np.fromiter((len(w.encode("utf-8")) for w in words), np.int64, n)
            return self._merge(np.frombuffer(b"".join(w.encode("utf-8") for w in words), np.uint8), lengths)
        lengths = np.diff(nul, prepend=-1, append=len(data)) - 1
        return self._merge(np.delete(data, nul), lengths)

    def _merge(self, data: np.ndarray, lengths: np.ndarray) -> list[str]:
        """The merge loop over words given as their concatenated bytes and their lengths."""
        if not len(lengths):
            return []
        tokens = self._byte_ids[data]
        starts = np.cumsum(lengths) - lengths
        ranks = self._pair_ranks(tokens, starts + lengths - 1)
        active = np.arange(len(lengths))
        done_words, done_lengths, done_tokens = [], [], []
        while True:
            best = np.minimum.reduceat(ranks, starts)
            finished = best == _NONE
            count = int(np.count_nonzero(finished))
            if count * 8 >= len(best):
                # Enough words are done to be worth taking out of the arrays.
                at_finished = np.repeat(finished, lengths)
                done_words.append(active[finished])
                done_lengths.append(lengths[finished])
                done_tokens.append(tokens[at_finished])
                if count == len(best):
                    break
                keep = ~finished
                active, lengths, best = active[keep], lengths[keep], best[keep]
                at_active = ~at_finished
                tokens, ranks = tokens[at_active], ranks[at_active]
                starts = np.cumsum(lengths) - lengths
            elif count:
                best[finished] = -1  # matches no rank: done words stay as they are
            hits = np.flatnonzero(ranks == np.repeat(best, lengths))
            hits = _without_overlaps(hits)
            tokens[hits] = self._merged_by_rank[ranks[hits]]
            keep = np.ones(len(tokens), bool)
            keep[hits + 1] = False
            lengths = lengths - np.bincount(np.searchsorted(starts, hits, "right") - 1, minlength=len(lengths))
            tokens, ranks = tokens[keep], ranks[keep]
            starts = np.cumsum(lengths) - lengths
            # Only the pairs on either side of a new token change. Hits are at least two apart,
            # so the k-th hit moves k places left when the tokens after hits are dropped.
            new = hits - np.arange(len(hits))
            changed = np.concatenate((new[new > 0] - 1, new))
            changed = changed[changed < len(tokens) - 1]
            keys = tokens[changed].astype(np.int64)
            keys *= self._base
            keys += tokens[changed + 1]
            ranks[changed] = self._rank_of_keys(keys)
            ranks[starts + lengths - 1] = _NONE  # a word's last token starts no pair
        return self._strings(np.concatenate(done_words), np.concatenate(done_lengths),
                             np.concatenate(done_tokens))

    def merge_rounds(self, tokens: np.ndarray, min_fraction: float) -> tuple[np.ndarray, bool]:
        """Merge rounds over one long word (token ids), while each round merges enough.

        A round merges every occurrence of the word's lowest-ranked pair, as ``_merge`` does.
        Rounds go on while a round merges at least ``min_fraction`` of the word's tokens, so
        their total cost stays linear in the word's length; returns the tokens reached and
        whether no mergeable pair is left. Long runs of one character (whitespace, say) halve
        in a few rounds here, where a merge at a time costs a heap operation each.
        """
        tokens = tokens.astype(np.int32)
        while len(tokens) > 1:
            ranks = self._word_pair_ranks(tokens)
            best = ranks.min()
            if best == _NONE:
                return tokens, True
            hits = _without_overlaps(np.flatnonzero(ranks == best))
            tokens[hits] = self._merged_by_rank[best]
            tokens = np.delete(tokens, hits + 1)
            if len(hits) < min_fraction * (len(tokens) + len(hits)):
                return tokens, False
        return tokens, True

    def pair_ranks(self, tokens: np.ndarray) -> np.ndarray:
        """The rank of each adjacent pair of one word's tokens, -1 where the pair is not merged."""
        ranks = self._word_pair_ranks(tokens)
        ranks[ranks == _NONE] = -1
        return ranks

    def _word_pair_ranks(self, tokens: np.ndarray) -> np.ndarray:
        keys = tokens[:-1].astype(np.int64)
        keys *= self._base
        keys += tokens[1:]
        return self._rank_of_keys(keys)

    def _strings(self, words: np.ndarray, lengths: np.ndarray, tokens: np.ndarray) -> list[str]:
        """Token strings in word order, from words finished in any order (``words[i]`` has
        ``lengths[i]`` tokens, concatenated in ``tokens``)."""
        n = len(words)
        sep = self._base  # an id no token has: each word is followed by it, then split on it
        if sep > 0x10FFFF:
            sep = None
        size = np.empty(n, np.int64)
        size[words] = lengths + (sep is not None)
        out_start = np.cumsum(size) - size
        src_start = np.cumsum(lengths) - lengths
        flat = np.full(int(size.sum()), 0 if sep is None else sep, np.uint32)
        flat[np.repeat(out_start[words] - src_start, lengths) + np.arange(len(tokens))] = tokens
        text = flat.tobytes().decode(_UTF32, "surrogatepass")
        if sep is not None:
            return text.split(chr(sep))[:n]
        return [text[a:b] for a, b in zip(out_start.tolist(), (out_start + size).tolist())]

    def _pair_ranks(self, tokens: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """ranks[k]: the rank of the pair (tokens[k], tokens[k + 1]), _NONE at the last token of a word."""
        ranks = np.empty(len(tokens), np.int32)
        keys = tokens[:-1].astype(np.int64)
        keys *= self._base
        keys += tokens[1:]
        ranks[:-1] = self._rank_of_keys(keys)
        ranks[ends] = _NONE
        return ranks

    def _rank_of_keys(self, keys: np.ndarray) -> np.ndarray:
        return self._table.values_of(keys)


class PairTable:
    """An open-addressing hash table (linear probing) of distinct non-negative int64 keys, with
    a value for each, looked up many keys at a time; an eighth full at most, so most
    lookups take one probe."""

    _MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing

    def __init__(self, keys: np.ndarray, values: np.ndarray | None = None, missing: int = -1) -> None:
        bits = max(4, (8 * len(keys)).bit_length())
        self.size = 1 << bits
        self._shift = np.uint64(64 - bits)
        self._keys = np.full(self.size, -1, np.int64)
        self.slots_of_keys = np.empty(len(keys), np.int64)
        self._missing = missing
        pending = np.arange(len(keys))
        slots = self._home(keys)
        while len(pending):
            free = self._keys[slots] == -1
            # Of several keys wanting one free slot, the first takes it; the others probe on.
            taken, first = np.unique(slots[free], return_index=True)
            winners = pending[free][first]
            self._keys[taken] = keys[winners]
            self.slots_of_keys[winners] = taken
            left = np.ones(len(pending), bool)
            left[np.flatnonzero(free)[first]] = False
            slots = np.where(free, slots, (slots + 1) & (self.size - 1))[left]
            pending = pending[left]
        self._values = np.full(self.size, missing, np.int64 if values is None else values.dtype)
        if values is not None:
            self._values[self.slots_of_keys] = values

    def _home(self, keys: np.ndarray) -> np.ndarray:
        slots = keys.astype(np.uint64)
        with np.errstate(over="ignore"):
            slots *= self._MULTIPLIER
        slots >>= self._shift
        return slots.view(np.int64)

    def values_of(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key, or ``missing`` for a key not in the table."""
        slots = self._home(keys)
        found = self._keys[slots]
        values = self._values[slots]
        wrong = found != keys
        if wrong.any():
            values[wrong] = self._missing
            pending = np.flatnonzero(wrong & (found != -1))
            if len(pending):
                slots = self.lookup(keys[pending])
                values[pending] = np.where(slots < self.size, self._values[slots & (self.size - 1)],
                                           self._missing)
        return values

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key, or ``size`` for a key not in the table."""
        out = np.full(len(keys), self.size, np.int64)
        slots = self._home(keys)
        found = self._keys[slots]
        hit = found == keys
        out[hit] = slots[hit]
        pending = np.flatnonzero(~hit & (found != -1))
        # Rare collisions: probe on, one step at a time, for the keys still unresolved.
        slots = slots[pending]
        while len(pending):
            slots = (slots + 1) & (self.size - 1)
            found = self._keys[slots]
            hit = found == keys[pending]
            out[pending[hit]] = slots[hit]
            more = ~hit & (found != -1)
            pending, slots = pending[more], slots[more]
        return out


def _without_overlaps(hits: np.ndarray) -> np.ndarray:
    """Positions of pair starts with overlapping runs (k, k+1, k+2, ...) thinned to k, k+2, ..."""
    if len(hits) < 2:
        return hits
    follows = np.flatnonzero(hits[1:] == hits[:-1] + 1) + 1
    if not len(follows):
        return hits
    # Offset of each hit within its run of consecutive positions; keep the even ones.
    index = np.arange(len(hits))
    run_start = np.where(np.concatenate(([True], hits[1:] != hits[:-1] + 1)), index, 0)
    np.maximum.accumulate(run_start, out=run_start)
    return hits[(index - run_start) % 2 == 0]
