"""Profiling helpers: NVTX ranges for Nsight Systems, torch.profiler tables, memory snapshots.

NVTX ranges cost nothing visible without a profiler attached; on machines without CUDA
every helper here is a no-op (or raises a clear error where CUDA is required).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["nvtx_range", "add_layer_nvtx_ranges", "memory_snapshot", "profile_table", "KERNEL_CLASSES",
           "kernel_class", "kernel_times", "kernel_breakdown"]


def _nvtx_enabled() -> bool:
    return torch.cuda.is_available()


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """An NVTX range (visible in nsys timelines) around the block; no-op without CUDA."""
    if not _nvtx_enabled():
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def add_layer_nvtx_ranges(model: nn.Module, *, prefix: str = "") -> list[Any]:
    """Push an NVTX range in each block's forward pre-hook and pop it in its forward hook.

    Blocks are the entries of ``model.layers`` plus ``lm_head`` when present. Returns the hook
    handles (call ``.remove()`` on each to undo).
    """
    if not _nvtx_enabled():
        return []
    named: list[tuple[str, nn.Module]] = []
    layers = getattr(model, "layers", None)
    if layers is not None:
        named += [(f"{prefix}layer{i}", m) for i, m in enumerate(layers)]
    if getattr(model, "lm_head", None) is not None:
        named.append((f"{prefix}lm_head", model.lm_head))
    handles = []
    for name, module in named:
        handles.append(module.register_forward_pre_hook(lambda m, a, _n=name: torch.cuda.nvtx.range_push(_n)))
        handles.append(module.register_forward_hook(lambda m, a, o: torch.cuda.nvtx.range_pop()))
    return handles


@contextlib.contextmanager
def memory_snapshot(path: str | Path | None, *, max_entries: int = 100_000) -> Iterator[None]:
    """Record CUDA allocator history inside the block and dump it to ``path`` (a pickle for
    https://pytorch.org/memory_viz). ``path=None`` does nothing."""
    if path is None:
        yield
        return
    if not torch.cuda.is_available():
        from scratchlm.errors import UserError

        raise UserError("--memory-snapshot needs a CUDA device")
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        yield
    finally:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


def profile_table(fn: Callable[[], Any], steps: int = 2, *, row_limit: int = 20) -> str:
    """Run ``fn`` ``steps`` times under torch.profiler and return the top-ops table."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    sort_by = "self_cpu_time_total"
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        sort_by = "self_device_time_total"
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by=sort_by, row_limit=row_limit)


# Classes of GPU kernels in a training step, first match wins: cuBLAS/CUTLASS matmuls (nvjet is
# cuBLAS's Hopper family), attention (scratchlm's Triton kernels, cuDNN's and FlashAttention's),
# the LM head's loss kernel, optimizer kernels (fused and multi-tensor), the SwiGLU gate's
# backward kernel, and Inductor's generated Triton kernels (the fused elementwise and reduction
# work: norms, RoPE, the SwiGLU forward, casts).
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|splitKreduce"),
    ("attention", r"^_fwd_kernel|^_bwd_(dkdv|dq)|cudnn|flash|fmha|sdpa"),
    ("loss", r"cross_entropy"),
    ("optimizer", r"adam|multi_tensor_apply"),
    ("swiglu", r"swiglu"),
    ("rope", r"^_rope"),
    ("inductor", r"^triton_"),
)


def kernel_class(name: str) -> str:
    """The KERNEL_CLASSES name of a GPU kernel, or "other" (copies, memsets, eager elementwise)."""
    return next((cls for cls, pattern in KERNEL_CLASSES if re.search(pattern, name, re.IGNORECASE)), "other")


def kernel_times(fn: Callable[[], Any], steps: int = 2, *, warmup: int = 1) -> dict[str, tuple[float, float]]:
    """Run ``fn`` ``steps`` times under torch.profiler: {kernel name: (ms per call of fn, launches
    per call)}, GPU kernels only (user annotations such as ``Optimizer.step#...`` excluded)."""
    if not torch.cuda.is_available():
        from scratchlm.errors import UserError

        raise UserError("kernel_times needs a CUDA device")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        total_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        times[e.key] = (total_us / 1e3 / steps, e.count / steps)
    return times


def kernel_breakdown(times: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Milliseconds per class (KERNEL_CLASSES, then "other") of ``kernel_times``' result, plus
    "total"; classes in decreasing time."""
    by_class: dict[str, float] = {}
    for name, (ms, _) in times.items():
        cls = kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + ms
    out = dict(sorted(by_class.items(), key=lambda kv: -kv[1]))
    out["total"] = sum(by_class.values())
    return out
