"""scratchlm's FSDP: Linear/Embedding weights, their gradients and optimizer state sharded by rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scratchlm.parallel.process_group import all_gather_flat
from scratchlm.parallel.strategies.sharded import ShardedStateStrategy
from scratchlm.parallel.strategy import compute_dtype, map_optimizer_state


class FSDPStrategy(ShardedStateStrategy):
    """`scratchlm.parallel.fsdp.FSDP` with `parallel.compute_dtype`."""

    name = "fsdp"
    uses_compute_dtype = True

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from scratchlm.parallel.fsdp import FSDP

        self._fsdp = FSDP(model.to(self.device), compute_dtype=compute_dtype(self.cfg))
        return self._fsdp

    def sync_gradients(self, model: nn.Module) -> None:
        model.finish_gradient_synchronization()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        from scratchlm.optim.clip import clip_grad_norm

        params = [p for p in model.parameters() if p.grad is not None]
        return clip_grad_norm(params, max_norm, sharded=[model.is_sharded(p) for p in params],
                              group=model.process_group)

    def _gather_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return model.full_state_dict()

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor] | None) -> None:
        model.load_full_state_dict(self._everywhere(state_dict))

    def gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        fsdp = self._fsdp

        def gather(v: Any, p: torch.Tensor) -> Any:
            # A shard-shaped state tensor of a sharded weight, gathered to the full weight's shape.
            w = fsdp.sharded_weight(p)
            if w is None or not torch.is_tensor(v) or tuple(v.shape) != tuple(p.shape):
                return v
            out = torch.empty((v.shape[0] * fsdp.world_size, *v.shape[1:]), dtype=v.dtype, device=v.device)
            all_gather_flat(out, v.contiguous(), group=fsdp.process_group)
            return out[: w.rows].clone()

        return map_optimizer_state(optimizer.state_dict(), gather, optimizer)

    def scatter_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        fsdp = self._fsdp

        def shard(v: Any, p: torch.Tensor) -> Any:
            w = fsdp.sharded_weight(p)
            if w is None or not torch.is_tensor(v) or tuple(v.shape) != tuple(w.full_shape):
                return v
            return fsdp.shard_of(w, v.to(p.device))

        optimizer.load_state_dict(map_optimizer_state(state_dict, shard, optimizer))
