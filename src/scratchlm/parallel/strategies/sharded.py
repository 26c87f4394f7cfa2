"""The shared checkpoint behaviour of the strategies that split optimizer state across ranks."""

from __future__ import annotations

from typing import Any

import torch

from scratchlm.parallel.strategy import DistributedStrategy, to_cpu


class ShardedStateStrategy(DistributedStrategy):
    """Each rank holds part of the optimizer state; `parallel.optimizer_state` picks the checkpoint layout.

    "full": `optimizer_state_dict` gathers the single-process layout on rank 0 (subclasses
    implement `gather_optimizer_state` / `scatter_optimizer_state`); "sharded": every rank
    returns its own part (`local_optimizer_state` / `load_local_optimizer_state`).
    """

    @property
    def optimizer_state_per_rank(self) -> bool:
        return self.cfg.optimizer_state == "sharded"

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        if self.optimizer_state_per_rank:
            return self.local_optimizer_state(optimizer)
        state_dict = self.gather_optimizer_state(optimizer)  # a collective: every rank calls it
        return to_cpu(state_dict) if self.is_main else None

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any] | None, *,
                                  per_rank: bool | None = None) -> None:
        if self.optimizer_state_per_rank if per_rank is None else per_rank:
            self.load_local_optimizer_state(optimizer, state_dict)
        else:
            self.scatter_optimizer_state(optimizer, self._everywhere(state_dict))

    def gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state in the single-process layout (meaningful on rank 0)."""
        raise NotImplementedError

    def scatter_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Load a full (single-process layout) state dict, given on every rank."""
        raise NotImplementedError

    def local_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's part of the optimizer state."""
        return optimizer.state_dict()

    def load_local_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        optimizer.load_state_dict(state_dict)
