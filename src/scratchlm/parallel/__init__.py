"""Data parallelism, optimizer-state sharding and FSDP on torch.distributed, and the trainer's strategies.

Names are imported lazily so that importing the package (e.g. for `ParallelConfig`) does not
import torch.distributed.
"""

from __future__ import annotations

from scratchlm.lazy_exports import lazy_exports

_EXPORTS = {
    "DDP": "scratchlm.parallel.ddp",
    "NaiveDDP": "scratchlm.parallel.ddp",
    "FlatDDP": "scratchlm.parallel.ddp",
    "ShardedOptimizer": "scratchlm.parallel.sharded_optimizer",
    "FSDP": "scratchlm.parallel.fsdp",
    "ParallelConfig": "scratchlm.parallel.config",
    "ParallelEngine": "scratchlm.parallel.engine",
    "init_engine": "scratchlm.parallel.engine",
    "Strategy": "scratchlm.parallel.strategy",
    "init_strategy": "scratchlm.parallel.strategy",
    "STRATEGIES": "scratchlm.parallel.registry",
    "parallelize": "scratchlm.parallel.parallelize",
    "spawn": "scratchlm.parallel.launch",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
