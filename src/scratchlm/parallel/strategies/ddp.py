"""Data parallelism with one asynchronous all-reduce per gradient, overlapped with backward."""

from __future__ import annotations

from torch import nn

from scratchlm.parallel.strategies.replicated import ReplicatedStrategy


class DDPStrategy(ReplicatedStrategy):
    """`scratchlm.parallel.ddp.DDP` per parameter."""

    name = "ddp"
    overlaps_backward = True

    def wrap(self, model: nn.Module) -> nn.Module:
        from scratchlm.parallel.ddp import DDP

        return DDP(model)
