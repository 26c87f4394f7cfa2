"""Optimizer, learning-rate schedules and gradient clipping, from tensor primitives.

`build_optimizer` and `learning_rate` turn an `OptimConfig` into the objects the trainer uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from scratchlm.optim.adamw import AdamW
    from scratchlm.optim.config import OptimConfig


def build_optimizer(model: "torch.nn.Module", cfg: "OptimConfig") -> "torch.optim.Optimizer":
    """`cfg.name`'s optimizer over `model`'s trainable parameters (a plain model, not a wrapper).

    "adamw": AdamW, decaying matrices only unless `cfg.decay_vectors`. "muon": Muon for the
    blocks' matrices and AdamW for the rest, in one optimizer (`optimizer_spec`).
    """
    optimizer_cls, groups, kwargs = optimizer_spec(cfg)
    return optimizer_cls(groups(model), **kwargs)


def optimizer_spec(cfg: "OptimConfig"):
    """(optimizer class, plain model -> parameter groups, keyword arguments) of `cfg`: what a
    strategy's `build_optimizer(model, cls, params=groups, **kwargs)` takes."""
    from scratchlm.optim.adamw import AdamW, param_groups

    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                  foreach=cfg.foreach, fused=cfg.fused)
    if cfg.name == "muon":
        from scratchlm.optim.muon import Muon, muon_param_groups

        def muon_groups(plain):
            return muon_param_groups(plain, cfg.weight_decay, lr=cfg.lr, muon_lr=cfg.muon_lr,
                                     decay_vectors=cfg.decay_vectors)

        return Muon, muon_groups, {**kwargs, "momentum": cfg.muon_momentum}

    def adamw_groups(plain):
        return param_groups(plain, cfg.weight_decay, decay_vectors=cfg.decay_vectors)

    return AdamW, adamw_groups, kwargs


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
