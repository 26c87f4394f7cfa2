"""Learning-rate schedules: plain functions of the iteration number, so they are trivially
resumable (no scheduler state to checkpoint) and the trainer just sets each group's `lr`.

Every schedule has the signature ``(it, max_lr, min_lr, warmup_iters, decay_end)`` and accepts
a float ``it``: `budget_lr` evaluates one over progress in [0, 1] (the fraction of a time budget
spent) with ``warmup_iters=0, decay_end=1.0``, and puts the warm-up, still counted in steps, in
front of it as a factor.
"""

from __future__ import annotations

import math


def cosine_lr(it: int, max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int) -> float:
    """Linear warm-up from 0 to `max_lr` over `warmup_iters`, cosine decay to `min_lr` at
    `cosine_cycle_iters`, then `min_lr`.

        it < warmup_iters:                        max_lr · it / warmup_iters
        warmup_iters <= it <= cosine_cycle_iters: min_lr + ½ (1 + cos(π · (it − Tw) / (Tc − Tw))) (max_lr − min_lr)
        it > cosine_cycle_iters:                  min_lr

    Example: cosine_lr(0, 1.0, 0.1, 10, 100) == 0.0; cosine_lr(10, 1.0, 0.1, 10, 100) == 1.0;
    cosine_lr(100, 1.0, 0.1, 10, 100) == 0.1.
    """
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    if it > cosine_cycle_iters:
        return min_lr
    span = cosine_cycle_iters - warmup_iters
    if span <= 0:  # no decay phase: the peak is the whole schedule up to cosine_cycle_iters
        return max_lr
    progress = (it - warmup_iters) / span
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def constant_lr(it: int, max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int) -> float:
    """Linear warm-up to `max_lr`, then constant (same signature as `cosine_lr`)."""
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    return max_lr


def linear_lr(it: int, max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int) -> float:
    """Linear warm-up, then linear decay to `min_lr` at `cosine_cycle_iters` (same signature)."""
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    if it >= cosine_cycle_iters:
        return min_lr
    progress = (it - warmup_iters) / (cosine_cycle_iters - warmup_iters)
    return max_lr + progress * (min_lr - max_lr)


WSD_SHAPES = ("linear", "1-sqrt")


def wsd_lr(it: float, max_lr: float, min_lr: float, warmup_iters: float, decay_end: float, *,
           decay_fraction: float = 0.2, shape: str = "linear") -> float:
    """Warmup-stable-decay: linear warm-up, `max_lr` until the last `decay_fraction` of
    `decay_end`, then a decay to `min_lr` at `decay_end` (same signature as `cosine_lr`, plus the
    decay's fraction and shape). With Ts = max(Tw, (1 − f) · Te) and p = (it − Ts) / (Te − Ts):

        "linear": max_lr + p · (min_lr − max_lr)
        "1-sqrt": min_lr + (1 − √p) · (max_lr − min_lr)   (drops faster at first)

    The stable phase needs no end in advance, so a run can be extended and decayed later; the
    short final decay recovers most of what cosine gives (Hägele et al., 2024).
    Example: wsd_lr(90, 1.0, 0.0, 10, 100, decay_fraction=0.2) == 0.5.
    """
    if shape not in WSD_SHAPES:
        raise ValueError(f"unknown WSD decay shape {shape!r}; choose one of {', '.join(WSD_SHAPES)}")
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    if it >= decay_end:
        return min_lr
    decay_start = max(warmup_iters, (1.0 - decay_fraction) * decay_end)
    if it <= decay_start:
        return max_lr
    progress = (it - decay_start) / (decay_end - decay_start)
    if shape == "linear":
        return max_lr + progress * (min_lr - max_lr)
    return min_lr + (1.0 - math.sqrt(progress)) * (max_lr - min_lr)


SCHEDULES = {"cosine": cosine_lr, "constant": constant_lr, "linear": linear_lr, "wsd": wsd_lr}


def budget_lr(schedule, step: int, progress: float, max_lr: float, min_lr: float, warmup_iters: int) -> float:
    """The rate of `schedule` when the run is measured in time, not steps.

        min(1, step / warmup_iters) · schedule(progress, max_lr, min_lr, 0, 1.0)

    `progress` is elapsed / budget (clamped to [0, 1]): the decay ends when the budget does,
    whatever number of steps that turns out to be. The warm-up stays in steps (a count of
    updates is what it is for) and scales the rate, so the schedule needs no state: no record of
    when the warm-up ended. Example: budget_lr(cosine_lr, 5, 0.5, 1.0, 0.0, 10) == 0.25.
    """
    warm = min(1.0, step / warmup_iters) if warmup_iters > 0 else 1.0
    return warm * schedule(min(max(progress, 0.0), 1.0), max_lr, min_lr, 0, 1.0)
