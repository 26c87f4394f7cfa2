"""Where the training data and tokenizer live."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    train_path: str = ""  # token file (.bin with a .json sidecar) to train on
    val_path: str = ""  # held-out token file for validation loss; empty = no validation
    tokenizer_dir: str = ""  # tokenizer directory copied into the run (for sampling/export)
