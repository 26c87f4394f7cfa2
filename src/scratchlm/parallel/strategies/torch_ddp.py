"""PyTorch's own DistributedDataParallel, as a reference to compare scratchlm's DDP against."""

from __future__ import annotations

from torch import nn

from scratchlm.parallel.strategies.replicated import ReplicatedStrategy


class TorchDDPStrategy(ReplicatedStrategy):
    """`torch.nn.parallel.DistributedDataParallel` with `bucket_cap_mb = parallel.bucket_size_mb`."""

    name = "torch_ddp"
    overlaps_backward = True
    uses_bucket_size = True

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=self.cfg.bucket_size_mb)
