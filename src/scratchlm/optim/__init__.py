"""Optimizer, learning-rate schedules and gradient clipping, from tensor primitives.

`build_optimizer` and `learning_rate` turn an `OptimConfig` into the objects the trainer uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from scratchlm.optim.adamw import AdamW
    from scratchlm.optim.config import OptimConfig


def build_optimizer(model: "torch.nn.Module", cfg: "OptimConfig") -> "AdamW":
    """AdamW over `model`'s trainable parameters, decaying matrices only unless `cfg.decay_vectors`."""
    from scratchlm.optim.adamw import AdamW, param_groups

    groups = param_groups(model, cfg.weight_decay, decay_vectors=cfg.decay_vectors)
    return AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                 weight_decay=cfg.weight_decay, foreach=cfg.foreach, fused=cfg.fused)


def learning_rate(cfg: "OptimConfig", step: int, max_steps: int, *, progress: float | None = None) -> float:
    """The learning rate of optimizer step `step` (0-based) under `cfg`'s schedule.

    `progress` (the fraction of a time budget spent, see `schedule.budget_lr`) makes the decay
    follow it instead of step / max_steps; the warm-up stays in steps.
    """
    import functools

    from scratchlm.optim.schedule import SCHEDULES, budget_lr

    schedule = SCHEDULES[cfg.schedule]
    if cfg.schedule == "wsd":
        schedule = functools.partial(schedule, decay_fraction=cfg.decay_fraction, shape=cfg.decay_shape)
    if progress is not None:
        return budget_lr(schedule, step, progress, cfg.lr, cfg.min_lr, cfg.warmup_steps)
    decay_end = cfg.cosine_steps if cfg.cosine_steps is not None else max_steps
    return schedule(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, decay_end)
