"""Fully sharded data parallelism: each rank stores 1/N of every large weight, its gradient and state.

What is sharded: the `weight` of every scratchlm `Linear` and `Embedding` (matched with
`isinstance`, so subclasses count). Each such weight of shape (rows, ...) is padded along dim 0
to a multiple of the world size N and split into N equal row blocks; rank r keeps block r as
an fp32 `Parameter` of shape (rows_padded / N, ...) that replaces the original one on the
module. This is "flatten, pad to a multiple of N, keep one chunk" with the padding rounded to
whole rows, so each shard is a contiguous slice of the row-major weight, the all-gather of
the shards *is* the padded full weight, and a shard keeps the dimensionality of its weight
(rules such as "decay only matrices" still work on the wrapped model). Everything else (RMSNorm
gains) is replicated and all-reduced like in `DDP`.

Forward. A pre-forward hook on each sharded module all-gathers its weight (cast first to the
compute dtype, so a bf16 run moves half the bytes) and places the full tensor on the module
as a plain attribute for the duration of its forward, through a custom autograd Function
(`_GatherWeight`) whose backward receives the gradient of the full weight. The module's own
`forward` runs unchanged, so it computes the very same operations as without FSDP. A
post-forward hook removes the full weight again.

Backward. The autograd graph would normally keep the gathered weight alive until backward
(matmul saves its operands). While a sharded module runs forward, a saved-tensor hook replaces
any saved tensor that lives in the gathered weight's storage by a small token, and the unpack
side all-gathers the weight again when backward needs it; so a full weight exists only while
its own module computes. The gradient of the full weight is reduce-scattered (asynchronously)
into a shard-sized buffer; `finish_gradient_synchronization()` waits, divides by N and adds
the result into the shard's `.grad` (fp32, shard shape), ready for any optimizer.

Precision. With `compute_dtype` (torch.bfloat16 or torch.float16) weights are gathered in that
dtype and the inputs of sharded modules are cast to it; gradients of the full weights arrive
in the compute dtype and are cast to fp32 *before* the reduce-scatter (reduction in fp32:
N-way sums of bf16 values lose bits, and fp32 costs only the gradient traffic). Master
weights, their gradients and the optimizer state stay fp32. Replicated parameters stay fp32.

Tied weights (the same Parameter on an Embedding and a Linear) are sharded once; both modules
gather it. Their full gradients are summed locally first and reduce-scattered once, in
`finish_gradient_synchronization()`, so the result is the same sum the unsharded model forms.

Bitwise equality. In fp32 with two ranks, training with FSDP gives the same bits as one
process back-propagating the mean of the two halves' losses, for the same reason as in
`DDP`: forward computes with bit-identical full weights, each rank's full gradient is the
single-process gradient of its half, the reduce-scatter adds two terms, and /2 is exact.
One process running the whole batch in one forward is not reproducible bit for bit: a Linear
weight's gradient is then one matrix product over all tokens, summed in the BLAS kernel's
order, which no combination of the halves' gradients reproduces in general
(tests/parallel/test_fsdp_numerics.py shows two batches with identical halves' gradients and
different full-batch gradients); it agrees to an ulp or two after an SGD step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scratchlm.model.layers import Embedding, Linear
from scratchlm.parallel.ddp import OverlappedAllReduce, broadcast_module_state
from scratchlm.parallel.process_group import all_gather_flat, reduce_scatter_flat

SHARDED_TYPES: tuple[type[nn.Module], ...] = (Linear, Embedding)


class _ShardedWeight:
    """Bookkeeping for one sharded weight: its shard Parameter, full shape, users and pending grads."""

    def __init__(self, fsdp: FSDP, shard: nn.Parameter, full_shape: torch.Size) -> None:
        self.fsdp = fsdp
        self.shard = shard
        self.full_shape = full_shape
        self.rows = full_shape[0]
        self.users = 0  # how many modules hold this weight (2 when tied)
        self.storage_ptr: int | None = None  # storage of the gathered weight during forward
        self.full_grad: torch.Tensor | None = None  # local sum of full grads (tied weights only)
        self.pending: list[tuple[Any, torch.Tensor]] = []  # (work, shard-sized reduced grad)

    def gather(self, dtype: torch.dtype) -> torch.Tensor:
        """The full (unpadded) weight in `dtype`, gathered from every rank's shard."""
        shard = self.shard.detach().to(dtype)
        world = self.fsdp.world_size
        out = torch.empty((shard.shape[0] * world, *shard.shape[1:]), dtype=dtype, device=shard.device)
        all_gather_flat(out, shard.contiguous(), group=self.fsdp.process_group)
        return out[: self.rows]

    def reduce_grad(self, full_grad: torch.Tensor) -> None:
        """Start the reduce-scatter of a full-weight gradient into a new shard-sized buffer."""
        full_grad = full_grad.to(self.shard.dtype)
        padded_rows = self.shard.shape[0] * self.fsdp.world_size
        if padded_rows != self.rows:
            pad = full_grad.new_zeros((padded_rows - self.rows, *full_grad.shape[1:]))
            full_grad = torch.cat([full_grad, pad])
        out = torch.empty_like(self.shard)
        work = reduce_scatter_flat(out, full_grad.contiguous(), group=self.fsdp.process_group, async_op=True)
        self.pending.append((work, out))


class _Regather:
    """Token saved for backward in place of (a view of) a gathered weight."""

    __slots__ = ("weight", "size", "stride", "offset", "dtype")

    def __init__(self, weight: _ShardedWeight, t: torch.Tensor) -> None:
        self.weight, self.dtype = weight, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class _GatherWeight(torch.autograd.Function):
    """shard -> full weight (compute dtype) in forward; full-weight grad -> reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, weight: _ShardedWeight, dtype: torch.dtype) -> torch.Tensor:
        ctx.weight = weight
        return weight.gather(dtype)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        weight: _ShardedWeight = ctx.weight
        if weight.users > 1:
            # Tied: sum every user's gradient locally, reduce once at synchronisation.
            g = grad_full.to(weight.shard.dtype)
            weight.full_grad = g.clone() if weight.full_grad is None else weight.full_grad.add_(g)
        else:
            weight.reduce_grad(grad_full)
        # The shard's gradient is written by finish_gradient_synchronization, not by autograd.
        return None, None, None


class FSDP(nn.Module):
    """Shard the Linear and Embedding weights of `module` across the ranks of the process group.

    Construct on every rank (rank 0's weights are broadcast first). After the last backward of
    a step call `finish_gradient_synchronization()`, then step any optimizer over
    `self.parameters()`.
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        *,
        process_group=None,
        sharded_types: tuple[type[nn.Module], ...] = SHARDED_TYPES,
    ) -> None:
        super().__init__()
        self.module = module
        self.compute_dtype = compute_dtype
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        broadcast_module_state(module, group=process_group)
        self._weights: dict[int, _ShardedWeight] = {}  # id(shard Parameter) -> bookkeeping
        by_original: dict[int, _ShardedWeight] = {}
        self._hooks = []
        self._active: dict[int, list[tuple[str, _ShardedWeight]]] = {}
        for sub in module.modules():
            if not isinstance(sub, sharded_types):
                continue
            names = []
            for name, p in list(sub._parameters.items()):
                if p is None:
                    continue
                w = by_original.get(id(p))
                if w is None:
                    w = self._make_shard(p)
                    by_original[id(p)] = w
                    self._weights[id(w.shard)] = w
                w.users += 1
                sub._parameters[name] = w.shard
                names.append((name, w))
            if names:
                self._active[id(sub)] = names
                self._hooks.append(sub.register_forward_pre_hook(self._pre_forward))
                self._hooks.append(sub.register_forward_hook(self._post_forward, always_call=True))
        self._replicated = [p for p in module.parameters() if p.requires_grad and id(p) not in self._weights]
        self._replicated_reducer = OverlappedAllReduce(self._replicated, process_group=process_group)
        self._saved_hooks: dict[int, Any] = {}

    def _make_shard(self, p: nn.Parameter) -> _ShardedWeight:
        full = p.detach()
        rows = full.shape[0]
        per_rank = -(-rows // self.world_size)
        padded = per_rank * self.world_size
        if padded != rows:
            full = torch.cat([full, full.new_zeros((padded - rows, *full.shape[1:]))])
        chunk = full[self.rank * per_rank : (self.rank + 1) * per_rank].clone()
        shard = nn.Parameter(chunk, requires_grad=p.requires_grad)
        return _ShardedWeight(self, shard, p.shape)

    # hooks ---------------------------------------------------------------------------------

    def _pre_forward(self, sub: nn.Module, args: tuple) -> tuple | None:
        dtype = self.compute_dtype or next(iter(self._active[id(sub)]))[1].shard.dtype
        ptrs = {}
        for name, w in self._active[id(sub)]:
            full = _GatherWeight.apply(w.shard, w, dtype)
            sub.__dict__[name] = full  # shadows the shard Parameter during this forward
            ptrs[full.untyped_storage().data_ptr()] = w
        if (torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None):
            # Only outside backward (during activation-checkpoint recomputation the gathered
            # weight is needed at once) and only when no other saved-tensor hooks are active:
            # inside a checkpointed block, checkpoint's own hooks already drop every saved
            # tensor, the gathered weight included, and must see all of them.
            hooks = torch.autograd.graph.saved_tensors_hooks(_make_pack(ptrs), _unpack)
            hooks.__enter__()
            self._saved_hooks[id(sub)] = hooks
        if self.compute_dtype is not None:
            args = tuple(a.to(self.compute_dtype) if torch.is_tensor(a) and a.is_floating_point() else a
                         for a in args)
            return args
        return None

    def _post_forward(self, sub: nn.Module, args: tuple, output: Any) -> None:
        hooks = self._saved_hooks.pop(id(sub), None)
        if hooks is not None:
            hooks.__exit__(None, None, None)
        for name, _ in self._active[id(sub)]:
            sub.__dict__.pop(name, None)

    # public --------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for all gradient reductions; shards get averaged fp32 `.grad` of the shard's shape."""
        for w in self._weights.values():
            if w.full_grad is not None:
                w.reduce_grad(w.full_grad)
                w.full_grad = None
        self._replicated_reducer.finish()
        for w in self._weights.values():
            for work, reduced in w.pending:
                work.wait()
                reduced.div_(self.world_size)
                if w.shard.grad is None:
                    w.shard.grad = reduced
                else:
                    w.shard.grad.add_(reduced)
            w.pending.clear()

    def is_sharded(self, p: torch.Tensor) -> bool:
        """Whether `p` is the shard of a sharded weight (otherwise it is replicated)."""
        return id(p) in self._weights

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters keyed like `named_parameters()` of the unwrapped module (on every rank)."""
        out = {}
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                w = self._weights.get(id(p))
                out[name] = w.gather(p.dtype).clone() if w is not None else p.detach().clone()
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """`state_dict()` of the unwrapped module with every shard replaced by its full weight."""
        out = {}
        gathered: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for key, t in self.module.state_dict(keep_vars=True).items():
                w = self._weights.get(id(t))
                if w is None:
                    out[key] = t.detach().clone()
                else:
                    if id(t) not in gathered:
                        gathered[id(t)] = w.gather(t.dtype).clone()
                    out[key] = gathered[id(t)]
        return out

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full (unsharded) tensors: each rank copies in its own rows of the sharded weights."""
        with torch.no_grad():
            for key, t in self.module.state_dict(keep_vars=True).items():
                if key not in state_dict:
                    raise KeyError(f"missing key {key!r} in state dict")
                src = state_dict[key].to(device=t.device, dtype=t.dtype)
                w = self._weights.get(id(t))
                if w is None:
                    t.copy_(src)
                else:
                    t.copy_(self.shard_of(w, src))

    def shard_of(self, w: _ShardedWeight, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full tensor shaped like `w`'s weight (zero-padded)."""
        per_rank = w.shard.shape[0]
        start = self.rank * per_rank
        piece = full[start : start + per_rank]
        if piece.shape[0] < per_rank:
            piece = torch.cat([piece, piece.new_zeros((per_rank - piece.shape[0], *piece.shape[1:]))])
        return piece

    def sharded_weight(self, p: torch.Tensor) -> _ShardedWeight | None:
        """Bookkeeping of a shard Parameter (None for replicated parameters)."""
        return self._weights.get(id(p))


def _make_pack(ptrs: dict[int, _ShardedWeight]):
    def pack(t: torch.Tensor) -> Any:
        w = ptrs.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        return _Regather(w, t) if w is not None else t

    return pack


def _unpack(saved: Any) -> torch.Tensor:
    if not isinstance(saved, _Regather):
        return saved
    with torch.no_grad():
        full = saved.weight.gather(saved.dtype)
    return full.as_strided(saved.size, saved.stride, saved.offset)
