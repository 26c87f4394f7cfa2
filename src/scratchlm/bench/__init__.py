"""Benchmark harness, the `scratchlm bench` command, profiling and memory tools."""

from scratchlm.bench.harness import BenchmarkResult, benchmark

__all__ = ["BenchmarkResult", "benchmark"]
