"""Profiling helpers: NVTX ranges for Nsight Systems, torch.profiler tables, memory snapshots.

NVTX ranges cost nothing visible without a profiler attached; on machines without CUDA
every helper here is a no-op (or raises a clear error where CUDA is required).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["nvtx_range", "add_layer_nvtx_ranges", "memory_snapshot", "profile_table"]


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
