"""The local process launcher used by tests and benchmarks."""

from __future__ import annotations

import pytest

from scratchlm.parallel.launch import WorkerError, spawn
from scratchlm.parallel.process_group import find_free_port


def _fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_free_port_is_bindable():
    import socket

    port = find_free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.distributed
def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(WorkerError, match="boom on rank 1"):
        spawn(_fail_on_rank_one, 2, timeout_s=60)
