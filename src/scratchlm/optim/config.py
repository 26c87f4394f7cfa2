"""Optimizer, learning-rate schedule and clipping options."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimConfig:
    lr: float = 1e-3  # peak learning rate after warm-up
    min_lr: float = 1e-4  # floor reached at the end of the cosine
    warmup_steps: int = 100  # linear warm-up from 0
    cosine_steps: int | None = None  # end of the cosine; None = trainer.max_steps
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled (AdamW) decay
    grad_clip: float = 1.0  # global L2 norm; 0 disables clipping
