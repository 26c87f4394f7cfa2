"""Timing steps back to back, as a training loop runs them.

`scratchlm.bench.harness.benchmark` synchronises the device around every step, which adds each
step's launch latency before its first kernel. A training loop does not wait: the host queues
the next step while the device works. The functions here time a run of steps with one
synchronisation at the end, and report seconds per step.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from scratchlm.bench.harness import timing_device

__all__ = ["back_to_back", "captured_call_seconds", "copy_bandwidth", "graph_replay", "timed_windows"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_windows(step: Callable[[], Any], steps: int, windows: int, *,
                  device: str | torch.device | None = None) -> list[float]:
    """Seconds per step of each of ``windows`` windows of ``steps`` back-to-back steps (host clock,
    the device synchronised before and after each window)."""
    if steps < 1 or windows < 1:
        raise ValueError(f"steps and windows must be >= 1, got {steps} and {windows}")
    dev = timing_device(device)
    times = []
    for _ in range(windows):
        _synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _synchronize(dev)
        times.append((time.perf_counter() - t0) / steps)
    return times


def back_to_back(step: Callable[[], Any], steps: int, repeats: int = 3, *,
                 device: str | torch.device | None = None) -> float:
    """Seconds per step of ``steps`` steps run back to back, the median of ``repeats`` such runs.

    On CUDA the run is bracketed by CUDA events (device time from the first step's start to the
    last step's end); elsewhere by the host clock. With an even ``repeats`` the upper median.
    """
    if steps < 1 or repeats < 1:
        raise ValueError(f"steps and repeats must be >= 1, got {steps} and {repeats}")
    dev = timing_device(device)
    if dev.type != "cuda":
        per_step = timed_windows(step, steps, repeats, device=dev)
        return sorted(per_step)[len(per_step) // 2]
    per_step = []
    for _ in range(repeats):
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        per_step.append(start.elapsed_time(end) / 1e3 / steps)
    return sorted(per_step)[len(per_step) // 2]


def captured_call_seconds(fn: Callable[[], Any], calls: int, repeats: int = 3, *, replays: int = 10) -> float:
    """Seconds per call of ``fn`` captured ``calls`` times back to back in one CUDA graph (after 3
    warm-up calls on a side stream), the graph replayed ``replays`` times back to back, the median
    of ``repeats`` such runs: a kernel's time with its launch inside a graph, as a captured
    decode step runs it, without the host's launch cost. CUDA only."""
    return back_to_back(graph_replay(fn, calls), steps=replays, repeats=repeats) / calls


def graph_replay(fn: Callable[[], Any], calls: int = 1, warmup: int = 3) -> Callable[[], None]:
    """The replay of a CUDA graph that captured ``fn`` ``calls`` times back to back, after
    ``warmup`` calls on a side stream (which also run any autotuner). CUDA only."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def copy_bandwidth(gib: int = 1, repeats: int = 10) -> float:
    """The CUDA device's memory bandwidth in bytes/s, as a device-to-device copy of `gib` GiB
    reaches it (read and write both counted): the denominator of the decode benchmarks'
    "share of the bandwidth limit". Timed with events over `repeats` copies after 3 warm-ups."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    return 2 * src.numel() / seconds
