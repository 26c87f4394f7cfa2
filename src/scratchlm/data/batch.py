"""Language-modelling batches from a flat token file.

A token file is read through ``np.memmap``: a batch touches only the pages of its windows, so a
multi-gigabyte corpus costs no RAM. Training windows start at uniformly random positions
(``get_batch`` for the one-liner, ``BatchSampler`` when the stream must be resumable and split
across ranks); validation windows are sequential and non-overlapping
(``iterate_eval_batches``), so every evaluation scores the same tokens.

Distributed sampling: every rank owns an identical generator and draws the whole global batch,
then keeps its contiguous block of rows. N ranks together therefore see exactly the batches one
process sees, and a run can resume on a different number of ranks with the same stream.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scratchlm.data.token_file import DTYPES, read_sidecar
from scratchlm.errors import UserError


def open_tokens(path: str | os.PathLike, *, context_length: int | None = None,
                meta: dict | None = None) -> np.memmap:
    """Memory-map a token file, with the dtype named in its ``.json`` sidecar (``uint16`` without one).

    ``meta`` is the sidecar when the caller has read it already (``token_file.read_sidecar``).

    Raises ``UserError`` when the file is missing or empty, its size is not a whole number of
    tokens, it disagrees with its sidecar (an incomplete write), or it holds no more than
    ``context_length`` tokens (one training window needs ``context_length + 1``).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"token file not found: {path}" if not path.is_dir()
                        else f"token file is a directory: {path}")
    meta = (read_sidecar(path) if meta is None else meta) or {}
    dtype = DTYPES[meta.get("dtype", "uint16")]
    expected = meta.get("num_tokens")
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"token file {path} is empty")
    if size % dtype.itemsize:
        raise UserError(f"token file {path} has {size} bytes, not a multiple of {dtype.itemsize} "
                        f"({dtype.name}); is it a token file?")
    num_tokens = size // dtype.itemsize
    if expected is not None and int(expected) != num_tokens:
        raise UserError(f"token file {path} holds {num_tokens} tokens but its sidecar says {expected}; "
                        f"it is incomplete or stale: encode it again")
    if context_length is not None and num_tokens <= context_length:
        raise UserError(f"token file {path} holds {num_tokens} tokens, too few for one window of "
                        f"context_length {context_length} (needs {context_length + 1})")
    return np.memmap(path, dtype=dtype, mode="r")


def get_batch(tokens: np.ndarray, batch_size: int, context_length: int,
              device: str | torch.device, *, rng: np.random.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` windows at uniformly random starts: x, y of shape (B, T), y = x shifted by one.

    Starts come from ``rng`` (numpy's global generator by default, so ``np.random.seed`` makes it
    repeatable). Both tensors are ``torch.long`` on ``device``; an unavailable device raises
    torch's own error.
    """
    _check_window(tokens, batch_size, context_length)
    if rng is None:
        starts = np.random.randint(0, len(tokens) - context_length, size=batch_size)
    else:
        starts = rng.integers(0, len(tokens) - context_length, size=batch_size)
    return _windows(tokens, starts, context_length, device)


class BatchSampler:
    """Resumable, rank-aware random training windows.

    ``batch_size`` is the global number of rows per micro-step; rank ``r`` of ``world_size``
    gets rows ``[r * b, (r + 1) * b)`` with ``b = batch_size // world_size``. The state (the
    generator and the step count) round-trips through ``state_dict`` / ``load_state_dict``.

        sampler = BatchSampler(tokens, 32, 256, seed=0)
        x, y = sampler.next_batch("cuda")   # (32, 256) each
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, context_length: int, *, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        _check_window(tokens, batch_size, context_length)
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size % world_size:
            raise UserError(f"batch_size {batch_size} is not divisible by world_size {world_size}: "
                            f"the global batch must split evenly across ranks")
        self.tokens = tokens
        self.batch_size = batch_size
        self.context_length = context_length
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        self._rng = np.random.default_rng(seed)

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.world_size

    def next_starts(self) -> np.ndarray:
        """This rank's window starts for the next step (advances the stream)."""
        starts = self._rng.integers(0, len(self.tokens) - self.context_length, size=self.batch_size)
        self.step += 1
        b = self.local_batch_size
        return starts[self.rank * b:(self.rank + 1) * b]

    def next_batch(self, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of shape (batch_size // world_size, context_length), torch.long on ``device``."""
        return _windows(self.tokens, self.next_starts(), self.context_length, device)

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (ints, strings, dicts): safe for ``torch.save`` and JSON."""
        return {"bit_generator": self._rng.bit_generator.state, "step": self.step, "seed": self.seed,
                "batch_size": self.batch_size, "context_length": self.context_length,
                "num_tokens": int(len(self.tokens))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream saved by ``state_dict`` (possibly with another world_size)."""
        for key in ("batch_size", "context_length", "num_tokens"):
            mine = int(len(self.tokens)) if key == "num_tokens" else getattr(self, key)
            if key in state and int(state[key]) != mine:
                raise UserError(f"sampler state has {key}={state[key]} but this run has {mine}; "
                                f"the data stream cannot continue")
        rng = np.random.default_rng()
        try:
            rng.bit_generator.state = state["bit_generator"]
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"sampler state is not one this sampler wrote ({exc})") from None
        self._rng = rng
        self.step = int(state.get("step", 0))
        self.seed = state.get("seed", self.seed)


def iterate_eval_batches(tokens: np.ndarray, batch_size: int, context_length: int,
                         max_batches: int | None = None, *, max_windows: int | None = None,
                         device: str | torch.device = "cpu") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Sequential, non-overlapping windows from the start of ``tokens``, ``batch_size`` at a time.

    Window i covers x = tokens[i*T : (i+1)*T], y one further; there are (len - 1) // T of them.
    The last batch may be smaller. ``max_batches`` or ``max_windows`` stops early (None = all
    windows); ``max_windows`` fixes the set of windows whatever the batch size.
    """
    _check_window(tokens, batch_size, context_length)
    num_windows = (len(tokens) - 1) // context_length
    if max_batches is not None:
        num_windows = min(num_windows, max_batches * batch_size)
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    for first in range(0, num_windows, batch_size):
        count = min(batch_size, num_windows - first)
        starts = (first + np.arange(count)) * context_length
        yield _windows(tokens, starts, context_length, device)


def _check_window(tokens: np.ndarray, batch_size: int, context_length: int) -> None:
    if batch_size < 1 or context_length < 1:
        raise UserError(f"batch_size and context_length must be positive, got {batch_size} and {context_length}")
    if len(tokens) <= context_length:
        raise UserError(f"{len(tokens)} tokens are too few for one window of context_length "
                        f"{context_length} (needs {context_length + 1})")


def _windows(tokens: np.ndarray, starts: np.ndarray, context_length: int,
             device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # (B, T+1) gather: on a memmap, fancy indexing reads only the pages it touches
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(context_length + 1)
    window = np.asarray(tokens[index], dtype=np.int64)
    x = torch.from_numpy(np.ascontiguousarray(window[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(window[:, 1:]))
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        # pinned host memory lets the copy overlap with compute already queued on the GPU
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)
