"""The seam between the trainer and the parallel strategies: one object, the same calls for all.

The trainer builds a plain model and then, only when `parallel.strategy != "none"`, does

    engine = init_engine(cfg.parallel)            # joins the torchrun process group
    model = engine.wrap_model(model)              # DDP / FSDP / ... around the plain model
    optimizer = engine.build_optimizer(model, AdamW, lr=...)
    ... forward / backward on this rank's slice of the global batch ...
    engine.sync_gradients(model)                  # after the last backward of the step
    norm = engine.clip_grad_norm(model, max_norm) # global norm, across shards
    optimizer.step()

and for checkpoints `full_state_dict` / `load_full_state_dict` (full fp32 weights, keyed like
the plain model's `state_dict()`) and `optimizer_state_dict` / `load_optimizer_state_dict`.

Strategies ("ddp", "ddp_bucketed", "naive_ddp", "flat_ddp" and "torch_ddp" replicate
everything; "zero1" shards optimizer state; "fsdp" and "torch_fsdp2" shard weights, gradients
and optimizer state). The "torch_*" strategies run PyTorch's own DistributedDataParallel and
`fully_shard` (FSDP2) behind the same calls, as a reference to compare against.

Optimizer state in checkpoints (see docs/distributed.md): replicated strategies return the
state dict on rank 0 and None elsewhere (one optimizer.pt). For sharded strategies,
`parallel.optimizer_state = "full"` gathers it on rank 0 in exactly the layout a single
process's optimizer has (so a run may resume with another world size or strategy), and
"sharded" returns each rank's own part on every rank (the trainer writes optimizer.pt from
rank 0 and optimizer.rankN.pt from the others; resume with the same world size).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scratchlm.errors import UserError
from scratchlm.parallel.config import ParallelConfig
from scratchlm.parallel.process_group import all_gather_flat, default_backend, find_free_port

REPLICATED = ("ddp", "ddp_bucketed", "naive_ddp", "flat_ddp", "torch_ddp")
_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP / FSDP / torch.compile wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


@dataclass
class ParallelEngine:
    """A joined process group plus one strategy; see the module docstring for the calls."""

    cfg: ParallelConfig
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    owns_process_group: bool = True
    _wrapped: Any = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def strategy(self) -> str:
        return self.cfg.strategy

    @property
    def optimizer_state_per_rank(self) -> bool:
        """Whether `optimizer_state_dict` returns a part on every rank (to be saved per rank)."""
        return self.strategy not in REPLICATED and self.cfg.optimizer_state == "sharded"

    # model and optimizer --------------------------------------------------------------

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move `model` to this rank's device and wrap it for the configured strategy."""
        from scratchlm.parallel.ddp import DDP, FlatDDP, NaiveDDP
        from scratchlm.parallel.fsdp import FSDP

        model = model.to(self.device)
        s = self.strategy
        if s in ("ddp", "zero1"):
            wrapped = DDP(model)
        elif s == "ddp_bucketed":
            wrapped = DDP(model, bucket_size_mb=self.cfg.bucket_size_mb)
        elif s == "naive_ddp":
            wrapped = NaiveDDP(model)
        elif s == "flat_ddp":
            wrapped = FlatDDP(model)
        elif s == "fsdp":
            wrapped = FSDP(model, compute_dtype=_DTYPES[self.cfg.compute_dtype])
        elif s == "torch_ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=self.cfg.bucket_size_mb)
        elif s == "torch_fsdp2":
            wrapped = _torch_fully_shard(model, _DTYPES[self.cfg.compute_dtype])
        else:
            raise UserError(f"parallel.strategy {s!r} has no engine (use 'none' for one process)")
        self._wrapped = wrapped
        return wrapped

    def build_optimizer(
        self,
        model: nn.Module,
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        params: Iterable[Any] | Callable[[nn.Module], Iterable[Any]] | None = None,
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """`optimizer_cls` over the wrapped model's parameters (sharded by rank for "zero1").

        `params` may give parameter groups of the wrapped model, or a function that builds them
        from the plain module inside it (e.g. `lambda m: param_groups(m, 0.1)`).
        """
        if params is None:
            params = model.parameters()
        elif callable(params):
            params = params(unwrap(model))
        if self.strategy == "zero1":
            from scratchlm.parallel.sharded_optimizer import ShardedOptimizer

            return ShardedOptimizer(params, optimizer_cls, **kwargs)
        return optimizer_cls(params, **kwargs)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient communication in backward passes inside (all but the last micro-batch)."""
        inner = getattr(model, "no_sync", None)
        if self.strategy in ("ddp", "ddp_bucketed", "zero1", "torch_ddp") and inner is not None:
            with inner():
                yield
        else:
            yield

    def sync_gradients(self, model: nn.Module) -> None:
        """Finish gradient averaging; call after the last backward of a step."""
        finish = getattr(model, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Scale gradients so their global L2 norm (over all ranks' shards) is at most `max_norm`."""
        from scratchlm.optim.clip import clip_grad_norm

        if self.strategy in REPLICATED or self.strategy == "zero1":
            return float(clip_grad_norm(model.parameters(), max_norm))
        if self.strategy == "torch_fsdp2":
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if math.isfinite(max_norm) else 1e30)
            return float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        sharded_sq = torch.zeros((), device=self.device, dtype=torch.float32)
        replicated_sq = torch.zeros((), device=self.device, dtype=torch.float32)
        grads = []
        for p in model.parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            sq = p.grad.detach().float().pow(2).sum()
            if model.is_sharded(p):
                sharded_sq += sq
            else:
                replicated_sq += sq  # identical on every rank: counted once, not all-reduced
        dist.all_reduce(sharded_sq)
        total = torch.sqrt(sharded_sq + replicated_sq)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return float(total)

    # checkpoints ----------------------------------------------------------------------

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Full fp32 weights (on CPU) keyed like the plain model's `state_dict()`, on rank 0 only."""
        if self.strategy == "fsdp":
            sd = model.full_state_dict()
        elif self.strategy == "torch_fsdp2":
            sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in unwrap(model).state_dict().items()}
        else:
            sd = unwrap(model).state_dict() if self.is_main else None
        if not self.is_main:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor] | None) -> None:
        """Load full weights; pass the dict on every rank, or on rank 0 only (then it is broadcast)."""
        state_dict = self._everywhere(state_dict)
        if self.strategy == "fsdp":
            model.load_full_state_dict(state_dict)
        elif self.strategy == "torch_fsdp2":
            from torch.distributed.tensor import distribute_tensor

            with torch.no_grad():
                for key, t in unwrap(model).state_dict(keep_vars=True).items():
                    src = state_dict[key]
                    if hasattr(t, "device_mesh"):
                        src = distribute_tensor(src.to(t.device, t.dtype), t.device_mesh, t.placements)
                        t.to_local().copy_(src.to_local())
                    else:
                        t.copy_(src)
        else:
            unwrap(model).load_state_dict(state_dict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Optimizer state to checkpoint: see the module docstring for who gets what."""
        s = self.strategy
        if s in REPLICATED:
            return optimizer.state_dict() if self.is_main else None
        if self.cfg.optimizer_state == "sharded":
            sd = optimizer.state_dict()
            if s == "torch_fsdp2":
                sd = _map_state(sd, lambda v, p: v.to_local() if hasattr(v, "to_local") else v, optimizer)
            return sd
        if s == "zero1":
            sd = optimizer.consolidated_state_dict()
        elif s == "fsdp":
            fsdp = self._wrapped
            sd = _map_state(optimizer.state_dict(), lambda v, p: _gather_state(fsdp, p, v), optimizer)
        else:  # torch_fsdp2
            sd = _map_state(optimizer.state_dict(),
                            lambda v, p: v.full_tensor() if hasattr(v, "full_tensor") else v, optimizer)
        return _to_cpu(sd) if self.is_main else None

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any] | None) -> None:
        """Load what `optimizer_state_dict` returned (the full dict may be given on rank 0 only)."""
        s = self.strategy
        if s in REPLICATED or self.cfg.optimizer_state == "full":
            state_dict = self._everywhere(state_dict)
        if s in REPLICATED:
            optimizer.load_state_dict(state_dict)
            return
        if self.cfg.optimizer_state == "sharded":
            if s == "torch_fsdp2":
                from torch.distributed.tensor import DTensor

                state_dict = _map_state(state_dict, lambda v, p: DTensor.from_local(
                    v.to(p.device), p.device_mesh, p.placements, shape=p.size(), stride=p.stride()) if hasattr(p, "device_mesh") and torch.is_tensor(v) and v.dim() else v,
                    optimizer)
            optimizer.load_state_dict(state_dict)
            return
        if s == "zero1":
            optimizer.load_consolidated_state_dict(state_dict)
        elif s == "fsdp":
            fsdp = self._wrapped

            def shard(v: Any, p: torch.Tensor) -> Any:
                w = fsdp.sharded_weight(p)
                if w is None or not torch.is_tensor(v) or tuple(v.shape) != tuple(w.full_shape):
                    return v
                return fsdp.shard_of(w, v.to(p.device))

            optimizer.load_state_dict(_map_state(state_dict, shard, optimizer))
        else:
            from torch.distributed.tensor import distribute_tensor

            optimizer.load_state_dict(_map_state(state_dict, lambda v, p: distribute_tensor(
                v.to(p.device, p.dtype), p.device_mesh, p.placements)
                if hasattr(p, "device_mesh") and torch.is_tensor(v) and v.dim() else v, optimizer))

    # small collectives ----------------------------------------------------------------

    def all_reduce_mean(self, x: float) -> float:
        """The mean of `x` over ranks."""
        return self.all_reduce_means([float(x)])[0]

    def all_reduce_means(self, values: list[float]) -> list[float]:
        """The mean over ranks of each of `values`, in one collective."""
        t = torch.tensor(values, dtype=torch.float64 if self.backend == "gloo" else torch.float32, device=self.device)
        dist.all_reduce(t)
        return (t / self.world_size).tolist()

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def shutdown(self) -> None:
        """Leave the process group (if this engine joined it)."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    def _everywhere(self, obj: Any) -> Any:
        """`obj` on every rank: kept where every rank has one, else rank 0's is broadcast."""
        have = torch.tensor([0 if obj is None else 1], device=self.device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item():
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        if box[0] is None:
            raise ValueError("rank 0 has no state dict to broadcast")
        return box[0]


def init_engine(cfg: ParallelConfig) -> ParallelEngine:
    """Join (or reuse) the process group described by torchrun's environment variables.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (a lone process without
    them becomes a world of one on a free local port). The backend is NCCL when CUDA is
    available, else gloo, unless `cfg.backend` names one; each rank uses cuda:LOCAL_RANK.
    """
    if cfg.strategy == "none":
        raise UserError("parallel.strategy is 'none': no parallel engine to start")
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = cfg.backend if cfg.backend != "auto" else default_backend()
    if backend == "nccl" and not torch.cuda.is_available() and not dist.is_initialized():
        raise UserError("parallel.backend='nccl' needs CUDA; use 'gloo' (or 'auto') on CPU")
    device = torch.device("cpu")
    owns = not dist.is_initialized()
    if owns and backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if owns:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise UserError("MASTER_PORT is not set: launch multi-process runs with torchrun")
            os.environ["MASTER_PORT"] = str(find_free_port())
        from datetime import timedelta

        kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=cfg.timeout_s), **kwargs)
    else:
        # Joined already (e.g. by a launcher in Python): follow that group and current device.
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        local_rank = device.index if device.type == "cuda" else local_rank
    return ParallelEngine(cfg=cfg, rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                          backend=backend, owns_process_group=owns)


# helpers ------------------------------------------------------------------------------------


def _torch_fully_shard(model: nn.Module, compute_dtype: torch.dtype | None) -> nn.Module:
    """PyTorch FSDP2 over the same units as scratchlm's FSDP: each Linear/Embedding, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from scratchlm.parallel.fsdp import SHARDED_TYPES

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
    counts: dict[int, int] = {}
    for sub in model.modules():
        for p in sub.parameters(recurse=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
    for sub in model.modules():
        own = list(sub.parameters(recurse=False))
        # A weight shared by two modules (tied embeddings) must belong to one FSDP group: leave
        # both modules to the root group.
        if isinstance(sub, SHARDED_TYPES) and own and all(counts[id(p)] == 1 for p in own):
            fully_shard(sub, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _map_state(sd: dict[str, Any], fn: Callable[[Any, torch.Tensor], Any], optimizer: torch.optim.Optimizer
               ) -> dict[str, Any]:
    """A copy of an optimizer state dict with `fn(value, param)` applied to every state value."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for idx, st in sd["state"].items():
        p = params[int(idx)]
        state[idx] = {k: fn(v, p) for k, v in st.items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def _gather_state(fsdp: Any, p: torch.Tensor, v: Any) -> Any:
    """A shard-shaped optimizer-state tensor of a sharded weight, gathered to the full weight's shape."""
    w = fsdp.sharded_weight(p)
    if w is None or not torch.is_tensor(v) or tuple(v.shape) != tuple(p.shape):
        return v
    out = torch.empty((v.shape[0] * fsdp.world_size, *v.shape[1:]), dtype=v.dtype, device=v.device)
    all_gather_flat(out, v.contiguous(), group=fsdp.process_group)
    return out[: w.rows].clone()


def _to_cpu(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj
