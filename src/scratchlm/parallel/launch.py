"""Start N local processes that share a process group, run a function in each, collect results.

`torchrun` is the launcher for real jobs (see docs/distributed.md). This module is the small
in-Python launcher that tests and benchmarks use: it finds a free port, spawns the workers
with the ``spawn`` start method (no fork of a process that may hold threads), gives each a
process group, returns what every rank's function returned, and turns a hang into an error
after `timeout_s` instead of blocking forever.

    results = spawn(train_a_few_steps, world_size=2, args=(config,), timeout_s=120)
"""

from __future__ import annotations

import io
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from scratchlm.parallel.process_group import destroy_process_group, find_free_port, init_process_group


class WorkerError(RuntimeError):
    """A worker raised, died or did not finish in time; the message carries its traceback."""


def _serialize(obj: Any) -> bytes:
    # Plain bytes: tensors put on a multiprocessing queue travel as shared-memory handles that
    # die with the worker, which may exit before the parent reads them.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _deserialize(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: mp.Queue,
    collective_timeout_s: float,
) -> None:
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        init_process_group(
            rank, world_size, backend=backend, master_addr="127.0.0.1", master_port=port,
            timeout_s=collective_timeout_s,
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            destroy_process_group()
        results.put((rank, True, _serialize(out)))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes; returns results by rank.

    `fn` and `args` must be picklable (a module-level function). Each worker joins a process
    group on a free localhost port before `fn` runs and leaves it afterwards. Raises
    `WorkerError` if any worker raises, exits without a result or exceeds `timeout_s`.
    """
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, fn, tuple(args), results, timeout_s),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) + len(errors) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    raise WorkerError(f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]}") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise WorkerError(f"ranks {missing} did not finish within {timeout_s:.0f} s") from None
                continue
            if ok:
                outputs[rank] = _deserialize(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break  # the other ranks are likely blocked in a collective: stop them below
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if errors:
        raise WorkerError("\n".join(errors))
    return [outputs[r] for r in range(world_size)]
