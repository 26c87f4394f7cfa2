"""Process-group helpers: start and stop torch.distributed, and the collectives we rely on.

Two things here are about portability rather than parallelism:

* PyTorch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to
  `all_gather_single` / `reduce_scatter_single` and the old names now warn. Older releases
  (2.11 on the GPU machine) only have the old names. `all_gather_flat` / `reduce_scatter_flat`
  pick whichever exists, so no deprecation warning is ever emitted.
* Some gloo builds do not implement reduce-scatter. When the call is refused we fall back to an
  all-reduce of the whole buffer followed by a copy of this rank's slice (twice the traffic of a
  true reduce-scatter, identical numbers: the sums are the same element-wise sums).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_reduce_scatter_unsupported: set[str] = set()  # backends that refused reduce-scatter once


class _DoneWork:
    """A finished collective: `wait()` returns at once (the fallback path runs synchronously)."""

    def wait(self) -> bool:
        return True


def find_free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: torch.device | None = None) -> str:
    """'nccl' when the device (default: the current one) is CUDA and NCCL exists, else 'gloo'."""
    if device is None:
        on_cuda = torch.cuda.is_available()
    else:
        on_cuda = torch.device(device).type == "cuda"
    return "nccl" if on_cuda and dist.is_nccl_available() else "gloo"


def init_process_group(
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Join a process group over TCP; the address and port default to MASTER_ADDR / MASTER_PORT."""
    addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = master_port or int(os.environ.get("MASTER_PORT", "29500"))
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def destroy_process_group() -> None:
    """Leave the default process group if one is initialised (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, *, group=None, async_op: bool = False):
    """Gather every rank's equally sized `shard` into `output` (rank r's at offset r · shard.numel())."""
    return _ALL_GATHER(output, shard, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor, *, group=None, async_op: bool = False):
    """Sum `full` over ranks and keep this rank's chunk (dim-0 chunk `rank` of world-size) in `output`."""
    backend = dist.get_backend(group)
    if backend not in _reduce_scatter_unsupported:
        try:
            return _REDUCE_SCATTER(output, full, group=group, async_op=async_op)
        except (RuntimeError, NotImplementedError):
            # Every rank refuses the same call in the same way, so every rank takes the fallback.
            _reduce_scatter_unsupported.add(backend)
    summed = full.clone()
    dist.all_reduce(summed, group=group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    output.copy_(summed.view(world, *output.shape)[rank])
    return _DoneWork() if async_op else None
