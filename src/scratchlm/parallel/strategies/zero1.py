"""ZeRO stage 1: replicated weights and gradients (DDP), optimizer state sharded by parameter."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scratchlm.parallel.strategies.ddp import DDPStrategy
from scratchlm.parallel.strategies.sharded import ShardedStateStrategy


class Zero1Strategy(ShardedStateStrategy, DDPStrategy):
    """`DDP` for gradients, `scratchlm.parallel.sharded_optimizer.ShardedOptimizer` for the update."""

    name = "zero1"

    def build_optimizer(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                        params: Any = None, **kwargs: Any) -> torch.optim.Optimizer:
        from scratchlm.parallel.sharded_optimizer import ShardedOptimizer

        return ShardedOptimizer(self._params(model, params), optimizer_cls, **kwargs)

    def gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.consolidated_state_dict()

    def scatter_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        optimizer.load_consolidated_state_dict(state_dict)
