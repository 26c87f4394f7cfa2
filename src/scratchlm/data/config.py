"""Where the training data and tokenizer live."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    """Token files written by ``scratchlm encode`` (``X.bin`` beside its ``X.json`` sidecar) and
    the tokenizer they were encoded with. Batch size and sampler seed live in the trainer's
    config, so one data section serves every model shape."""

    train_path: str = ""  # token file (.bin with a .json sidecar) to train on
    val_path: str = ""  # held-out token file for validation loss; empty = no validation
    tokenizer_dir: str = ""  # tokenizer directory copied into the run (for sampling/export)
