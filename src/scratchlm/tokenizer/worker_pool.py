"""Process pools whose workers never outlive the process that started them.

A ``ProcessPoolExecutor`` worker waits on a pipe for its next task. If the parent is killed
(``kill -9``, or SIGTERM, whose default action skips all Python clean-up), nothing closes that
pipe's other end in a way the worker notices, and it stays blocked forever, re-parented to
PID 1 and holding its memory. So every worker of ``worker_pool``:

* asks Linux to send it SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, through
  ctypes); the kernel delivers it however the parent ends;
* runs a watchdog thread that exits the process once its parent pid changes (the portable
  fallback, and a cover for the race where the parent died before ``prctl`` took effect).

A parent that stops on an exception (KeyboardInterrupt on SIGINT included) terminates its
workers instead of waiting for the tasks they are running.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WATCHDOG_SECONDS = 0.5  # how often a worker checks that its parent is alive


def pool_context() -> multiprocessing.context.BaseContext:
    """"fork" on Linux while this process runs one thread, else "spawn".

    fork starts workers in milliseconds and shares what the parent has loaded (a tokenizer),
    but copying a process that runs other threads (torch, tqdm's monitor) can leave a lock held
    in the child. So take the context before starting any thread, e.g. before a progress bar.
    """
    if sys.platform == "linux" and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def die_with_parent(parent_pid: int) -> None:
    """Make the calling process exit when ``parent_pid``, its parent, is gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still stops the worker
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before this worker could watch it
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCHDOG_SECONDS)
    os._exit(1)


def _init_worker(parent_pid: int | None, initializer: Callable[..., Any] | None, initargs: tuple) -> None:
    if parent_pid is not None:
        die_with_parent(parent_pid)
    if initializer is not None:
        initializer(*initargs)


@contextlib.contextmanager
def worker_pool(workers: int, context: multiprocessing.context.BaseContext, *,
                initializer: Callable[..., Any] | None = None, initargs: tuple = ()) -> Iterator[ProcessPoolExecutor]:
    """A ``ProcessPoolExecutor`` whose workers die with this process (see the module docstring).

    On a normal exit the pool shuts down as usual; on an exception its workers are killed
    at once rather than left to finish their running tasks. With a ``forkserver`` context the
    workers are the server's children and are not tied to this process.
    """
    # A forkserver's workers are its children, not ours: they cannot watch this process.
    parent = os.getpid() if context.get_start_method() in ("fork", "spawn") else None
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                               initargs=(parent, initializer, initargs))
    try:
        yield pool
    except BaseException:
        _terminate(pool)
        raise
    pool.shutdown(wait=True)


def _terminate(pool: ProcessPoolExecutor) -> None:
    """Cancel pending tasks and kill the workers, without waiting for running tasks."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        with contextlib.suppress(Exception):
            process.kill()
    for process in processes:
        with contextlib.suppress(Exception):
            process.join(timeout=5)
