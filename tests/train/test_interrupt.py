"""Ctrl-C (SIGINT) and SIGTERM during training: the step in progress finishes, is checkpointed,
and the run resumes exactly; a second signal stops at once. The signals are real (sent to this
process with os.kill from inside the step), so the handlers the trainer installs are what runs.
The command line's exit codes and messages are tested in tests/cli/test_train_interrupt.py."""

import os
import signal
import threading
from dataclasses import replace

import pytest

from scratchlm.cli.train import run_training
from scratchlm.parallel.config import ParallelConfig
from scratchlm.train import checkpoint as ckpt
from scratchlm.train.data_feed import TrainData
from scratchlm.train.interrupt import TrainingInterrupted, stop_signals
from scratchlm.train.sweep import parse_grid, plan_sweep, point_status, run_sweep
from tests.train.small_runs import losses, make_cfg

pytestmark = pytest.mark.usefixtures("one_thread", "sigint_handled")


@pytest.fixture
def cfg(tmp_path):
    return make_cfg(tmp_path)  # 12 steps, logs every step, checkpoints and evaluates every 4


def _with_out(cfg, out):
    return replace(cfg, trainer=replace(cfg.trainer, out_dir=str(out)))


def _signal_during_batch(monkeypatch, number, signum=signal.SIGINT):
    """Send `signum` to this process while `TrainData.next_batch` draws its `number`-th batch
    (with one micro-batch a step, inside step `number`, before its forward)."""
    calls = {"n": 0}
    real_next = TrainData.next_batch

    def next_batch(self, device):
        calls["n"] += 1
        if calls["n"] == number:
            os.kill(os.getpid(), signum)
        return real_next(self, device)

    monkeypatch.setattr(TrainData, "next_batch", next_batch)
    return real_next


# ---------------------------------------------------------------------------- the handlers alone


def test_stop_signals_notes_the_first_signal_raises_on_the_second_and_restores_the_handlers():
    def previous_int(signum, frame):
        raise AssertionError("the previous SIGINT handler must not run inside the block")

    old_int = signal.signal(signal.SIGINT, previous_int)
    old_term = signal.getsignal(signal.SIGTERM)
    try:
        with stop_signals() as signals:
            assert signals.signum is None
            signal.raise_signal(signal.SIGTERM)  # would end the process under the default action
            assert signals.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGINT) is previous_int
        assert signal.getsignal(signal.SIGTERM) == old_term

        # A second signal stops at once, with the exit code of the signal; the handlers come back.
        with pytest.raises(TrainingInterrupted, match="second SIGINT") as info:
            with stop_signals() as signals:
                signal.raise_signal(signal.SIGINT)
                assert signals.signum == signal.SIGINT
                signal.raise_signal(signal.SIGINT)
        assert isinstance(info.value, KeyboardInterrupt) and info.value.exit_code == 130
        assert signal.getsignal(signal.SIGINT) is previous_int
        assert signal.getsignal(signal.SIGTERM) == old_term
    finally:
        signal.signal(signal.SIGINT, old_int)


def test_stop_signals_leaves_ignored_signals_ignored_and_other_threads_alone():
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_signals() as signals:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert signals.signum is None
    finally:
        signal.signal(signal.SIGINT, old_int)

    seen = []

    def in_a_thread():
        with stop_signals() as signals:  # signal.signal would raise ValueError outside the main thread
            seen.append((signals.signum, signal.getsignal(signal.SIGINT)))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [(None, signal.default_int_handler)]


def test_exit_codes_are_those_of_the_signals():
    assert TrainingInterrupted("x", signum=signal.SIGINT).exit_code == 130
    assert TrainingInterrupted("x", signum=signal.SIGTERM).exit_code == 143


# ---------------------------------------------------------------------------- in the trainer


def test_a_signal_mid_step_finishes_the_step_checkpoints_it_and_resume_is_exact(cfg, tmp_path, monkeypatch):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    run_training(_with_out(cfg, straight))

    real_next = _signal_during_batch(monkeypatch, 6)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted) as info:
        run_training(_with_out(cfg, broken))
    assert signal.getsignal(signal.SIGINT) is handler  # put back once fit is done
    exc = info.value
    assert exc.signum == signal.SIGINT and exc.step == 6
    assert exc.checkpoint == broken / "checkpoints" / "step_000006" == ckpt.latest_step_dir(broken)
    assert f"at step 6; checkpoint saved to {exc.checkpoint}" in str(exc)
    assert f"scratchlm train {broken / 'config.toml'} --resume" in str(exc)
    # Step 6 is whole: logged as usual, no evaluation (the next is due at step 8), no "end".
    assert [s for s, _ in losses(broken)] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in losses(broken, "eval", "val_loss")] == [0, 4]
    assert losses(broken) == losses(straight)[:6]

    monkeypatch.setattr(TrainData, "next_batch", real_next)
    run_training(_with_out(cfg, broken), resume=True)
    assert losses(broken) == losses(straight)  # bitwise: the same updates, data and RNG
    assert losses(broken, "eval", "val_loss") == losses(straight, "eval", "val_loss")


def test_a_signal_at_a_step_with_an_evaluation_due_evaluates_it_on_resume(cfg, tmp_path, monkeypatch):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    run_training(_with_out(cfg, straight))
    real_next = _signal_during_batch(monkeypatch, 8, signal.SIGTERM)
    with pytest.raises(TrainingInterrupted) as info:
        run_training(_with_out(cfg, broken))
    assert info.value.step == 8 and info.value.exit_code == 143
    assert [s for s, _ in losses(broken, "eval", "val_loss")] == [0, 4]
    monkeypatch.setattr(TrainData, "next_batch", real_next)
    run_training(_with_out(cfg, broken), resume=True)
    assert losses(broken, "eval", "val_loss") == losses(straight, "eval", "val_loss")
    assert losses(broken) == losses(straight)


def test_a_second_signal_while_saving_stops_at_once_and_keeps_the_previous_checkpoint(cfg, tmp_path, monkeypatch):
    _signal_during_batch(monkeypatch, 6)
    real_write = ckpt.write_step_files
    writes = []

    def write_step_files(staging, **kwargs):
        writes.append(staging.name)
        if len(writes) == 2:  # the checkpoint of step 6, after the one of step 4
            os.kill(os.getpid(), signal.SIGINT)
        return real_write(staging, **kwargs)

    monkeypatch.setattr(ckpt, "write_step_files", write_step_files)
    with pytest.raises(TrainingInterrupted, match="second SIGINT") as info:
        run_training(cfg)
    assert info.value.checkpoint is None and info.value.exit_code == 130
    run = tmp_path / "run"
    assert writes == [".staging-step_000004", ".staging-step_000006"]
    assert ckpt.latest_step_dir(run).name == "step_000004"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupted_sweep_stops_and_its_rerun_resumes_the_point(tmp_path, monkeypatch):
    from scratchlm.config import save_config

    preset = tmp_path / "tiny.toml"
    save_config(make_cfg(tmp_path, max_steps=4, eval_interval=2, checkpoint_interval=2), preset)
    out = tmp_path / "sweep"
    points = plan_sweep(preset, [], parse_grid(["optim.lr=1e-2,3e-3"]), out)
    real_next = _signal_during_batch(monkeypatch, 3)
    lines = []
    with pytest.raises(TrainingInterrupted, match="point 1/2 .* at step 3 .*rerun the same command") as info:
        run_sweep(points, out, echo=lines.append)
    assert info.value.exit_code == 130
    assert not points[1].run_dir.exists()  # the sweep stopped rather than going on to point 2
    assert point_status(points[0]) == "unfinished" and not (out / "summary.jsonl").exists()
    assert ckpt.latest_step_dir(points[0].run_dir).name == "step_000003"

    monkeypatch.setattr(TrainData, "next_batch", real_next)
    rows = run_sweep(points, out, echo=lines.append)
    assert [r["finished"] for r in rows] == [True, True] and not any("error" in r for r in rows)
    assert [s for s, _ in losses(points[0].run_dir)] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------- two ranks


def _rank_0_signalled_at_step_3(rank, world_size, cfg):
    from scratchlm.parallel.strategy import init_strategy
    from scratchlm.train.trainer import Trainer

    if rank == 0:
        real_next = TrainData.next_batch
        calls = {"n": 0}

        def next_batch(self, device):
            calls["n"] += 1
            if calls["n"] == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return real_next(self, device)

        TrainData.next_batch = next_batch
    trainer = Trainer(cfg, cfg.trainer.out_dir, strategy=init_strategy(cfg.parallel, device="cpu"))
    try:
        trainer.fit()
    except TrainingInterrupted as exc:
        return {"step": exc.step, "signum": exc.signum, "checkpoint": str(exc.checkpoint)}
    finally:
        trainer.logger.close()
    return {"step": trainer.step, "signum": None, "checkpoint": None}


@pytest.mark.distributed
def test_ranks_agree_to_stop_at_the_step_one_of_them_was_signalled_at(tmp_path):
    # Without the agreement rank 0 would write its checkpoint (barriers) while rank 1 trains on
    # (gradient all-reduces): a hang, here a collective timeout.
    from scratchlm.parallel.launch import spawn

    cfg = make_cfg(tmp_path, checkpoint_interval=0, eval_interval=0)
    cfg = replace(cfg, parallel=ParallelConfig(strategy="ddp", backend="gloo", timeout_s=60))
    results = spawn(_rank_0_signalled_at_step_3, 2, args=(cfg,), timeout_s=120)
    expected = str(tmp_path / "run" / "checkpoints" / "step_000003")
    assert results == [{"step": 3, "signum": signal.SIGTERM, "checkpoint": expected}] * 2
    assert ckpt.latest_step_dir(tmp_path / "run").name == "step_000003"
    assert [s for s, _ in losses(tmp_path / "run")] == [1, 2, 3]
