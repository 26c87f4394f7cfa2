"""`scratchlm train` in a real process stopped by Ctrl-C (SIGINT) or a scheduler's SIGTERM: it
exits 130 / 143 with one line naming the checkpoint of the step it stopped at, and `--resume`
continues from there. (The trainer's side is tested in-process in tests/train/test_interrupt.py.)"""

import re
import signal
from pathlib import Path

import pytest

from scratchlm.cli.train import train_command
from scratchlm.config import save_config
from scratchlm.train.checkpoint import latest_step_dir
from scratchlm.train.metrics import read_metrics
from tests.cli.processes import EXIT_TIMEOUT_S, scratchlm_process, wait_until
from tests.train.small_runs import losses, make_cfg

pytestmark = pytest.mark.usefixtures("one_thread")


def _training_args(tmp_path):
    """`train` on a tiny run far too long to finish."""
    cfg = make_cfg(tmp_path, max_steps=1_000_000, checkpoint_interval=0, eval_interval=0, eval_at_start=False,
                   deterministic=False)  # deterministic mode imports torch._dynamo: seconds
    config = tmp_path / "tiny.toml"
    save_config(cfg, config)
    return ["train", str(config)]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signalled_train_checkpoints_its_step_exits_with_the_signal_code_and_resumes(tmp_path, signum, code):
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    with scratchlm_process(tmp_path, _training_args(tmp_path)) as proc:
        # Once metrics.jsonl holds a train record, the loop and its signal handlers are running.
        wait_until(proc, lambda: metrics.is_file() and any(r.get("event") == "train" for r in read_metrics(metrics)),
                   "a train record")
        proc.send_signal(signum)
        returncode = proc.wait(timeout=EXIT_TIMEOUT_S)
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
