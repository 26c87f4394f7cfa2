"""Small training runs for the trainer's tests: a learnable token stream and a tiny config."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

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
