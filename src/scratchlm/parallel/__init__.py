"""Data parallelism, optimizer-state sharding and FSDP on torch.distributed, and the trainer's engine.

Names are imported lazily so that importing the package (e.g. for `ParallelConfig`) does not
import torch.distributed.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DDP": "scratchlm.parallel.ddp",
    "NaiveDDP": "scratchlm.parallel.ddp",
    "FlatDDP": "scratchlm.parallel.ddp",
    "ShardedOptimizer": "scratchlm.parallel.sharded_optimizer",
    "FSDP": "scratchlm.parallel.fsdp",
    "ParallelConfig": "scratchlm.parallel.config",
    "ParallelEngine": "scratchlm.parallel.engine",
    "init_engine": "scratchlm.parallel.engine",
    "spawn": "scratchlm.parallel.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'scratchlm.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
