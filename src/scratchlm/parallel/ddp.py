"""Data parallelism: every rank holds the whole model, gradients are averaged across ranks.

Three wrappers, from simplest to fastest, share one contract: construct on every rank (rank
0's parameters and buffers are broadcast so all replicas start equal), run forward/backward
on this rank's slice of the global batch, call `finish_gradient_synchronization()`, step.

* `NaiveDDP`: after backward, one blocking all-reduce per parameter. Many small messages and
  no overlap with compute: the baseline.
* `FlatDDP`: after backward, all gradients are concatenated into one buffer and all-reduced
  once. One large message (fewer latency terms), still no overlap.
* `DDP`: each gradient's all-reduce starts asynchronously as soon as autograd has accumulated
  it (`register_post_accumulate_grad_hook`), so communication overlaps the rest of backward.
  With `bucket_size_mb` the gradients are grouped into buckets of about that size, filled in
  reverse parameter order (roughly the order backward produces them); a bucket is
  all-reduced, from a flat copy, once all its gradients are ready.

Averaging is "sum, then divide by the world size". For two ranks this makes the result
bit-identical to one process that back-propagates the mean of the two halves' losses: each
rank's gradient g_r is exactly what autograd computes for that half, the reduction computes
g_0 + g_1 (float addition of two terms is commutative, so both ranks and the single process
get the same bits), and scaling by 1/2 is exact in binary floating point. With more ranks the
reduction order of the backend differs from a sequential sum and results agree only to
rounding.

Parameters with `requires_grad=False` are skipped; parameters that receive no gradient in a
step keep `grad=None` (the set of such parameters must be the same on every rank, as for
`torch.nn.parallel.DistributedDataParallel` without `find_unused_parameters`). A parameter
reached through two modules (tied weights) is one `Parameter` and is reduced once.

Gradient accumulation works without a `no_sync` context: with per-parameter overlap, a
gradient whose previous all-reduce is still in flight is waited for and averaged before
autograd adds the next micro-batch to it (a pre-accumulation hook), so the final result is
the average of the accumulated gradients; buckets copy gradients out, so a re-filled bucket
simply discards its earlier result and reduces the accumulated gradients again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def broadcast_module_state(module: nn.Module, *, src: int = 0, group=None) -> None:
    """Copy rank `src`'s parameters and buffers into every other rank's `module`, in place."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=src, group=group)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Distinct parameters that require gradients, in `module.parameters()` order (tied ones once)."""
    return [p for p in module.parameters() if p.requires_grad]


class _DataParallel(nn.Module):
    """Shared construction and forward for the wrappers: holds `.module`, broadcasts it."""

    def __init__(self, module: nn.Module, *, process_group=None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        broadcast_module_state(module, group=process_group)
        self._params = trainable_parameters(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError


class NaiveDDP(_DataParallel):
    """After backward, a blocking all-reduce of each gradient in turn, then divide by world size."""

    def finish_gradient_synchronization(self) -> None:
        for p in self._params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.process_group)
                p.grad.div_(self.world_size)


class FlatDDP(_DataParallel):
    """After backward, one all-reduce of all gradients concatenated into a single flat buffer."""

    def finish_gradient_synchronization(self) -> None:
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.process_group)
        flat.div_(self.world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class OverlappedAllReduce:
    """Per-parameter asynchronous gradient all-reduce, launched from autograd hooks.

    Used by `DDP` (per-parameter mode) and by `FSDP` for its replicated parameters.
    """

    def __init__(self, params: list[nn.Parameter], *, process_group=None) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._pending: dict[int, tuple[nn.Parameter, Any]] = {}
        self._handles = []
        self.enabled = True  # False inside `no_sync`: gradients only accumulate locally
        for p in params:
            self._handles.append(p.register_hook(self._make_pre_accumulate_hook(p)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._launch))

    def _make_pre_accumulate_hook(self, param: nn.Parameter):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            # A previous micro-batch's all-reduce may still be writing param.grad: finish it
            # (and average it) before autograd adds this micro-batch's gradient in place.
            pending = self._pending.pop(id(param), None)
            if pending is not None:
                pending[1].wait()
                param.grad.div_(self.world_size)
            return grad

        return hook

    def _launch(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        work = dist.all_reduce(param.grad, group=self.process_group, async_op=True)
        self._pending[id(param)] = (param, work)

    def finish(self) -> None:
        """Wait for every launched all-reduce and divide by the world size."""
        for param, work in self._pending.values():
            work.wait()
            param.grad.div_(self.world_size)
        self._pending.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class _Bucket:
    """A group of parameters whose gradients travel in one all-reduce of a flat copy."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.ready: set[int] = set()  # ids of params whose gradient is accumulated this step
        self.work = None  # in-flight all-reduce
        self.flat: torch.Tensor | None = None
        self.members: list[nn.Parameter] = []  # the params packed into `flat`, in order

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


class DDP(_DataParallel):
    """Data parallelism with gradient all-reduces overlapped with backward.

    `bucket_size_mb=None` launches one asynchronous all-reduce per gradient as soon as it is
    ready; a number groups gradients into buckets of about that many megabytes (2**20 bytes).
    Call `finish_gradient_synchronization()` after the last backward of a step.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = None, *, process_group=None) -> None:
        super().__init__(module, process_group=process_group)
        self.bucket_size_mb = bucket_size_mb
        self._handles = []
        self._overlap: OverlappedAllReduce | None = None
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._sync_enabled = True
        if bucket_size_mb is None:
            self._overlap = OverlappedAllReduce(self._params, process_group=process_group)
        else:
            self._buckets = self._build_buckets(bucket_size_mb)
            for bucket in self._buckets:
                for p in bucket.params:
                    self._bucket_of[id(p)] = bucket
                    self._handles.append(p.register_post_accumulate_grad_hook(self._mark_ready))

    def _build_buckets(self, bucket_size_mb: float) -> list[_Bucket]:
        # Reverse parameter order approximates the order in which backward produces gradients,
        # so the first bucket fills (and starts communicating) first.
        limit = bucket_size_mb * 2**20
        buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(self._params):
            nbytes = p.numel() * p.element_size()
            if buckets[-1] and (size + nbytes > limit or p.dtype != buckets[-1][0].dtype
                                or p.device != buckets[-1][0].device):
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        return [_Bucket(ps) for ps in buckets if ps]

    @property
    def buckets(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in launch order (empty in per-parameter mode)."""
        return [b.params for b in self._buckets]

    # bucketed mode -------------------------------------------------------------------------

    def _mark_ready(self, param: nn.Parameter) -> None:
        if not self._sync_enabled:
            return
        bucket = self._bucket_of[id(param)]
        if id(param) in bucket.ready and bucket.work is not None:
            # A new micro-batch refilled this gradient: the launched result is stale.
            bucket.work.wait()
            bucket.work, bucket.flat, bucket.ready = None, None, set()
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch_bucket(bucket)

    def _launch_bucket(self, bucket: _Bucket) -> None:
        bucket.members = [p for p in bucket.params if p.grad is not None]
        if not bucket.members:
            return
        bucket.flat = torch.cat([p.grad.reshape(-1) for p in bucket.members])
        bucket.work = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)

    # ---------------------------------------------------------------------------------------

    def finish_gradient_synchronization(self) -> None:
        """Wait for every launched all-reduce and leave the averaged gradients in `.grad`."""
        if self._overlap is not None:
            self._overlap.finish()
            return
        for bucket in self._buckets:
            # Buckets holding parameters that got no gradient this step never filled up; launch
            # them now with the gradients that exist (in the same order on every rank).
            if bucket.work is None and bucket.ready:
                self._launch_bucket(bucket)
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.flat.div_(self.world_size)
                offset = 0
                for p in bucket.members:
                    p.grad.copy_(bucket.flat[offset : offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
            bucket.work, bucket.flat, bucket.ready, bucket.members = None, None, set(), []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating.

        The first backward after the context reduces the accumulated gradients (as in
        `torch.nn.parallel.DistributedDataParallel.no_sync`).
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        if self._overlap is not None:
            self._overlap.enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous
            if self._overlap is not None:
                self._overlap.enabled = previous

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the wrapped module then trains as a plain module)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._overlap is not None:
            self._overlap.remove()


__all__ = ["DDP", "NaiveDDP", "FlatDDP", "OverlappedAllReduce", "broadcast_module_state", "trainable_parameters"]
