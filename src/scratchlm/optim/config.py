"""Optimizer, learning-rate schedule and clipping options."""

from __future__ import annotations

import math
from dataclasses import dataclass

from scratchlm.config import changed_fields, settings_text

OPTIMIZER_NAMES = ("adamw", "muon")
SCHEDULE_NAMES = ("cosine", "linear", "constant", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt")


@dataclass
class OptimConfig:
    # "adamw", or "muon": Muon (scratchlm.optim.muon) for the 2-D weights of the blocks, AdamW for
    # embeddings, lm_head and norm gains. Muon's updates are scaled to AdamW's RMS, so lr, the
    # schedule and weight_decay carry over; single-process and DDP-style runs (not zero1/fsdp).
    name: str = "adamw"
    muon_lr: float | None = None  # muon: peak rate of the Muon matrices; None = optim.lr
    muon_momentum: float = 0.95  # muon: Nesterov momentum of the Muon matrices
    lr: float = 1e-3  # peak learning rate after warm-up
    min_lr: float = 1e-4  # floor reached at the end of the decay (cosine/linear)
    warmup_steps: int = 100  # linear warm-up from 0 over this many optimizer steps
    cosine_steps: int | None = None  # step at which the decay reaches min_lr; None = trainer.max_steps
    schedule: str = "cosine"  # "cosine", "linear" (decay), "constant" (after warm-up) or "wsd" (warmup-stable-decay)
    decay_fraction: float = 0.2  # wsd: the decay to min_lr takes this last fraction of the run
    decay_shape: str = "linear"  # wsd: "linear" or "1-sqrt" decay
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay (0.95 is steadier than 0.999 for LMs)
    eps: float = 1e-8  # AdamW denominator epsilon
    weight_decay: float = 0.1  # decoupled (AdamW) decay of matrices
    decay_vectors: bool = False  # also decay 1-D parameters (RMSNorm gains); off as usual for LMs
    grad_clip: float = 1.0  # global L2 norm; 0 disables clipping
    foreach: bool | None = None  # multi-tensor AdamW path; None = on for CUDA, off elsewhere
    fused: bool = True  # one Triton kernel per group on CUDA (float32 params); falls back to foreach

    def __post_init__(self) -> None:
        for name in ("lr", "min_lr", "muon_lr", "weight_decay", "eps"):  # an infinite rate trains to NaN
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"optim.{name} must be a finite number, got {value}")
        if self.lr <= 0:  # a rate of 0 runs every step and changes no weight
            raise ValueError(f"optim.lr must be > 0 (a rate of 0 trains nothing), got {self.lr:g}")
        if self.min_lr < 0:
            raise ValueError(f"optim.min_lr must be >= 0, got {self.min_lr}")
        if self.min_lr > self.lr and self.schedule != "constant":
            raise ValueError(f"optim.min_lr ({self.min_lr:g}) is above optim.lr ({self.lr:g}): the {self.schedule} "
                             f"decay would raise the rate; set optim.min_lr <= optim.lr")
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(f"optim.name must be one of {', '.join(OPTIMIZER_NAMES)}, got {self.name!r}")
        if self.muon_lr is not None and self.muon_lr <= 0:  # 0 would leave the blocks' matrices untrained
            raise ValueError(f"optim.muon_lr must be > 0 or none (= optim.lr), got {self.muon_lr:g}")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.cosine_steps is not None and self.cosine_steps <= 0:  # the rate would sit at min_lr from step 1
            raise ValueError(f"optim.cosine_steps must be > 0 or none (= trainer.max_steps), got {self.cosine_steps}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"optim.schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {self.schedule!r}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"optim.decay_shape must be one of {', '.join(DECAY_SHAPES)}, got {self.decay_shape!r}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim.beta1 and optim.beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.grad_clip < 0 or self.weight_decay < 0 or self.eps < 0:
            raise ValueError("optim.grad_clip, optim.weight_decay and optim.eps must be >= 0")
        if self.eps == 0:  # AdamW's m / (sqrt(v) + eps) is 0 / 0 for a weight whose gradients were all 0
            raise ValueError("optim.eps must be > 0: with 0, AdamW turns weights whose gradient is 0 "
                             "(e.g. embeddings of unseen tokens) into NaN")

    def ignored_options(self) -> list[str]:
        """One line for each group of options set away from their defaults that the chosen
        optimizer or schedule never reads, for a command to print instead of ignoring them silently."""
        changed = changed_fields(self)
        notes = []
        muon = [name for name in ("muon_lr", "muon_momentum") if name in changed]
        if muon and self.name != "muon":
            notes.append(f"{settings_text('optim', self, muon)} no effect (the muon_* options apply to "
                         f"optim.name=\"muon\"; this run's optimizer is \"{self.name}\")")
        wsd = [name for name in ("decay_fraction", "decay_shape") if name in changed]
        if wsd and self.schedule != "wsd":
            notes.append(f"{settings_text('optim', self, wsd)} no effect (optim.decay_fraction and "
                         f"optim.decay_shape apply to optim.schedule=\"wsd\"; this run's schedule is "
                         f"\"{self.schedule}\")")
        if self.cosine_steps is not None and self.schedule == "constant":
            notes.append(f"{settings_text('optim', self, ['cosine_steps'])} no effect (optim.schedule=\"constant\" "
                         "never decays)")
        return notes
