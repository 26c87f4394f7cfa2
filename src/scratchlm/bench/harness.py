"""Timing harness: warm up, time each step with device synchronisation, report statistics.

On CUDA each step is bracketed by CUDA events (device time of the step, launch gaps
included) and the peak allocated memory of the timed steps is recorded; elsewhere a host
clock is used after an optional ``sync`` call.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from scratchlm.device import gpu_peak_flops, resolve_device

__all__ = ["BenchmarkResult", "benchmark", "timing_device", "H200_BF16_DENSE_PEAK", "H200_BF16_MEASURED_MATMUL"]

# Dense bf16 tensor-core rate of an H200 SXM by its datasheet (FLOP/s; an H100 SXM's too).
H200_BF16_DENSE_PEAK = gpu_peak_flops("H200", "bf16")
# An 8192^3 bf16 matmul through PyTorch on the H200 used for the benchmarks in docs/benchmarks.
H200_BF16_MEASURED_MATMUL = 753e12


@dataclass
class BenchmarkResult:
    """Per-step times in seconds and the peak memory (bytes) allocated while timing."""

    times: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def std(self) -> float:
        return statistics.stdev(self.times) if len(self.times) > 1 else 0.0

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(mean=self.mean, std=self.std, min=self.min, median=self.median)
        return out

    def __str__(self) -> str:
        mem = "" if self.peak_memory_bytes is None else f", peak {self.peak_memory_bytes / 2**30:.2f} GiB"
        return f"{self.mean * 1e3:.3f} ± {self.std * 1e3:.3f} ms (min {self.min * 1e3:.3f}){mem}"


def timing_device(device: str | torch.device | None) -> torch.device:
    """The device to time on: `device` (see `scratchlm.device.resolve_device`), by default CUDA
    when available, else the CPU. Not MPS: the timers synchronise CUDA only."""
    return resolve_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))


def benchmark(fn: Callable[[], Any], warmup: int = 5, steps: int = 10,
              sync: bool | Callable[[], None] = True, *,
              device: str | torch.device | None = None) -> BenchmarkResult:
    """Run ``fn`` ``warmup`` times untimed, then ``steps`` timed times.

    ``sync``: True synchronises the device around every step (CUDA events on CUDA), a
    callable is called instead of the default synchronisation, False times host dispatch only.
    ``device`` defaults to CUDA when available.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    dev = timing_device(device)
    cuda = dev.type == "cuda"

    def synchronize() -> None:
        if callable(sync):
            sync()
        elif sync and cuda:
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        fn()
    synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    result = BenchmarkResult()
    use_events = cuda and sync is True
    for _ in range(steps):
        if use_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            result.times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            synchronize()
            result.times.append(time.perf_counter() - t0)
    if cuda:
        result.peak_memory_bytes = torch.cuda.max_memory_allocated(dev)
    assert all(math.isfinite(t) for t in result.times)
    return result
