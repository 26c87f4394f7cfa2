"""The interface between the trainer and a parallel strategy: one object, the same calls for all.

The trainer always holds a `Strategy` (the single-process one when `parallel.strategy` is
"none"), builds the plain model, hands it to `scratchlm.parallel.parallelize`, and then does

    optimizer = strategy.build_optimizer(model, AdamW, lr=...)
    for each micro-batch but the last:  with strategy.no_sync(model): forward / backward
    last micro-batch:                   forward / backward
    strategy.sync_gradients(model)                  # after the last backward of the step
    norm = strategy.clip_grad_norm(model, max_norm) # global norm, across shards
    optimizer.step()

and for checkpoints `full_state_dict` / `load_full_state_dict` (full fp32 weights, keyed like
the plain model's `state_dict()`) and `optimizer_state_dict` / `load_optimizer_state_dict`.

Each strategy is one class in `scratchlm/parallel/strategies/`, listed by name in
`scratchlm.parallel.registry.STRATEGIES`; `init_strategy` joins the process group (for the
distributed ones) and builds the configured one. Shared behaviour lives in base classes:
`DistributedStrategy` (collectives and checkpoint plumbing over torch.distributed),
`strategies.replicated.ReplicatedStrategy` (every rank holds the whole model) and
`strategies.sharded.ShardedStateStrategy` (optimizer state is split across ranks).

Optimizer state in checkpoints (see docs/distributed.md): replicated strategies return the
state dict on rank 0 and None elsewhere (one optimizer.pt). For sharded strategies,
`parallel.optimizer_state = "full"` gathers it on rank 0 in exactly the layout a single
process's optimizer has (so a run may resume with another world size or strategy), and
"sharded" returns each rank's own part on every rank (the trainer writes optimizer.pt from
rank 0 and optimizer.rankN.pt from the others; resume with the same world size).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from scratchlm.device import resolve_device
from scratchlm.errors import UserError

if TYPE_CHECKING:
    from scratchlm.parallel.config import ParallelConfig

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


def compute_dtype(cfg: ParallelConfig) -> torch.dtype | None:
    """`parallel.compute_dtype` as a torch dtype (None: compute in the master dtype)."""
    return _DTYPES[cfg.compute_dtype]


class Strategy:
    """How one process takes part in training: the calls the trainer makes, see the module docstring.

    Subclasses set `name` and override what differs; this base class is a world of one: the
    model is only moved to `device`, gradients need no synchronisation and collectives are the
    identity.
    """

    name: ClassVar[str] = ""
    # The fused LM head (trainer.fused_lm_head) computes the loss from the plain model's trunk,
    # bypassing the wrapped model's forward: only right where the wrapper does nothing in it.
    supports_fused_lm_head: ClassVar[bool] = False
    # Evaluation may run the plain (uncompiled, unwrapped) model: same loss, no second compiled graph.
    eval_plain_model: ClassVar[bool] = False
    # Whether `wrap_model` computes in `parallel.compute_dtype` (the FSDP strategies); the config
    # refuses a compute dtype for the others, which would train in fp32 without saying so.
    uses_compute_dtype: ClassVar[bool] = False
    # Whether `wrap_model` groups gradients into buckets of `parallel.bucket_size_mb` (ddp_bucketed,
    # torch_ddp); for the others the option has no effect, and a run that sets it says so.
    uses_bucket_size: ClassVar[bool] = False

    def __init__(self, cfg: ParallelConfig, *, device: torch.device, rank: int = 0, world_size: int = 1,
                 local_rank: int = 0, backend: str | None = None, owns_process_group: bool = False) -> None:
        self.cfg = cfg
        self.device = device
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.backend = backend
        self.owns_process_group = owns_process_group

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the rank that logs and writes checkpoints)."""
        return self.rank == 0

    @property
    def strategy(self) -> str:
        """The `parallel.strategy` name of this strategy."""
        return self.name

    @property
    def optimizer_state_per_rank(self) -> bool:
        """Whether `optimizer_state_dict` returns a part on every rank (to be saved per rank)."""
        return False

    # model and optimizer --------------------------------------------------------------

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Move `model` to this rank's device and wrap it for the strategy."""
        return model.to(self.device)

    def build_optimizer(
        self,
        model: nn.Module,
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        params: Iterable[Any] | Callable[[nn.Module], Iterable[Any]] | None = None,
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """`optimizer_cls` over the wrapped model's parameters.

        `params` may give parameter groups of the wrapped model, or a function that builds them
        from the plain module inside it (e.g. `lambda m: param_groups(m, 0.1)`).
        """
        return optimizer_cls(self._params(model, params), **kwargs)

    @staticmethod
    def _params(model: nn.Module, params: Any) -> Iterable[Any]:
        if params is None:
            return model.parameters()
        if callable(params):
            return params(unwrap(model))
        return params

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient communication in backward passes inside (all but the last micro-batch)."""
        yield

    def sync_gradients(self, model: nn.Module) -> None:
        """Finish gradient averaging; call after the last backward of a step."""

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most `max_norm`; returns the norm (0-d tensor).

        Every strategy computes the norm with `scratchlm.optim.clip.global_grad_norm`.
        """
        from scratchlm.optim.clip import clip_grad_norm

        return clip_grad_norm(model.parameters(), max_norm)

    # checkpoints ----------------------------------------------------------------------

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Full weights keyed like the plain model's `state_dict()` (on rank 0; None elsewhere)."""
        return unwrap(model).state_dict()

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor] | None) -> None:
        """Load full weights; pass the dict on every rank, or on rank 0 only (then it is broadcast)."""
        unwrap(model).load_state_dict(self._everywhere(state_dict))

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """Optimizer state to checkpoint: see the module docstring for who gets what."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any] | None, *,
                                  per_rank: bool | None = None) -> None:
        """Load what `optimizer_state_dict` returned (the full dict may be given on rank 0 only).
        ``per_rank``: whether `state_dict` is this rank's part (False: the single-process layout,
        which every strategy loads); None: the layout this strategy saves."""
        optimizer.load_state_dict(self._everywhere(state_dict))

    # small collectives ----------------------------------------------------------------

    def all_reduce_mean(self, x: float) -> float:
        """The mean of `x` over ranks."""
        return self.all_reduce_means([float(x)])[0]

    def all_reduce_means(self, values: list[float]) -> list[float]:
        """The mean over ranks of each of `values`, in one collective."""
        return list(values)

    def barrier(self) -> None:
        """Wait until every rank gets here."""

    def close(self) -> None:
        """Leave the process group (if this strategy joined it)."""

    def shutdown(self) -> None:
        """The same as `close` (the name the trainer's engine had)."""
        self.close()

    def _everywhere(self, obj: Any) -> Any:
        """`obj` on every rank: kept where every rank has one, else rank 0's is broadcast."""
        return obj


class DistributedStrategy(Strategy):
    """A strategy over a torch.distributed process group: real collectives, rank-0 checkpoints."""

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        state_dict = self._gather_state_dict(model)  # a collective for sharded strategies
        return to_cpu(state_dict) if self.is_main else None

    def _gather_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full state dict, on every rank (sharded strategies gather it here)."""
        return unwrap(model).state_dict()

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        return optimizer.state_dict() if self.is_main else None

    def all_reduce_means(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64 if self.backend == "gloo" else torch.float32, device=self.device)
        dist.all_reduce(t)
        return (t / self.world_size).tolist()

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def close(self) -> None:
        import torch.distributed as dist

        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()

    def _everywhere(self, obj: Any) -> Any:
        import torch.distributed as dist

        have = torch.tensor([0 if obj is None else 1], device=self.device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if have.item():
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        if box[0] is None:
            raise ValueError("rank 0 has no state dict to broadcast")
        return box[0]


def init_strategy(cfg: ParallelConfig, *, device: str | torch.device = "auto") -> Strategy:
    """The strategy `cfg.strategy` names, ready to use.

    "none" is one process on `device` ("auto": CUDA when available). Every other strategy
    joins (or reuses) the process group described by torchrun's environment variables: RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (a lone process without them becomes a
    world of one on a free local port). Its backend is NCCL when CUDA is available, else gloo,
    unless `cfg.backend` names one; each rank uses cuda:LOCAL_RANK. A `device` other than "auto"
    must fit the backend (CPU: gloo, CUDA: nccl) and picks it when `cfg.backend` is "auto".
    """
    from scratchlm.parallel.registry import STRATEGIES

    cls = STRATEGIES[cfg.strategy]
    if not issubclass(cls, DistributedStrategy):
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size > 1:  # every rank would train the whole run alone, into the same run directory
            raise UserError(f"parallel.strategy={cfg.strategy!r} runs one process, but this is one of "
                            f"{world_size} (WORLD_SIZE): choose a distributed strategy such as 'ddp'")
        return cls(cfg, device=resolve_device(device))
    return cls(cfg, **_join_process_group(cfg, device))


def _join_process_group(cfg: ParallelConfig, device_name: str | torch.device = "auto") -> dict[str, Any]:
    """Join torchrun's process group (or follow one joined already); the strategy's placement.

    The backend decides the device (nccl: cuda:LOCAL_RANK, gloo: the CPU); a `device_name`
    other than "auto" must agree with it, and picks the backend when that is "auto"."""
    import torch.distributed as dist

    from scratchlm.parallel.process_group import default_backend, find_free_port

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    wanted = None if str(device_name) == "auto" else resolve_device(device_name)
    backend = cfg.backend if cfg.backend != "auto" else default_backend(wanted)
    if backend == "nccl" and not torch.cuda.is_available() and not dist.is_initialized():
        raise UserError("parallel.backend='nccl' needs CUDA; use 'gloo' (or 'auto') on CPU")
    if wanted is not None and not dist.is_initialized():
        if wanted.type not in ("cpu", "cuda"):
            raise UserError(f"parallel.strategy={cfg.strategy!r} runs on the CPU (gloo) or CUDA (nccl), "
                            f"not on device {str(device_name)!r}")
        if (wanted.type == "cuda") != (backend == "nccl"):
            fit = "'nccl'" if wanted.type == "cuda" else "'gloo'"
            raise UserError(f"parallel.backend={backend!r} does not run on device {str(device_name)!r} "
                            f"(gloo trains on the CPU, nccl on CUDA): use {fit} or 'auto'")
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
    return {"rank": rank, "world_size": world_size, "local_rank": local_rank, "device": device,
            "backend": backend, "owns_process_group": owns}


def map_optimizer_state(sd: dict[str, Any], fn: Callable[[Any, torch.Tensor], Any],
                        optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of an optimizer state dict with `fn(value, param)` applied to every state value."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for idx, st in sd["state"].items():
        p = params[int(idx)]
        state[idx] = {k: fn(v, p) for k, v in st.items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def to_cpu(obj: Any) -> Any:
    """A copy of `obj` (a tensor or nested dict of them) on the CPU."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj
