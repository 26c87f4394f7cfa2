"""Training for a wall-clock budget: the clock, the schedule over it, the stop, the final full
evaluation and the clock's resume. A fake clock that advances one second per micro-batch (and a
hundred per evaluation, which must not count) makes the runs exact."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from scratchlm.cli.train import run_training
from scratchlm.errors import UserError
from scratchlm.train import trainer as trainer_mod
from scratchlm.train.data_feed import TrainData
from scratchlm.train.metrics import read_metrics
from tests.train.small_runs import crash_at_step_7_then_resume, losses, make_cfg

BUDGET = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(trainer_mod, "_clock", fake)
    real_next, real_eval = TrainData.next_batch, trainer_mod.evaluation_totals

    def next_batch(self, device):
        fake.t += 1.0  # one second of training per micro-batch
        return real_next(self, device)

    def slow_eval(model, batches):
        fake.t += 100.0  # evaluations are off the clock
        return real_eval(model, batches)

    monkeypatch.setattr(TrainData, "next_batch", next_batch)
    monkeypatch.setattr(trainer_mod, "evaluation_totals", slow_eval)
    return fake


def budget_cfg(tmp_path, **trainer):
    cfg = make_cfg(tmp_path, max_steps=100, time_budget_s=BUDGET, final_eval_full=True, **trainer)
    return cfg


def expected_lr(cfg, step):
    """Warm-up over steps times the cosine over the fraction of the budget spent before the step."""
    oc = cfg.optim
    progress = (step - 1) / BUDGET  # step s starts after s - 1 seconds
    cosine = oc.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (oc.lr - oc.min_lr)
    return min(1.0, step / oc.warmup_steps) * cosine


def records(run, event):
    return [r for r in read_metrics(run / "metrics.jsonl") if r["event"] == event]


def test_a_budget_run_stops_on_time_with_the_schedule_over_the_budget(tmp_path, clock):
    cfg = budget_cfg(tmp_path)
    run_training(cfg)
    run = tmp_path / "run"
    train = records(run, "train")
    assert [r["step"] for r in train] == list(range(1, 11))  # 10 s at 1 s a step; max_steps is 100
    for r in train:
        assert r["lr"] == pytest.approx(expected_lr(cfg, r["step"]), rel=1e-12)
        assert r["elapsed_s"] == pytest.approx(r["step"])  # evaluations (100 s each) did not count
        assert r["tokens"] == r["step"] * cfg.trainer.batch_size * cfg.model.context_length
    assert train[-1]["lr"] < 1.25 * cfg.optim.min_lr  # the last step starts at 9 s of 10: near the floor
    evals = records(run, "eval")
    assert [r["step"] for r in evals] == [0, 4, 8, 10]
    window = cfg.model.context_length
    # eval_batches x batch_size windows, except the final one: the whole validation file
    assert [r["val_tokens"] for r in evals] == [2 * 4 * window] * 3 + [(1000 - 1) // window * window]
    assert evals[-1]["tokens_per_s"] == pytest.approx(evals[-1]["tokens"] / 10.0)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000010"
    assert records(run, "end")[0]["step"] == 10


def test_max_steps_still_caps_a_budget_run(tmp_path, clock):
    cfg = budget_cfg(tmp_path)
    cfg = replace(cfg, trainer=replace(cfg.trainer, max_steps=6))
    run_training(cfg)
    run = tmp_path / "run"
    assert [r["step"] for r in records(run, "train")][-1] == 6
    assert records(run, "eval")[-1]["val_tokens"] == (1000 - 1) // 16 * 16  # final, so full


def test_a_resumed_budget_run_continues_its_clock(tmp_path, clock, monkeypatch):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    cfg = budget_cfg(tmp_path)
    run_training(replace(cfg, trainer=replace(cfg.trainer, out_dir=str(straight))))

    def time_passes():
        clock.t += 5000.0  # the time the run was down is not training time

    crash_at_step_7_then_resume(cfg, broken, monkeypatch, after_crash=time_passes)
    # resumed from step 4 at 4 s: the same 10 steps, rates and (deterministic) losses
    assert losses(broken) == losses(straight)
    assert losses(broken, key="lr") == losses(straight, key="lr")
    assert losses(broken, key="elapsed_s") == losses(straight, key="elapsed_s")


def test_a_spent_budget_trains_no_more_on_resume(tmp_path, clock):
    cfg = budget_cfg(tmp_path)
    run_training(cfg)
    run_training(cfg, resume=True)
    assert [r["step"] for r in records(tmp_path / "run", "train")][-1] == 10


def test_cosine_steps_and_a_time_budget_are_refused_together(tmp_path):
    cfg = budget_cfg(tmp_path)
    cfg = replace(cfg, optim=replace(cfg.optim, cosine_steps=50))
    with pytest.raises(UserError, match="cosine_steps"):
        run_training(cfg)


def test_an_infinite_budget_is_refused():
    """It trained to max_steps with the learning rate never decaying (elapsed / inf = 0)."""
    from scratchlm.config import load_config
    from scratchlm.train.config import TrainConfig

    with pytest.raises(UserError, match="trainer.time_budget_s must be a finite number >= 0 .*got inf"):
        load_config(TrainConfig, None, ["--trainer.time_budget_s=inf"])


def test_without_a_budget_every_record_has_the_clock_and_the_final_eval_is_partial(tmp_path):
    cfg = make_cfg(tmp_path, max_steps=4, eval_interval=0)
    run_training(cfg)
    run = tmp_path / "run"
    train = records(run, "train")
    assert all(r["elapsed_s"] > 0 for r in train)
    assert [r["elapsed_s"] for r in train] == sorted(r["elapsed_s"] for r in train)
    assert records(run, "eval")[-1]["val_tokens"] == 2 * 4 * 16


def test_a_run_that_crashed_after_its_last_checkpoint_finishes_on_resume(tmp_path, clock, monkeypatch):
    # The budget ran out, the final checkpoint was written, then the final evaluation failed:
    # resuming has nothing left to train but must still evaluate and finish (the "end" record,
    # which `scratchlm sweep` reads to skip the point next time).
    cfg = budget_cfg(tmp_path)
    real_eval = trainer_mod.evaluation_totals
    calls = {"n": 0}

    def fails_at_the_final_eval(model, batches):
        calls["n"] += 1
        if calls["n"] == 4:  # steps 0, 4, 8, then the final one at step 10
            raise RuntimeError("node lost")
        return real_eval(model, batches)

    monkeypatch.setattr(trainer_mod, "evaluation_totals", fails_at_the_final_eval)
    with pytest.raises(RuntimeError, match="node lost"):
        run_training(cfg)
    run = tmp_path / "run"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000010"
    assert records(run, "end") == []
    monkeypatch.setattr(trainer_mod, "evaluation_totals", real_eval)
    run_training(cfg, resume=True)
    assert [r["step"] for r in records(run, "train")][-1] == 10  # nothing more trained
    assert records(run, "eval")[-1]["step"] == 10
    assert [r["step"] for r in records(run, "end")] == [10]
