"""`scratchlm train` in a real process stopped by Ctrl-C (SIGINT) or a scheduler's SIGTERM: it
exits 130 / 143 with one line naming the checkpoint of the step it stopped at, and `--resume`
continues from there. (The trainer's side is tested in-process in tests/train/test_interrupt.py.)"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import scratchlm
from scratchlm.cli.train import train_command
from scratchlm.config import save_config
from scratchlm.train.checkpoint import latest_step_dir
from scratchlm.train.metrics import read_metrics
from tests.train.small_runs import losses, make_cfg

pytestmark = pytest.mark.usefixtures("one_thread")

STARTUP_TIMEOUT_S = 120  # importing torch on a loaded 2-core machine
EXIT_TIMEOUT_S = 60


def _start_training(tmp_path):
    """`python -m scratchlm train` on a tiny run far too long to finish, stdout and stderr to files."""
    cfg = make_cfg(tmp_path, max_steps=1_000_000, checkpoint_interval=0, eval_interval=0, eval_at_start=False,
                   deterministic=False)  # deterministic mode imports torch._dynamo: seconds
    config = tmp_path / "tiny.toml"
    save_config(cfg, config)
    src = str(Path(scratchlm.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    stdout, stderr = open(tmp_path / "stdout.txt", "wb"), open(tmp_path / "stderr.txt", "wb")
    with stdout, stderr:
        proc = subprocess.Popen([sys.executable, "-m", "scratchlm", "train", str(config)],
                                stdout=stdout, stderr=stderr, env=env, cwd=tmp_path)
    return proc, tmp_path / "run"


def _wait_until_training(proc, run):
    """Return once metrics.jsonl holds a train record (the loop, and its signal handlers, are running)."""
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"training exited with {proc.returncode} before it logged a step")
        if metrics.is_file() and any(r.get("event") == "train" for r in read_metrics(metrics)):
            return
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no train record in {metrics} after {STARTUP_TIMEOUT_S} s")


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signalled_train_checkpoints_its_step_exits_with_the_signal_code_and_resumes(tmp_path, signum, code):
    proc, run = _start_training(tmp_path)
    try:
        _wait_until_training(proc, run)
        proc.send_signal(signum)
        returncode = proc.wait(timeout=EXIT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert returncode == code, stderr
    last = stderr.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    match = re.fullmatch(rf"scratchlm train: interrupted by {name} at step (\d+); checkpoint saved to (.+), "
                         rf"resume with: scratchlm train (.+) --resume", last)
    assert match, stderr
    step, checkpoint, config = int(match[1]), Path(match[2]), match[3]
    assert checkpoint == run / "checkpoints" / f"step_{step:06d}" == latest_step_dir(run)
    assert Path(config) == run / "config.toml"
    assert [s for s, _ in losses(run)] == list(range(1, step + 1))
    assert not any(r["event"] == "end" for r in read_metrics(run / "metrics.jsonl"))

    # The command it prints continues from that step (here to two steps further).
    assert train_command([config, "--resume", f"--trainer.max_steps={step + 2}"]) == 0
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if r["event"] == "resume"] == [step]
    assert [s for s, _ in losses(run)] == list(range(1, step + 3))
    assert records[-1] == {"event": "end", "step": step + 2}
