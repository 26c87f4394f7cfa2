"""Optimizer-state sharding (ZeRO stage 1): each rank keeps the state of a slice of the parameters.

Gradients are still all-reduced in full (wrap the model in `DDP`), so every rank holds the same
averaged gradient; what is divided across ranks is the optimizer state (AdamW's two moments:
8 bytes per fp32 parameter, twice the weights themselves). Each parameter is *owned* by one
rank; at `step()` every rank updates only the parameters it owns with a local instance of the
wrapped optimizer, then each updated parameter is broadcast from its owner to everyone.

Parameters are assigned largest first to the rank with the fewest elements so far (a greedy
balance of numel, deterministic and identical on every rank); each rank's local optimizer
sees its parameters in their original order. Because the update of a
parameter depends only on its own gradient and state, the result is bit-identical to running
the wrapped optimizer on all parameters in one process (for element-wise optimizers such as
AdamW and SGD).

`state_dict()` is per rank: the local optimizer's state dict (indices are those of the local
optimizer) plus the rank, the world size and the ids of the owned parameters; load it back
into a `ShardedOptimizer` built the same way on the same rank of the same world size.
`consolidated_state_dict()` instead gathers the state of every parameter into one dict laid
out exactly as the wrapped optimizer's own `state_dict()` over all parameters (so it loads
into a single-process optimizer, or, with `load_consolidated_state_dict`, into a
ShardedOptimizer of any world size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    """Wrap `optimizer_cls(params, **kwargs)` so each rank steps only its shard of the parameters.

    `param_groups` (and so learning-rate schedules that edit them) are the full groups, the same
    on every rank; hyperparameters are copied into the local optimizer's groups at each step.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        process_group=None,
        **kwargs: Any,
    ) -> None:
        self.optimizer_cls = optimizer_cls
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._load = [0] * self.world_size  # elements owned by each rank so far
        self.owner: dict[int, int] = {}  # id(param) -> owning rank
        self.local_optimizer: torch.optim.Optimizer | None = None
        self._kwargs = kwargs
        super().__init__(params, kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the full groups and this rank's owned part of it to the local optimizer."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        # Largest first, each to the least-loaded rank (ties to the lower rank): a greedy
        # balance that copes with a few huge matrices (embeddings) among many small ones.
        order = sorted(range(len(group["params"])), key=lambda i: -group["params"][i].numel())
        for i in order:
            p = group["params"][i]
            rank = min(range(self.world_size), key=lambda r: self._load[r])
            self._load[rank] += p.numel()
            self.owner[id(p)] = rank
        owned = [p for p in group["params"] if self.owner[id(p)] == self.rank]
        local_group = {k: v for k, v in group.items() if k != "params"}
        local_group["params"] = owned
        if self.local_optimizer is None:
            # An empty local group is allowed, so a rank that owns nothing still has a group
            # for every full group and the indices of the two stay aligned.
            self.local_optimizer = self.optimizer_cls([local_group], **self._kwargs)
        else:
            self.local_optimizer.add_param_group(local_group)
        # The wrapped optimizer fills in its own defaults (e.g. AdamW's eps): mirror them so the
        # full groups describe the optimizer completely (state dicts, schedulers).
        for key, value in self.local_optimizer.param_groups[-1].items():
            group.setdefault(key, value)

    def _sync_hyperparameters(self) -> None:
        for full, local in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            for key, value in full.items():
                if key != "params":
                    local[key] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step the owned parameters, then broadcast every parameter from its owner."""
        self._sync_hyperparameters()
        loss = self.local_optimizer.step(closure)
        works = []
        for group in self.param_groups:
            for p in group["params"]:
                works.append(dist.broadcast(p.data, src=self._global_rank(self.owner[id(p)]),
                                            group=self.process_group, async_op=True))
        for w in works:
            w.wait()
        return loss

    def _global_rank(self, group_rank: int) -> int:
        if self.process_group is None:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank updates (and keeps optimizer state for)."""
        return [p for g in self.local_optimizer.param_groups for p in g["params"]]

    # checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the local optimizer's state dict plus where it belongs."""
        self._sync_hyperparameters()
        return {
            "local": self.local_optimizer.state_dict(),
            "rank": self.rank,
            "world_size": self.world_size,
            "owned": [self._global_index()[id(p)] for p in self.owned_parameters()],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict produced by `state_dict()` on the same rank of the same world size."""
        if "local" not in state_dict:
            raise ValueError("not a ShardedOptimizer state dict: use load_consolidated_state_dict for a full one")
        if (state_dict["rank"], state_dict["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"optimizer shard of rank {state_dict['rank']}/{state_dict['world_size']} cannot load "
                f"into rank {self.rank}/{self.world_size}"
            )
        self.local_optimizer.load_state_dict(state_dict["local"])
        for full, local in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            for key, value in local.items():
                if key != "params":
                    full[key] = value

    def _global_index(self) -> dict[int, int]:
        ids = [id(p) for g in self.param_groups for p in g["params"]]
        return {pid: i for i, pid in enumerate(ids)}

    def consolidated_state_dict(self) -> dict[str, Any]:
        """Every parameter's state, laid out like the wrapped optimizer's own state dict (all ranks)."""
        self._sync_hyperparameters()
        local = self.local_optimizer.state_dict()
        index = self._global_index()
        owned = self.owned_parameters()
        mine = {index[id(owned[i])]: _to_cpu(s) for i, s in local["state"].items()}
        shards: list[dict[int, Any]] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(shards, mine, group=self.process_group)
        state = {}
        for shard in shards:
            state.update(shard)
        groups = []
        start = 0
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(g)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full, single-optimizer-layout state dict (e.g. from `consolidated_state_dict`)."""
        index = self._global_index()
        local_groups = []
        start = 0
        for full_group, saved_group, local_group in zip(
            self.param_groups, state_dict["param_groups"], self.local_optimizer.param_groups, strict=True
        ):
            for key, value in saved_group.items():
                if key != "params":
                    full_group[key] = value
            g = {k: v for k, v in saved_group.items() if k != "params"}
            g["params"] = list(range(start, start + len(local_group["params"])))
            start += len(local_group["params"])
            local_groups.append(g)
        local_state = {}
        for i, p in enumerate(self.owned_parameters()):
            saved = state_dict["state"].get(index[id(p)], state_dict["state"].get(str(index[id(p)])))
            if saved is not None:
                local_state[i] = saved
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj
