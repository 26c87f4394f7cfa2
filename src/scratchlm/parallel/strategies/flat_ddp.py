"""Data parallelism with all gradients all-reduced as one flat buffer after backward."""

from __future__ import annotations

from torch import nn

from scratchlm.parallel.strategies.replicated import ReplicatedStrategy


class FlatDDPStrategy(ReplicatedStrategy):
    """`scratchlm.parallel.ddp.FlatDDP`."""

    name = "flat_ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        from scratchlm.parallel.ddp import FlatDDP

        return FlatDDP(model)
