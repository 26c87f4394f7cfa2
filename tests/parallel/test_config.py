"""`ParallelConfig.ignored_options`: the [parallel] options a run's strategy never reads."""

import pytest

from scratchlm.parallel.config import ParallelConfig


@pytest.mark.parametrize("kwargs, note", [
    ({"backend": "gloo", "timeout_s": 60.0},
     'parallel.backend="gloo", parallel.timeout_s=60.0 have no effect (parallel.strategy="none" trains in one '
     'process: no process group, no gradient communication)'),
    ({"bucket_size_mb": 50.0, "optimizer_state": "sharded"},
     'parallel.bucket_size_mb=50.0, parallel.optimizer_state="sharded" have no effect (parallel.strategy="none" '
     'trains in one process: no process group, no gradient communication)'),
    ({"strategy": "ddp", "bucket_size_mb": 50.0},
     'parallel.bucket_size_mb=50.0 has no effect (it sizes the gradient buckets of parallel.strategy='
     '"ddp_bucketed" or "torch_ddp"; this run\'s is "ddp")'),
    ({"strategy": "flat_ddp", "optimizer_state": "sharded"},
     'parallel.optimizer_state="sharded" has no effect (parallel.strategy="flat_ddp" keeps the whole optimizer '
     'state on every rank and saves it once)'),
])
def test_options_the_strategy_never_reads_are_named(kwargs, note):
    assert ParallelConfig(**kwargs).ignored_options() == [note]


@pytest.mark.parametrize("kwargs", [
    {}, {"strategy": "ddp"},
    {"strategy": "ddp_bucketed", "bucket_size_mb": 50.0, "backend": "gloo", "timeout_s": 60.0},
    {"strategy": "torch_ddp", "bucket_size_mb": 5.0},
    {"strategy": "zero1", "optimizer_state": "sharded"},
    {"strategy": "fsdp", "optimizer_state": "sharded", "compute_dtype": "bf16"},
    {"strategy": "torch_fsdp2", "optimizer_state": "sharded"},
])
def test_options_the_strategy_reads_are_not_named(kwargs):
    assert ParallelConfig(**kwargs).ignored_options() == []
