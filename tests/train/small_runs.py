"""Small training runs for the trainer's tests: a learnable token stream and a tiny config."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from scratchlm.config import load_config
from scratchlm.train.config import TrainConfig
from scratchlm.train.metrics import read_metrics

VOCAB = 48


def write_tokens(path, n, seed, *, vocab_size=VOCAB, tokenizer_hash=""):
    """A learnable stream (a noisy counter modulo VOCAB) as a uint16 token file with its sidecar."""
    rng = np.random.default_rng(seed)
    ids = (np.arange(n) + (rng.random(n) < 0.1) * rng.integers(0, VOCAB, n)) % VOCAB
    ids.astype(np.uint16).tofile(path)
    path.with_suffix(".json").write_text(json.dumps(
        {"dtype": "uint16", "vocab_size": vocab_size, "tokenizer_hash": tokenizer_hash,
         "num_documents": 1, "num_tokens": n}))
    return str(path)


def make_cfg(tmp_path, **trainer) -> TrainConfig:
    train = write_tokens(tmp_path / "train.bin", 4000, 0)
    val = write_tokens(tmp_path / "val.bin", 1000, 1)
    cfg = load_config(TrainConfig, None, [
        f"--data.train_path={train}", f"--data.val_path={val}",
        f"--model.vocab_size={VOCAB}", "--model.context_length=16", "--model.d_model=32",
        "--model.num_layers=2", "--model.num_heads=4", "--model.d_ff=48",
        "--optim.lr=1e-2", "--optim.min_lr=1e-3", "--optim.warmup_steps=2",
        f"--trainer.out_dir={tmp_path / 'run'}", "--trainer.batch_size=4", "--trainer.max_steps=12",
        "--trainer.log_interval=1", "--trainer.eval_interval=4", "--trainer.eval_batches=2",
        "--trainer.checkpoint_interval=4", "--trainer.keep_checkpoints=2", "--trainer.device=cpu",
        "--trainer.deterministic=true", "--trainer.progress=false",
    ])
    return replace(cfg, trainer=replace(cfg.trainer, **trainer))


def losses(run_dir, event="train", key="loss"):
    """(step, value) of each `event` record of a run's metrics.jsonl."""
    return [(r["step"], r[key]) for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] == event]


def crash_at_step_7_then_resume(cfg, broken, monkeypatch, after_crash=None) -> None:
    """Train `cfg` into `broken`, lose the process at step 7, then resume it to the end.

    The crash is the 7th `TrainData.next_batch` call (after the checkpoint at step 4 and two
    logged steps past it); `after_crash`, when given, runs between the crash and the resume."""
    from scratchlm.cli.train import run_training
    from scratchlm.train.data_feed import TrainData

    broken_cfg = replace(cfg, trainer=replace(cfg.trainer, out_dir=str(broken)))
    calls = {"n": 0}
    real_next = TrainData.next_batch

    def crash_at_step_7(self, device):
        calls["n"] += 1
        if calls["n"] == 7:
            raise RuntimeError("node lost")
        return real_next(self, device)

    monkeypatch.setattr(TrainData, "next_batch", crash_at_step_7)
    with pytest.raises(RuntimeError, match="node lost"):
        run_training(broken_cfg)
    if after_crash is not None:
        after_crash()
    monkeypatch.setattr(TrainData, "next_batch", real_next)
    run_training(broken_cfg, resume=True)
