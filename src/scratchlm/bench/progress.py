"""Progress of a long, silent loop (a benchmark's steps), reported from a background thread.

The loop only bumps a counter (`StepCounter.wrap`, an integer add: nothing that would perturb a timed
step); a thread reports it on stderr: a tqdm bar on a terminal, and in a log or a pipe one line
every `every_s` seconds, so a CPU run of a GPU-sized model is never silent for minutes.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO


class StepCounter:
    """A counter the loop bumps; `wrap(fn)` counts each call of `fn`."""

    def __init__(self) -> None:
        self.count = 0

    def wrap(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        def counted() -> Any:
            out = fn()
            self.count += 1
            return out

        return counted


@contextmanager
def reported(label: str, total: int, *, every_s: float = 10.0, stream: TextIO | None = None) -> Iterator[StepCounter]:
    """Report `label: n/total steps` while the block runs (see the module docstring)."""
    stream = stream if stream is not None else sys.stderr
    counter = StepCounter()
    stop = threading.Event()
    interactive = hasattr(stream, "isatty") and stream.isatty()
    start = time.monotonic()

    def report() -> None:
        if interactive:
            from tqdm import tqdm

            with tqdm(total=total, desc=label, unit="step", file=stream, leave=False) as bar:
                while not stop.wait(0.5):
                    bar.update(counter.count - bar.n)
            return
        while not stop.wait(every_s):
            print(f"{label}: {counter.count}/{total} steps ({time.monotonic() - start:.0f} s)", file=stream, flush=True)

    thread = threading.Thread(target=report, name=f"progress-{label}", daemon=True)
    thread.start()
    try:
        yield counter
    finally:
        stop.set()
        thread.join()
