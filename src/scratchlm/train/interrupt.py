"""Stopping a training run cleanly on Ctrl-C (SIGINT) or a scheduler's SIGTERM.

Python's default reactions lose work: SIGINT raises KeyboardInterrupt wherever the loop happens
to be (possibly between a backward and its optimizer step), and SIGTERM ends the process with no
clean-up at all. While training, `stop_signals` replaces both handlers with one that only notes
the signal; the trainer looks at the note after each optimizer step, writes a checkpoint at that
step through the normal atomic path and raises `TrainingInterrupted`. A second signal raises at
once, so a user who presses Ctrl-C again is never held up by a slow save (a checkpoint cut short
stays in its staging folder and never becomes `latest`).

`TrainingInterrupted` is a `KeyboardInterrupt`, so code that catches only `Exception` (a sweep
that goes on after a failed point) lets it through and stops, and ``scratchlm`` prints its
message and exits with 128 + the signal number: 130 for SIGINT, 143 for SIGTERM.

The post-training commands stop the same way, saving their policy and training state where the
trainer writes a checkpoint (`scratchlm.align.interrupt`); `stop_signals`' `stops_after` and
`second_loses` make the handlers' lines say so.

Handlers can only be set in the main thread; elsewhere `stop_signals` watches nothing. A signal
the process ignores (SIG_IGN, as a non-interactive shell sets SIGINT for a background job) stays
ignored, and the previous handlers are back when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["StopSignals", "TrainingInterrupted", "signal_name", "stop_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    """``signal_name(2) == "SIGINT"``."""
    return signal.Signals(signum).name


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on signal `signum`; `step` and `checkpoint` are where it stopped and what it
    saved (None when a second signal stopped it before the checkpoint was written)."""

    def __init__(self, message: str, *, signum: int, step: int | None = None,
                 checkpoint: Path | None = None) -> None:
        super().__init__(message)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


# What the trainer's lines say: where the first signal stops, and what a second one loses.
STOPS_AFTER = "this step, once its checkpoint is written"
SECOND_LOSES = "without a checkpoint of the step in progress (--resume continues from the previous one)"


class StopSignals:
    """The note `stop_signals` keeps: `signum` is the first signal received (None until one comes)."""

    def __init__(self, *, announce: bool = False, stops_after: str = STOPS_AFTER,
                 second_loses: str = SECOND_LOSES) -> None:
        self.signum: int | None = None
        self._announce = announce
        self._stops_after, self._second_loses = stops_after, second_loses

    def _handle(self, signum: int, frame: object) -> None:
        name = signal_name(signum)
        if self.signum is not None:
            raise TrainingInterrupted(f"stopped at once by a second {name}, {self._second_loses}", signum=signum)
        self.signum = signum
        if self._announce:
            # os.write to fd 2, not print: the handler may run in the middle of a write to sys.stderr.
            with contextlib.suppress(OSError):
                os.write(2, f"received {name}: stopping after {self._stops_after} "
                            f"(send it again to stop at once)\n".encode())


@contextlib.contextmanager
def stop_signals(signums: Sequence[int] = STOP_SIGNALS, *, announce: bool = False, stops_after: str = STOPS_AFTER,
                 second_loses: str = SECOND_LOSES) -> Iterator[StopSignals]:
    """Inside the block, `signums` only set the yielded note's `signum` (a second one raises
    `TrainingInterrupted`); the previous handlers are restored on the way out. `announce` writes
    a line to stderr when the first signal arrives, saying the run stops after `stops_after`;
    a second signal's message says what stopping at once gives up (`second_loses`).

        with stop_signals() as signals:
            while not done and signals.signum is None:
                step()
    """
    note = StopSignals(announce=announce, stops_after=stops_after, second_loses=second_loses)
    previous = {}
    try:
        if threading.current_thread() is threading.main_thread():
            for signum in signums:
                handler = signal.getsignal(signum)
                # Leave ignored signals ignored, and handlers set outside Python (None) alone,
                # since they could not be put back.
                if handler is not None and handler != signal.SIG_IGN:
                    previous[signum] = signal.signal(signum, note._handle)
        yield note
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
