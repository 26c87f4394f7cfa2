"""PyTorch's FSDP2 (`fully_shard`) over the same units as scratchlm's FSDP, as a reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scratchlm.parallel.strategies.sharded import ShardedStateStrategy
from scratchlm.parallel.strategy import compute_dtype, map_optimizer_state, unwrap


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "device_mesh")


def _full(v: Any) -> Any:
    return v.full_tensor() if hasattr(v, "full_tensor") else v


class TorchFSDP2Strategy(ShardedStateStrategy):
    """`torch.distributed.fsdp.fully_shard` on each Linear/Embedding, then on the root."""

    name = "torch_fsdp2"
    uses_compute_dtype = True

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from scratchlm.parallel.fsdp import SHARDED_TYPES

        model = model.to(self.device)
        dtype = compute_dtype(self.cfg)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        counts: dict[int, int] = {}
        for sub in model.modules():
            for p in sub.parameters(recurse=False):
                counts[id(p)] = counts.get(id(p), 0) + 1
        for sub in model.modules():
            own = list(sub.parameters(recurse=False))
            # A weight shared by two modules (tied embeddings) must belong to one FSDP group:
            # leave both modules to the root group.
            if isinstance(sub, SHARDED_TYPES) and own and all(counts[id(p)] == 1 for p in own):
                fully_shard(sub, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        from torch.distributed.tensor import Shard

        from scratchlm.optim.clip import global_grad_norm, scale_grads_

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        sharded = [_is_dtensor(g) and any(isinstance(pl, Shard) for pl in g.placements) for g in grads]
        local = [g.to_local() if _is_dtensor(g) else g for g in grads]
        total = global_grad_norm(local, sharded=sharded)
        scale_grads_(local, total, max_norm)
        return total

    def _gather_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: _full(v) for k, v in unwrap(model).state_dict().items()}

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor] | None) -> None:
        from torch.distributed.tensor import distribute_tensor

        state_dict = self._everywhere(state_dict)
        with torch.no_grad():
            for key, t in unwrap(model).state_dict(keep_vars=True).items():
                src = state_dict[key]
                if _is_dtensor(t):
                    src = distribute_tensor(src.to(t.device, t.dtype), t.device_mesh, t.placements)
                    t.to_local().copy_(src.to_local())
                else:
                    t.copy_(src)

    def gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return map_optimizer_state(optimizer.state_dict(), lambda v, p: _full(v), optimizer)

    def scatter_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        from torch.distributed.tensor import distribute_tensor

        def shard(v: Any, p: torch.Tensor) -> Any:
            if _is_dtensor(p) and torch.is_tensor(v) and v.dim():
                return distribute_tensor(v.to(p.device, p.dtype), p.device_mesh, p.placements)
            return v

        optimizer.load_state_dict(map_optimizer_state(state_dict, shard, optimizer))

    def local_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return map_optimizer_state(optimizer.state_dict(),
                                   lambda v, p: v.to_local() if hasattr(v, "to_local") else v, optimizer)

    def load_local_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        def as_dtensor(v: Any, p: torch.Tensor) -> Any:
            if _is_dtensor(p) and torch.is_tensor(v) and v.dim():
                return DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.size(),
                                          stride=p.stride())
            return v

        optimizer.load_state_dict(map_optimizer_state(state_dict, as_dtensor, optimizer))
