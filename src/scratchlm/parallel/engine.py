"""The names the trainer's parallel seam had before strategies: `init_engine`, `ParallelEngine`.

New code calls `scratchlm.parallel.strategy.init_strategy`, which also builds the
single-process strategy; `init_engine` is for callers that start only distributed ones.
"""

from __future__ import annotations

from scratchlm.errors import UserError
from scratchlm.parallel.config import ParallelConfig
from scratchlm.parallel.strategy import Strategy, init_strategy, unwrap

ParallelEngine = Strategy


def init_engine(cfg: ParallelConfig) -> Strategy:
    """`init_strategy(cfg)` for a distributed strategy (joins the torchrun process group)."""
    if cfg.strategy == "none":
        raise UserError("parallel.strategy is 'none': no parallel engine to start")
    return init_strategy(cfg)


__all__ = ["ParallelEngine", "init_engine", "unwrap"]
