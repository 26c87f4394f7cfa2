"""Benchmark harness, model benchmarks (`run_bench`, behind `scratchlm bench`), profiling and memory tools."""

from scratchlm.bench.harness import BenchmarkResult, benchmark

__all__ = ["BenchmarkResult", "benchmark"]
