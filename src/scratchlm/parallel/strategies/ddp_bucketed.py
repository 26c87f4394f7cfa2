"""Data parallelism with gradients all-reduced in buckets of `parallel.bucket_size_mb`."""

from __future__ import annotations

from torch import nn

from scratchlm.parallel.strategies.replicated import ReplicatedStrategy


class BucketedDDPStrategy(ReplicatedStrategy):
    """`scratchlm.parallel.ddp.DDP` with `bucket_size_mb`."""

    name = "ddp_bucketed"
    overlaps_backward = True
    uses_bucket_size = True

    def wrap(self, model: nn.Module) -> nn.Module:
        from scratchlm.parallel.ddp import DDP

        return DDP(model, bucket_size_mb=self.cfg.bucket_size_mb)
