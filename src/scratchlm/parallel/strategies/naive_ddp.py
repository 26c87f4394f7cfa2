"""Data parallelism with one blocking all-reduce per gradient after backward (the baseline)."""

from __future__ import annotations

from torch import nn

from scratchlm.parallel.strategies.replicated import ReplicatedStrategy


class NaiveDDPStrategy(ReplicatedStrategy):
    """`scratchlm.parallel.ddp.NaiveDDP`."""

    name = "naive_ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        from scratchlm.parallel.ddp import NaiveDDP

        return NaiveDDP(model)
