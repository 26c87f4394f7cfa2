"""Encoding and decoding with a byte-level BPE vocabulary.

Encoding splits text on special tokens (the longest wins where they overlap), cuts the rest
into *units* (see ``pretokenize``: runs of non-whitespace with one optional leading whitespace
character, and whitespace runs, which no GPT-2 pretoken crosses) and looks each unit up in a
cache; only a unit never seen before goes through GPT-2's regex and the merge loop. On real text almost every
unit is a cache hit, so encoding costs one C-level regex pass and one dict lookup per word.
A unit the cache lacks gets a placeholder token, so the join goes on in one pass cold or
warm; about every megabyte of text the new units are encoded together (one regex pass over all
of them joined into one string, one merge loop over all their new pretokens at once with
``bulk_merge``, numpy) and their tokens replace the placeholders as the token strings become ids.

BPE on a pretoken follows tiktoken: a pretoken that is a token of its own maps to it; otherwise
repeatedly merge the leftmost adjacent pair that comes earliest in the merge list, until no
adjacent pair is in it (for vocabularies learned by BPE this is GPT-2's algorithm). A pretoken
longer than LONG_PRETOKEN (a whitespace run, a long word) takes numpy merge rounds and a heap
instead of the per-word loop, which rescans the word after every merge: any input encodes in
O(n log n). Ids come
from the vocabulary given, so GPT-2's own ``encoder.json`` (whose byte ids are not the byte values) works as well as ``train_bpe`` output.

Decoding joins token bytes and decodes them as UTF-8, replacing invalid sequences with U+FFFD.
An id that is not in the vocabulary raises ``UnknownTokenError`` (both a ``UserError`` and a
``ValueError``).
"""

from __future__ import annotations

import array
import hashlib
import heapq
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from collections import defaultdict
from itertools import count, islice

from typing import TYPE_CHECKING

from scratchlm.errors import UserError
from scratchlm.tokenizer.pretokenize import (
    GPT2_RE, UNIT_RE, UNITS_SEP, pretokenize_joined, special_tokens_pattern,
)

if TYPE_CHECKING:
    from scratchlm.tokenizer.bulk_merge import BulkMerger

EOT = "<|endoftext|>"
# Cache bounds, so memory stays flat however much text goes through (about 150-200 bytes an
# entry: the two strings and the dict slot). When the unit cache reaches its bound it keeps
# its older half (the units met first, the frequent ones among them) and the units of the
# block being encoded; the pretoken cache, needed only for new units, is cleared. With these bounds (~50 + ~25 MB) the RSS of
# encode_iterable levels off at ~125-135 MB within the first ~50 MB of text and stays there
# (with 2^20 entries it was 239 MB and rising after 170 MB); halving them levels it at ~80 MB
# but evicts part of a 10 MB corpus's 142K distinct units, which slows a second pass over it.
MAX_CACHE_UNITS = 1 << 18
MAX_CACHE_PRETOKENS = 1 << 17
# Fewer new pretokens than this go through the per-word merge loop rather than BulkMerger,
# whose fixed cost per merge round only pays off over many words.
BULK_MERGE_MIN = 256
# Pretokens longer than this (in bytes, or characters when choosing the merge path) merge with
# a heap, O(n log n): the per-word loop rescans the word after each merge, O(n^2).
LONG_PRETOKEN = 64
# _merge_long's numpy rounds go on while a round merges at least this fraction of the tokens.
BULK_ROUND_MIN_FRACTION = 1 / 32
# encode() encodes the new units of about this many characters of text together, and turns
# their token strings into ids, so memory stays proportional.
ENCODE_BLOCK_CHARS = 1 << 20
# Text is cut into units and joined block by block, blocks of about this many characters: the
# unit strings of a small block are still in the CPU caches when the join looks them up (a
# few percent faster than 1M-character blocks).
UNIT_BLOCK_CHARS = 1 << 14
# encode_iterable encodes roughly this many characters at a time.
STREAM_BLOCK_CHARS = 1 << 16



# A non-whitespace character followed by a space and another non-whitespace character (stdlib
# ``re``'s \\s is ``str.isspace``): ``_blocks`` cuts before that space.
_CUT_RE = re.compile(r"\S \S")


class UnknownTokenError(UserError, ValueError):
    """decode() was given an id that is not in the vocabulary."""


_UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)
_UTF32 = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"


class _UnitCache(defaultdict):
    """unit -> token string (chr(id) per token), handing out placeholders for new units.

    Looking up a unit that is not in the cache gives it a *placeholder*, a character past every
    id (``first_placeholder + k`` for the k-th new unit since ``start``), which stays in the
    cache so that the unit's later occurrences find it too. The placeholder comes from
    ``default_factory``, a C-level iterator (``map(chr, count(first))``), so a miss costs no
    Python-level call (a ``__missing__`` method cost ~1.3 microseconds per new unit, ~0.18 s of a
    cold pass over 10.7 MB); the new units are the cache's last keys (``new``, in insertion
    order). Text is thus joined into token strings in one pass, cold or warm, and
    ``Tokenizer._flush`` later encodes the new units together and puts their tokens in place of
    the placeholders. ``room`` is asked before each block, since a miss can no longer refuse.
    """

    def __init__(self, items: dict[str, str] | None, first_placeholder: int) -> None:
        super().__init__(None, items or {})
        self.first_placeholder = first_placeholder
        self.start()

    def start(self) -> None:
        """From here on, new units get placeholders first_placeholder, first_placeholder + 1, ..."""
        self.base = len(self)
        self.default_factory = map(chr, count(self.first_placeholder)).__next__

    def new(self) -> list[str]:
        """The units added (with placeholders) since ``start``, in order."""
        n = len(self) - self.base
        return list(islice(reversed(self), n))[::-1] if n else []

    def __reduce__(self):
        # The factory (an iterator) cannot be pickled or copied: a copy starts afresh.
        return type(self), (dict(self), self.first_placeholder)

    def room(self, n: int) -> bool:
        """Whether n more new units fit, under MAX_CACHE_UNITS entries and within the placeholders."""
        return len(self) + n <= MAX_CACHE_UNITS and self.first_placeholder + len(self) - self.base + n <= 0x110000

    def drop_new(self) -> None:
        """Remove the units added since ``start`` (and their placeholders)."""
        for unit in self.new():
            del self[unit]
        self.start()


def _ids_of(chars: str) -> list[int]:
    """[ord(c) for c in chars], through a uint32 buffer (about twice as fast as map(ord))."""
    ids = array.array(_UINT32)
    # surrogatepass: ids 0xD800..0xDFFF are lone surrogates as characters.
    ids.frombytes(chars.encode(_UTF32, "surrogatepass"))
    return ids.tolist()


def _replace_placeholders(text: str, first: int, tokens: list[str]) -> list[int]:
    """Ids of text with each character ``first + k`` (a placeholder) replaced by tokens[k]."""
    import numpy as np

    ids = np.frombuffer(text.encode(_UTF32, "surrogatepass"), np.uint32)
    at = np.flatnonzero(ids >= first)
    if not len(at):
        return ids.tolist()
    which = ids[at].astype(np.int64) - first
    flat = np.frombuffer("".join(tokens).encode(_UTF32, "surrogatepass"), np.uint32)
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    offsets = np.cumsum(lengths) - lengths
    count = lengths[which]  # tokens in place of each placeholder
    size = np.ones(len(ids), np.int64)
    size[at] = count
    out = np.repeat(ids, size)  # each placeholder repeated as often as it has tokens
    extra = np.cumsum(count) - count  # tokens of the placeholders before each one
    start = at + extra - np.arange(len(at))  # where each placeholder's tokens begin in out
    # All the placeholders' tokens at once: element e of their concatenation goes from
    # flat[offsets[which] + t] to out[start + t], t its place within its placeholder.
    e = np.arange(int(count.sum()))
    out[np.repeat(start - extra, count) + e] = flat[np.repeat(offsets[which] - extra, count) + e]
    return out.tolist()


class Tokenizer:
    """A byte-level BPE tokenizer: ``vocab`` id -> bytes, ``merges`` in priority order.

    Special tokens are matched in the text before anything else and map to single ids; a
    special token missing from the vocabulary is appended to it with the next free id.

    >>> from scratchlm.tokenizer.train import train_bpe  # doctest: +SKIP
    >>> tok = Tokenizer(vocab, merges, ["<|endoftext|>"])  # doctest: +SKIP
    >>> tok.decode(tok.encode("hello<|endoftext|>"))  # doctest: +SKIP
    'hello<|endoftext|>'
    """

    def __init__(self, vocab: dict[int, bytes], merges: Sequence[tuple[bytes, bytes]],
                 special_tokens: Sequence[str] | None = None) -> None:
        self.vocab: dict[int, bytes] = {int(i): bytes(t) for i, t in vocab.items()}
        self.merges: list[tuple[bytes, bytes]] = [(bytes(a), bytes(b)) for a, b in merges]
        self.special_tokens: list[str] = list(dict.fromkeys(special_tokens or ()))

        # bytes -> id for ordinary tokens: with duplicate bytes the lowest id wins, and special
        # tokens take the highest id carrying their bytes (they are appended last).
        by_bytes: dict[bytes, int] = {}
        for i in sorted(self.vocab, reverse=True):
            by_bytes[self.vocab[i]] = i
        self.special_token_ids: dict[str, int] = {}
        for token in self.special_tokens:
            data = token.encode("utf-8")
            ids = [i for i, t in self.vocab.items() if t == data]
            if ids:
                self.special_token_ids[token] = max(ids)
            else:
                new = max(self.vocab, default=-1) + 1
                self.vocab[new] = data
                self.special_token_ids[token] = new
                by_bytes.setdefault(data, new)

        missing = [b for b in range(256) if bytes([b]) not in by_bytes]
        if missing:
            raise UserError(f"the vocabulary lacks {len(missing)} single bytes (e.g. 0x{missing[0]:02x}); "
                            "a byte-level vocabulary needs all 256")
        # Tokens are handled as strings of chr(id): a pair is a 2-character string and
        # merging it is str.replace, as in training.
        self._byte_chars = {b: chr(by_bytes[bytes([b])]) for b in range(256)}  # a translate table
        self._bytes_are_ids = all(self._byte_chars[b] == chr(b) for b in range(256))  # train_bpe layout
        special_ids = set(self.special_token_ids.values())
        # Pretoken -> its token, for pretokens that are a token of their own (tokens whose bytes
        # are not UTF-8 can never be a whole pretoken).
        self._whole: dict[str, str] = {}
        for data, i in by_bytes.items():
            if i not in special_ids:
                try:
                    self._whole[data.decode("utf-8")] = chr(i)
                except UnicodeDecodeError:
                    pass
        self._special_chars = {t: chr(i) for t, i in self.special_token_ids.items()}
        self._ranks: dict[str, int] = {}
        self._merged: dict[str, str] = {}
        self._bulk: BulkMerger | None | bool = None  # built on first use; False: not applicable
        for rank, (left, right) in enumerate(self.merges):
            try:
                pair = chr(by_bytes[left]) + chr(by_bytes[right])
                merged = by_bytes[left + right]
            except KeyError:
                raise UserError(f"merge {rank} ({left!r}, {right!r}) uses or makes a token "
                                "missing from the vocabulary") from None
            if pair not in self._ranks:
                self._ranks[pair] = rank
                self._merged[pair] = chr(merged)

        self._special_re = special_tokens_pattern(self.special_tokens, capture=True)
        self._max_special = max((len(t) for t in self.special_tokens), default=0)
        self._pretokens: dict[str, str] = {}  # pretoken -> token string
        self._first_placeholder = max(self.vocab) + 1
        self._cache = _UnitCache(None, self._first_placeholder)  # unit -> token string
        self._hash: str | None = None

    # --- construction from files -----------------------------------------------------------

    @classmethod
    def from_files(cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike,
                   special_tokens: Sequence[str] | None = None) -> Tokenizer:
        """A tokenizer from GPT-2-style ``vocab.json`` (text form -> id) and ``merges.txt``."""
        from scratchlm.tokenizer.io import read_merges_txt, read_vocab_json

        specials = list(special_tokens or ())
        return cls(read_vocab_json(vocab_path, specials), read_merges_txt(merges_path), specials)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        """A tokenizer saved by ``save`` (vocab.json, merges.txt, special_tokens.json)."""
        from scratchlm.tokenizer.io import load_tokenizer

        return load_tokenizer(directory)

    def save(self, directory: str | os.PathLike) -> None:
        """Write vocab.json, merges.txt, special_tokens.json and a Hugging Face tokenizer.json (where one
        can hold this tokenizer: see ``scratchlm.tokenizer.io``)."""
        from scratchlm.tokenizer.io import save_tokenizer

        save_tokenizer(self, directory)

    # --- properties --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (the size an embedding table needs)."""
        return max(self.vocab) + 1

    @property
    def eot_id(self) -> int | None:
        """The id of ``<|endoftext|>`` if it is one of the special tokens."""
        return self.special_token_ids.get(EOT)

    @property
    def hash(self) -> str:
        """sha256 (hex) over ids, token bytes, merges and special tokens: equal hashes, equal encodings."""
        if self._hash is None:
            h = hashlib.sha256(b"scratchlm-bpe-v1\n")
            for i in sorted(self.vocab):
                h.update(b"%d %s\n" % (i, self.vocab[i].hex().encode()))
            h.update(b"merges\n")
            for left, right in self.merges:
                h.update(b"%s %s\n" % (left.hex().encode(), right.hex().encode()))
            h.update(b"special\n")
            for token in self.special_tokens:
                h.update(b"%d %s\n" % (self.special_token_ids[token], token.encode("utf-8").hex().encode()))
            self._hash = h.hexdigest()
        return self._hash

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={self.special_tokens!r})")

    # --- encoding ----------------------------------------------------------------------------

    def _merge_loop(self, data: bytes) -> str:
        """The merged token string (chr(id) per token) of a pretoken's bytes, one word at a time."""
        chars = data.decode("latin-1")
        parts = list(chars if self._bytes_are_ids else chars.translate(self._byte_chars))
        if len(parts) > LONG_PRETOKEN:
            return self._merge_long(parts)
        get = self._ranks.get
        merged_of = self._merged
        never = len(self.merges)  # past every rank, also where a merge listed twice left a gap
        # ranks[k]: rank of the pair (parts[k], parts[k + 1]); only the two pairs next to a
        # merge change, so each step is a C-level min() plus two lookups.
        ranks = [get(parts[k] + parts[k + 1], never) for k in range(len(parts) - 1)]
        while ranks:
            rank = min(ranks)
            if rank == never:
                break
            k = ranks.index(rank)  # the leftmost of the best pairs, as tiktoken does
            token = merged_of[parts[k] + parts[k + 1]]
            parts[k] = token
            del parts[k + 1]
            del ranks[k]
            if k > 0:
                ranks[k - 1] = get(parts[k - 1] + token, never)
            if k < len(ranks):
                ranks[k] = get(token + parts[k + 1], never)
        return "".join(parts)

    def _merge_long(self, parts: list[str]) -> str:
        """``_merge_loop`` for a long pretoken, in O(n log n) rather than O(n^2).

        First come merge rounds of the bulk merger (every occurrence of the best pair at once, in
        numpy) as long as each merges at least BULK_ROUND_MIN_FRACTION of the tokens: linear in
        all, and what makes long whitespace runs fast. Then a heap takes over.

        The heap makes the same merges in the same order: it holds ``rank * n + position`` (one
        int compares faster than a tuple) and pops the lowest-ranked pair, the leftmost among
        equals (positions are the tokens' first bytes, so their order is the text's). Merged-away
        tokens become empty strings, and neighbours are linked by index. A heap entry is stale
        once its left token is gone or its pair has changed (a rank names one pair, so the
        pair's current rank tells).
        """
        bulk = self._bulk_merger()
        if bulk is None:
            get = self._ranks.get
            n = len(parts)
            heap = [rank * n + k for k, rank in enumerate(map(get, map(str.__add__, parts, parts[1:])))
                    if rank is not None]
            heapq.heapify(heap)
        else:
            import numpy as np

            ids = np.frombuffer("".join(parts).encode(_UTF32, "surrogatepass"), np.uint32)
            ids, done = bulk.merge_rounds(ids, BULK_ROUND_MIN_FRACTION)
            text = ids.astype(np.uint32).tobytes().decode(_UTF32, "surrogatepass")
            if done:
                return text
            parts = list(text)
            n = len(parts)
            ranks = bulk.pair_ranks(ids)
            at = np.flatnonzero(ranks >= 0)
            # The bulk merger numbers the distinct pairs 0, 1, ...; the heap keeps self._ranks'
            # numbers (merge indices), which skip a merge listed twice.
            ranks = self._merge_index[ranks[at]]
            heap = np.sort(ranks * n + at).tolist()  # sorted, so already a heap
        return self._heap_merge(parts, heap)

    def _heap_merge(self, parts: list[str], heap: list[int]) -> str:
        """The merge loop of ``_merge_long`` over parts, from the heap of its pairs."""
        get = self._ranks.get
        merged_of = self._merged
        n = len(parts)
        after = list(range(1, n + 1))  # after[k]: the position of the token right of k (n: none)
        before = list(range(-1, n - 1))  # before[k]: the position of the token left of k (-1: none)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            rank, k = divmod(pop(heap), n)
            right = after[k]
            if right == n or not parts[k]:
                continue
            pair = parts[k] + parts[right]
            if get(pair) != rank:
                continue
            token = parts[k] = merged_of[pair]
            parts[right] = ""
            nxt = after[k] = after[right]
            if nxt != n:
                before[nxt] = k
                r = get(token + parts[nxt])
                if r is not None:
                    push(heap, r * n + k)
            left = before[k]
            if left != -1:
                r = get(parts[left] + token)
                if r is not None:
                    push(heap, r * n + left)
        return "".join(parts)

    def _bpe_many(self, pretokens: set[str]) -> None:
        """Add the merged token strings of pretokens to the pretoken cache."""
        # A pretoken that is itself a token encodes as that token (tiktoken's shortcut, and
        # Hugging Face's ignore_merges).
        whole = self._whole
        found = whole.keys() & pretokens
        cache = self._pretokens
        cache.update(zip(found, map(whole.__getitem__, found)))
        rest = list(pretokens.difference(found))
        # Long pretokens (whitespace runs, say) take the heap: in the bulk merger a word costs a
        # pass over its tokens for every distinct merge it makes.
        if rest and max(map(len, rest)) > LONG_PRETOKEN:
            long = [p for p in rest if len(p) > LONG_PRETOKEN]
            cache.update((p, self._merge_loop(p.encode("utf-8"))) for p in long)
            rest = [p for p in rest if len(p) <= LONG_PRETOKEN]
        if len(rest) < BULK_MERGE_MIN or self._bulk_merger() is None:
            merged = [self._merge_loop(p.encode("utf-8")) for p in rest]
        else:
            merged = self._bulk.merge_text(rest)
        cache.update(zip(rest, merged))

    def _bulk_merger(self) -> BulkMerger | None:
        """The BulkMerger for these merges (built on first use), or None where it would differ."""
        if self._bulk is None:
            from scratchlm.tokenizer.bulk_merge import BulkMerger  # numpy, only when needed

            import numpy as np

            # Pairs and merged tokens are strings of chr(id): their UTF-32 is their ids.
            pairs = np.frombuffer("".join(self._ranks).encode(_UTF32, "surrogatepass"), np.uint32).reshape(-1, 2)
            merged = np.frombuffer("".join(self._merged.values()).encode(_UTF32, "surrogatepass"), np.uint32)
            byte_ids = [ord(self._byte_chars[b]) for b in range(256)]
            exact = BulkMerger.exact_for(pairs, merged)
            self._bulk = BulkMerger(pairs, merged, byte_ids) if exact else False
            # the merge index of each distinct pair, in the bulk merger's numbering
            self._merge_index = np.fromiter(self._ranks.values(), np.int64, len(self._ranks))
        return self._bulk or None

    def _tokens_of(self, texts: list[str]) -> list[str]:
        """Token strings of texts (units), each encoded alone.

        The texts are joined with NUL (``UNITS_SEP``): one regex pass over all of them
        (``pretokenize_joined``) and one merge loop over their new pretokens; the tokens of the
        NUL byte then separate the texts' token strings again, since no other text's tokens
        contain that byte. If a text holds a NUL itself, each goes through GPT-2's pattern alone.
        """
        if not texts:
            return []
        pretokens = self._pretokens
        if len(pretokens) > MAX_CACHE_PRETOKENS:
            pretokens.clear()
        joined = UNITS_SEP.join(texts)
        if joined.count(UNITS_SEP) >= len(texts):
            out = []
            for text in texts:
                found = GPT2_RE.findall(text)
                self._bpe_many(set(found).difference(pretokens))
                out.append("".join(map(pretokens.__getitem__, found)))
            return out
        found = pretokenize_joined(joined)
        need = set(found).difference(pretokens)
        if need:
            self._bpe_many(need)
        return "".join(map(pretokens.__getitem__, found)).split(self._byte_chars[0])

    def _encode_pieces(self, pieces: list[str]) -> list[int]:
        """Ids of ordinary text at even indices of pieces and special tokens at odd ones.

        Text goes in blocks of about UNIT_BLOCK_CHARS (see ``_blocks``); each block is cut into
        units and joined into token strings through the unit cache, new units getting
        placeholders. About every ENCODE_BLOCK_CHARS of text, ``_flush`` encodes the new units
        together (one regex pass and one merge loop for all of them) and turns the token strings
        into ids.
        """
        ids: list[int] = []
        out: list[str] = []  # token strings (chr(id) per token) of the text since the last flush
        size = 0
        findall = UNIT_RE.findall
        try:
            for k, piece in enumerate(pieces):
                if k % 2:
                    out.append(self._special_chars[piece])
                    continue
                for block in self._blocks(piece):
                    units = findall(block)
                    if not self._cache.room(len(units)):
                        self._flush(out, ids)
                        if not self._make_room(units):
                            out.append(self._encode_units(units))
                            continue
                    out.append("".join(map(self._cache.__getitem__, units)))
                    size += len(block)
                    if size >= ENCODE_BLOCK_CHARS:
                        self._flush(out, ids)
                        size = 0
            self._flush(out, ids)
        except BaseException:
            self._cache.drop_new()  # never leave a placeholder in the cache
            raise
        return ids

    def _flush(self, out: list[str], ids: list[int]) -> None:
        """Encode the units new since the last flush, append the ids of out to ids, empty out."""
        text = "".join(out)
        out.clear()
        cache = self._cache
        new = cache.new()
        if new:
            tokens = self._tokens_of(new)
            cache.update(zip(new, tokens))
            cache.start()
            ids += _replace_placeholders(text, cache.first_placeholder, tokens)
        elif text:
            ids += _ids_of(text)

    def _make_room(self, units: list[str]) -> bool:
        """After a flush: make room in the cache for a block's units; False if they cannot fit.

        With the cache at its bound, it keeps its older half (the units met first, among them
        the frequent ones) and the units of this block, so a block never evicts its own.
        """
        cache = self._cache
        if cache.room(len(units)):
            return True
        if len(cache) > MAX_CACHE_UNITS // 2:
            kept = dict(islice(cache.items(), MAX_CACHE_UNITS // 2))
            kept.update((unit, cache[unit]) for unit in set(units) if unit in cache)
            self._cache = cache = _UnitCache(kept, self._first_placeholder)
        return cache.room(len(units))

    def _encode_units(self, units: list[str]) -> str:
        """Token string of a block's units, through the cache where they are in it."""
        cache = self._cache
        distinct = [unit for unit in dict.fromkeys(units) if unit not in cache]
        tokens = dict(zip(distinct, self._tokens_of(distinct)))
        return "".join(cache[unit] if unit in cache else tokens[unit] for unit in units)

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of text, treating special tokens as plain text."""
        return self._encode_pieces([text])

    def _blocks(self, text: str) -> Iterator[str]:
        """text in pieces of about UNIT_BLOCK_CHARS, cut where encoding may restart.

        A cut goes before a space between two characters that are not whitespace (``str.isspace``,
        which covers GPT-2's ``\\s``): there a unit, and a pretoken, always starts.
        """
        start = 0
        while len(text) - start > UNIT_BLOCK_CHARS:
            match = _CUT_RE.search(text, start + UNIT_BLOCK_CHARS - 1)
            if match is None:
                break
            pos = match.start() + 1
            yield text[start:pos]
            start = pos
        yield text[start:]

    def encode(self, text: str) -> list[int]:
        """Ids of text; special tokens in it map to their single ids."""
        if self._special_re is None:
            return self._encode_pieces([text])
        return self._encode_pieces(self._special_re.split(text))

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Ids of the concatenation of the strings (e.g. a text file's lines), lazily.

        Memory stays bounded by the block size (plus the unit cache) however long the stream:
        text is buffered only up to a place where encoding may restart, which no pretoken and
        no special token crosses.
        """
        pending: list[str] = []
        size = 0
        for chunk in iterable:
            pending.append(chunk)
            size += len(chunk)
            if size < STREAM_BLOCK_CHARS:
                continue
            buf = "".join(pending)
            cut = self._safe_cut(buf)
            if cut <= 0:
                pending, size = [buf], len(buf)
                continue
            yield from self.encode(buf[:cut])
            rest = buf[cut:]
            pending, size = [rest], len(rest)
        if pending:
            yield from self.encode("".join(pending))

    def _safe_cut(self, text: str) -> int:
        """A position where text can be split and each side encoded alone, or -1.

        A space between two non-space characters starts a pretoken in any context; it is
        taken only where no special-token occurrence could straddle it, and far enough from
        the end that a special token cut off by the end of the buffer cannot reach it.
        """
        end = len(text) - max(self._max_special, 2)
        for _ in range(256):
            pos = text.rfind(" ", 1, end)
            if pos <= 0:
                return -1
            end = pos
            if text[pos - 1].isspace() or text[pos + 1].isspace():
                continue
            if any(self._straddles(text, pos, t) for t in self.special_tokens):
                continue
            return pos
        return -1

    @staticmethod
    def _straddles(text: str, pos: int, token: str) -> bool:
        hit = text.find(token, max(0, pos - len(token) + 1), pos + len(token) - 1)
        return hit != -1 and hit < pos

    # --- decoding ----------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The concatenated bytes of the tokens."""
        try:
            return b"".join(map(self.vocab.__getitem__, ids))
        except (KeyError, TypeError) as exc:
            bad = exc.args[0] if isinstance(exc, KeyError) else exc
            raise UnknownTokenError(f"token id {bad!r} is not in the vocabulary "
                                    f"(size {self.vocab_size})") from None

    def decode(self, ids: Iterable[int], *, unknown: str | None = None) -> str:
        """Text of the tokens; invalid UTF-8 becomes U+FFFD. With `unknown`, an id that is not in
        the vocabulary (e.g. sampled from the padding rows of a model whose vocab_size is above
        the tokenizer's) decodes to that text instead of raising `UnknownTokenError`."""
        if unknown is not None:
            fill = unknown.encode("utf-8")
            return b"".join(self.vocab.get(i, fill) for i in ids).decode("utf-8", errors="replace")
        return self.decode_bytes(ids).decode("utf-8", errors="replace")
