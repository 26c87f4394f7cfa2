"""Sequence-length warm-up: the window schedule, the same tokens in shorter windows, resume."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from scratchlm.cli.train import run_training
from scratchlm.errors import UserError
from scratchlm.train import trainer as trainer_mod
from scratchlm.train.data_feed import TrainData
from scratchlm.train.trainer import split_windows, warmup_seq_len
from tests.train.small_runs import crash_at_step_7_then_resume, losses, make_cfg


def test_window_lengths_grow_in_four_stages_to_the_context():
    assert [warmup_seq_len(s, 16, 8) for s in range(1, 11)] == [2, 2, 4, 4, 8, 8, 16, 16, 16, 16]
    assert [warmup_seq_len(s, 1024, 100) for s in (1, 25, 26, 50, 51, 75, 76, 100, 101)] == \
        [128, 128, 256, 256, 512, 512, 1024, 1024, 1024]
    assert warmup_seq_len(1, 64, 0) == 64


def test_split_windows_keeps_every_token_with_its_target():
    x = torch.arange(24).reshape(2, 12)
    y = x + 1  # the targets of a window are its tokens shifted by one
    xs, ys = split_windows(x, y, 3)
    assert xs.shape == (8, 3) and torch.equal(ys, xs + 1)
    assert torch.equal(xs.reshape(2, 12), x)
    assert split_windows(x, y, 12)[0] is x


def test_the_trainer_feeds_short_windows_first(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, seq_len_warmup_steps=8, max_steps=10)
    shapes, batches = [], []
    real_loss, real_next = trainer_mod.Trainer._loss, TrainData.next_batch

    def record_loss(self, x, y):
        shapes.append(tuple(x.shape))
        assert torch.equal(x.reshape(-1), batches[-1].reshape(-1))  # the sampled tokens, reshaped
        return real_loss(self, x, y)

    def record_batch(self, device):
        x, y = real_next(self, device)
        batches.append(x)
        return x, y

    monkeypatch.setattr(trainer_mod.Trainer, "_loss", record_loss)
    monkeypatch.setattr(TrainData, "next_batch", record_batch)
    run_training(cfg)
    B, T = cfg.trainer.batch_size, cfg.model.context_length
    lengths = [2, 2, 4, 4, 8, 8, 16, 16, 16, 16]
    assert shapes == [(B * T // n, n) for n in lengths]
    evals = losses(tmp_path / "run", "eval", "val_loss")
    assert evals[-1][1] < evals[0][1] - 0.3


def test_a_warmup_run_resumes_bitwise(tmp_path, monkeypatch):
    cfg = make_cfg(tmp_path, seq_len_warmup_steps=8)  # the checkpoint at step 4 is mid-warm-up
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    run_training(replace(cfg, trainer=replace(cfg.trainer, out_dir=str(straight))))
    crash_at_step_7_then_resume(cfg, broken, monkeypatch)
    assert losses(broken) == losses(straight)


def test_a_context_that_does_not_divide_by_8_is_refused(tmp_path):
    cfg = make_cfg(tmp_path, seq_len_warmup_steps=4)
    cfg = replace(cfg, model=replace(cfg.model, context_length=12))
    with pytest.raises(UserError, match="divide by 8"):
        run_training(cfg)
