"""Worker processes of encode_corpus and train_bpe die with their parent, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

# Each script starts a pool of 2 workers whose task sleeps (it writes its pid first), so the
# workers are alive and busy when the parent is killed.
PRELUDE = """
import os, sys, time
from pathlib import Path
pids = Path(sys.argv[1])

def slow(*args, **kwargs):
    (pids / str(os.getpid())).write_text("")
    time.sleep(120)
"""

SCRIPTS = {
    "encode": PRELUDE + """
from scratchlm.tokenizer import encode_corpus as ec
from scratchlm.tokenizer.tokenizer import Tokenizer
ec._encode_chunk = slow
src = pids.parent / "corpus.txt"
src.write_text("hello world\\n" * 20_000)
tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
ec.encode_corpus(src, tok, pids.parent / "out.bin", num_workers=2, chunk_bytes=10_000, progress=False)
""",
    "train-bpe": PRELUDE + """
from scratchlm.tokenizer import train
train.count_pretokens_in_range = slow
train.SMALL_CORPUS_BYTES = 0
src = pids.parent / "corpus.txt"
src.write_text("hello world<|endoftext|>" * 20_000)
train.train_bpe(src, 300, ["<|endoftext|>"], workers=2)
""",
}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _start(tmp_path: Path, script: str) -> tuple[subprocess.Popen, list[int]]:
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    # SIGINT back to its default: a shell starting the tests in the background ignores it
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(pids)], env=env,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2:
        if parent.poll() is not None or time.monotonic() > deadline:
            parent.kill()
            pytest.fail("the workers did not start")
        time.sleep(0.05)
    return parent, [int(p.name) for p in pids.iterdir()]


@pytest.mark.parametrize("command", sorted(SCRIPTS))
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_workers_die_with_their_parent(tmp_path, command, sig):
    parent, workers = _start(tmp_path, SCRIPTS[command])
    try:
        os.kill(parent.pid, sig)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 5
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in workers if _alive(pid)], f"workers outlived the parent ({sig.name})"
    finally:
        parent.kill()
        for pid in workers:  # this test's own workers, if the assertion failed
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _square(x: int) -> int:
    return x * x


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_worker_pool_runs_tasks_with_every_start_method(method):
    import multiprocessing

    from scratchlm.tokenizer.worker_pool import worker_pool

    with worker_pool(2, multiprocessing.get_context(method)) as pool:
        assert list(pool.map(_square, range(5))) == [0, 1, 4, 9, 16]
