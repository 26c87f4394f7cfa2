"""Packed language-model data: documents end to end, cut into fixed-length windows.

Padding every SFT pair to the longest of its batch spends compute on pad tokens when lengths
vary. Packing concatenates the documents into one token stream, each followed by EOS,

    prompt_1 response_1 EOS prompt_2 response_2 EOS ... prompt_n response_n EOS

and cuts it into windows of ``context_length + 1`` tokens that start every ``context_length``
tokens: window i is ``stream[i*T : i*T + T + 1]``, its inputs ``x`` the first T tokens and its
targets ``y`` the last T. Consecutive windows share one token (the last target of one is the
first input of the next), so in an epoch every token of the stream but the first is a target
exactly once. The tail too short to fill a window is dropped by default; with
``pad_last=True`` it is padded with `pad_id` and the padding is masked out of the loss.

Every stream token carries a loss flag. With `mask_prompt` (SFT) the response tokens and each
EOS count and the prompt tokens do not; without it (plain language modelling) every token
counts. ``loss_mask[b, t]`` is the flag of ``y[b, t]``, the token being predicted.

Attention is not blocked at document boundaries: a window may begin inside one document and
run into the next, as in GPT-style pretraining; the EOS token marks the boundary.

Each epoch visits the windows in a fresh permutation drawn from ``(seed, epoch)``, so the order
is reproducible and does not depend on how many batches were drawn before.

>>> data = PackedDataset([([5, 6], [7]), [8, 9]], context_length=3, eos_id=0, seed=0)
>>> data.tokens.tolist(), data.loss_flags.astype(int).tolist()
([5, 6, 7, 0, 8, 9, 0], [0, 0, 1, 1, 1, 1, 1])
>>> len(data)  # windows [5 6 7 0] and [0 8 9 0]
2
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from scratchlm.errors import UserError

# A document is a plain token list (every token is a target) or a (prompt ids, response ids) pair.
Document = Sequence[int] | tuple[Sequence[int], Sequence[int]]


def _is_pair(doc: Document) -> bool:
    return isinstance(doc, tuple) and len(doc) == 2 and not isinstance(doc[0], (int, np.integer))


def encode_documents(encode: Callable[[str], list[int]], documents: Sequence[str | tuple[str, str]]) -> list[Document]:
    """Token documents from texts: a string becomes a token list, a (prompt, response) pair a pair of them."""
    return [(encode(d[0]), encode(d[1])) if isinstance(d, tuple) else encode(d) for d in documents]


def pack_documents(documents: Sequence[Document], eos_id: int, *, mask_prompt: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The stream of `documents`, each followed by `eos_id`: tokens (N,) int64 and loss flags (N,) bool.

    A flag is False only on the prompt tokens of (prompt, response) pairs, and only with
    `mask_prompt`. Empty documents are skipped.

    >>> tokens, flags = pack_documents([([1, 2], [3]), [4]], eos_id=0)
    >>> tokens.tolist(), flags.tolist()
    ([1, 2, 3, 0, 4, 0], [False, False, True, True, True, True])
    """
    pieces: list[np.ndarray] = []
    flags: list[np.ndarray] = []
    eos = np.array([eos_id], dtype=np.int64)
    for doc in documents:
        prompt, response = (doc[0], doc[1]) if _is_pair(doc) else ((), doc)
        if len(prompt) + len(response) == 0:
            continue
        pieces += [np.asarray(prompt, dtype=np.int64), np.asarray(response, dtype=np.int64), eos]
        flags += [np.full(len(prompt), not mask_prompt), np.ones(len(response) + 1, dtype=bool)]
    if not pieces:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    return np.concatenate(pieces), np.concatenate(flags)


class PackedDataset:
    """Documents packed into windows of ``context_length + 1`` tokens, shuffled per epoch (see the module)."""

    def __init__(self, documents: Sequence[Document], *, context_length: int, eos_id: int, mask_prompt: bool = True,
                 pad_last: bool = False, pad_id: int | None = None, seed: int = 0) -> None:
        if context_length < 1:
            raise ValueError(f"context_length must be positive, got {context_length}")
        self.context_length = context_length
        self.mask_prompt = mask_prompt
        self.pad_last = pad_last
        self.seed = seed
        self.tokens, self.loss_flags = pack_documents(documents, eos_id, mask_prompt=mask_prompt)
        T, n = context_length, len(self.tokens)
        self.num_windows = (max(n - 1, 0) + T - 1) // T if pad_last else max(n - 1, 0) // T
        if self.num_windows == 0:
            raise UserError(f"the packed documents hold {n} tokens, fewer than one window of {T + 1}; "
                            f"add documents or shorten the window")
        # Windows index a copy padded to num_windows * T + 1 tokens; the padding never counts.
        length = self.num_windows * T + 1
        self._tokens = np.full(length, eos_id if pad_id is None else pad_id, dtype=np.int64)
        self._flags = np.zeros(length, dtype=bool)
        keep = min(n, length)
        self._tokens[:keep], self._flags[:keep] = self.tokens[:keep], self.loss_flags[:keep]

    def __len__(self) -> int:
        return self.num_windows

    @property
    def returns_mask(self) -> bool:
        """Whether batches carry a loss mask: some targets must not count (prompts or padding)."""
        return self.mask_prompt or self.pad_last

    def order(self, epoch: int) -> np.ndarray:
        """The window indices of one epoch, a permutation drawn from (seed, epoch)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def batch(self, indices: Sequence[int] | np.ndarray, device: str | torch.device = "cpu") -> tuple[Tensor, ...]:
        """Windows `indices` as ``(x, y)`` or ``(x, y, loss_mask)`` (see `returns_mask`), each (B, T)."""
        T = self.context_length
        rows = np.asarray(indices, dtype=np.int64)[:, None] * T + np.arange(T + 1)  # (B, T + 1)
        window = torch.from_numpy(self._tokens[rows])
        out: tuple[Tensor, ...] = (window[:, :-1], window[:, 1:])
        if self.returns_mask:
            out += (torch.from_numpy(self._flags[rows[:, 1:]]),)
        return tuple(t.to(device) for t in out)

    def batches(self, batch_size: int, *, epochs: int | None = 1, start_epoch: int = 0,
                device: str | torch.device = "cpu") -> Iterator[tuple[Tensor, ...]]:
        """Batches of `batch_size` windows, epoch after epoch (`epochs=None`: without end).

        Each epoch visits every window once; its last batch is smaller when `batch_size` does
        not divide the number of windows.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        epoch_range = itertools.count(start_epoch) if epochs is None else range(start_epoch, start_epoch + epochs)
        for epoch in epoch_range:
            order = self.order(epoch)
            for start in range(0, len(order), batch_size):
                yield self.batch(order[start:start + batch_size], device)

    def index_stream(self, start_epoch: int = 0) -> Iterator[int]:
        """Window indices of epoch after epoch without end, for batches that may span two epochs."""
        for epoch in itertools.count(start_epoch):
            yield from self.order(epoch).tolist()
