"""Shared test setup: GPU tests skip themselves when no CUDA device is present."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def shared_data() -> Path:
    """The read-only corpora beside the repository (``../shared/data``); skip when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture
def one_thread():
    """Tiny models run faster on one intra-op thread than on a contended pool; restored afterwards.
    Modules of tiny-model tests use it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _CutWriter:
    """A text or binary file whose write stores the first half of what it is given, then fails
    (a full disk)."""

    def __init__(self, f) -> None:
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")


@pytest.fixture
def sigint_handled():
    """SIGINT handled as Python's default (KeyboardInterrupt) for the test, whatever the runner
    inherited: a non-interactive shell starts a background job with SIGINT ignored, and
    `StopSignals` leaves an ignored signal ignored. Restored afterwards."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def cut_writes(monkeypatch):
    """`cut_writes(after=0)`: from then on, the writes of `scratchlm.fileio` (`write_text_atomic`,
    `atomic_open`) store half their data and fail, except the first `after` files, written whole."""
    import builtins

    from scratchlm import fileio

    def cut(after: int = 0) -> None:
        left = [after]

        def opener(*args, **kwargs):
            f = builtins.open(*args, **kwargs)
            if left[0] > 0:
                left[0] -= 1
                return f
            return _CutWriter(f)

        monkeypatch.setattr(fileio, "open", opener, raising=False)

    return cut
