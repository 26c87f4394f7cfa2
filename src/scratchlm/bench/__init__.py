"""Benchmark harness, model benchmarks (`run_bench`, behind `scratchlm bench`), profiling and memory tools.

Names are resolved lazily: `scratchlm.bench.results` (JSON and metrics files) imports without torch.
"""

from __future__ import annotations

from scratchlm.lazy_exports import lazy_exports

_EXPORTS: dict[str, str] = {
    "BenchmarkResult": "scratchlm.bench.harness",
    "benchmark": "scratchlm.bench.harness",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
