"""One two-process gloo run shared by the distributed tests of this folder.

Starting processes and importing torch dominates the cost of a distributed test on CPU, so
every training job the tests inspect runs in a single `spawn` (lazily, the first time a test
asks for it) and each test reads its job's result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_workers  # noqa: E402

WORLD = 2
STEPS = 3

# (model kind, wrapper, steps, optimizer, options): results of `dist_workers.train_strategy`.
WRAPPER_JOBS = {
    "toy-naive": ("toy", "naive", STEPS),
    "toy-flat": ("toy", "flat", STEPS),
    "toy-ddp": ("toy", "ddp", STEPS),
    "toy-ddp_bucketed": ("toy", "ddp_bucketed", STEPS),
    "toy-zero1": ("toy", "zero1", STEPS),
    "lm-ddp_bucketed-one-bucket": ("lm", "ddp_bucketed", STEPS, "adamw", {"bucket_size_mb": 1000}),
    "lm-fsdp": ("lm", "fsdp", STEPS),
    "lm_tied-fsdp": ("lm_tied", "fsdp", STEPS),
    "lm-fsdp-bf16": ("lm", "fsdp", STEPS, "adamw", {"compute_dtype": "bfloat16"}),
    "lm-ddp-accum": ("lm", "ddp", STEPS, "adamw", {"micro_batches": 2}),
    "lm-ddp_bucketed-accum": ("lm", "ddp_bucketed", STEPS, "adamw", {"micro_batches": 2}),
    "lm-fsdp-accum": ("lm", "fsdp", STEPS, "adamw", {"micro_batches": 2}),
}

# (strategy, model kind, steps, optimizer_state, compute_dtype): results of `dist_workers.engine_job`.
ENGINE_JOBS = {
    **{s: (s,) for s in ("ddp", "ddp_bucketed", "naive_ddp", "flat_ddp", "zero1", "fsdp", "torch_ddp",
                         "torch_fsdp2")},
    "zero1-sharded": ("zero1", "lm", STEPS, "sharded"),
    "fsdp-sharded": ("fsdp", "lm", STEPS, "sharded"),
    "torch_fsdp2-sharded": ("torch_fsdp2", "lm", STEPS, "sharded"),
    "fsdp-tied": ("fsdp", "lm_tied", STEPS),
}


@pytest.fixture(scope="session")
def distributed_results() -> dict[str, dict[str, list]]:
    """{"wrappers": {job: [rank0, rank1]}, "engine": {job: [rank0, rank1]}} from one 2-rank run."""
    from scratchlm.parallel.launch import spawn

    wrapper_jobs = list(WRAPPER_JOBS.values())
    engine_jobs = list(ENGINE_JOBS.values())
    per_rank = spawn(dist_workers.run_all, WORLD, args=(wrapper_jobs, engine_jobs), timeout_s=240)
    wrappers = {name: [r[0][i] for r in per_rank] for i, name in enumerate(WRAPPER_JOBS)}
    engine = {name: [r[1][i] for r in per_rank] for i, name in enumerate(ENGINE_JOBS)}
    return {"wrappers": wrappers, "engine": engine}


@pytest.fixture(scope="session")
def references() -> dict[tuple[str, bool, float], dict]:
    """Single-process reference runs, computed on demand and cached: key (kind, joint, clip)."""
    cache: dict = {}

    class _Refs(dict):
        def __missing__(self, key):
            kind, joint, clip = key
            cache[key] = dist_workers.train_reference(kind, STEPS, WORLD, clip=clip, joint=joint)
            self[key] = cache[key]
            return cache[key]

    return _Refs()


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank inside the test process (fast, for API-level tests)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
