"""A `python -m scratchlm ...` child process for the tests that signal a running command."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import scratchlm

STARTUP_TIMEOUT_S = 120  # importing torch on a loaded 2-core machine
EXIT_TIMEOUT_S = 60


@contextlib.contextmanager
def scratchlm_process(tmp_path: Path, args: list[str]) -> Iterator[subprocess.Popen]:
    """`python -m scratchlm ARGS` in `tmp_path`, stdout and stderr to tmp_path/stdout.txt and
    stderr.txt, one thread; killed on the way out if it still runs."""
    src = str(Path(scratchlm.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    stdout, stderr = open(tmp_path / "stdout.txt", "wb"), open(tmp_path / "stderr.txt", "wb")
    with stdout, stderr:
        # SIGINT back to its default: a shell starting the tests in the background ignores it, and
        # the command leaves an ignored signal ignored.
        proc = subprocess.Popen([sys.executable, "-m", "scratchlm", *args], stdout=stdout, stderr=stderr, env=env,
                                cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_until(proc: subprocess.Popen, ready: Callable[[], bool], what: str) -> None:
    """Return once `ready()`; fail if the process exits first or STARTUP_TIMEOUT_S pass."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the command exited with {proc.returncode} before {what}")
        if ready():
            return
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no {what} after {STARTUP_TIMEOUT_S} s")
