"""Data-parallel / sharding strategy options (the `[parallel]` section of a training config)."""

from __future__ import annotations

from dataclasses import dataclass

from scratchlm.config import changed_fields, settings_text

COMPUTE_DTYPES = ("none", "bf16", "fp16")
OPTIMIZER_STATE_FORMATS = ("full", "sharded")


@dataclass
class ParallelConfig:
    strategy: str = "none"  # a name of scratchlm.parallel.registry.STRATEGIES; "none" = a single process
    bucket_size_mb: float = 25.0  # gradient bucket size for "ddp_bucketed" (and torch_ddp's bucket_cap_mb)
    backend: str = "auto"  # "auto" (nccl on CUDA, else gloo), "nccl" or "gloo"
    compute_dtype: str = "none"  # FSDP compute dtype: "none" (= master fp32), "bf16" or "fp16"
    # How zero1/fsdp/torch_fsdp2 checkpoint optimizer state: "full" gathers it on rank 0 in the
    # single-process layout (optimizer.pt; resumable with any world size or strategy),
    # "sharded" has every rank save its own part (optimizer.pt + optimizer.rankN.pt; resume with
    # the same world size and strategy). Replicated strategies always save one optimizer.pt.
    optimizer_state: str = "full"
    timeout_s: float = 600.0  # collective timeout: a rank stuck this long fails instead of hanging

    def __post_init__(self) -> None:
        from scratchlm.parallel.registry import STRATEGIES

        if self.strategy not in STRATEGIES:
            raise ValueError(f"parallel.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"parallel.backend must be 'auto', 'nccl' or 'gloo', got {self.backend!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"parallel.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}"
            )
        if self.compute_dtype != "none" and not STRATEGIES[self.strategy].uses_compute_dtype:
            users = ", ".join(name for name, cls in STRATEGIES.items() if cls.uses_compute_dtype)
            raise ValueError(f"parallel.compute_dtype={self.compute_dtype!r} applies to {users} only, "
                             f"not parallel.strategy={self.strategy!r} (use trainer.dtype for mixed precision)")
        if self.optimizer_state not in OPTIMIZER_STATE_FORMATS:
            raise ValueError(
                f"parallel.optimizer_state must be 'full' or 'sharded', got {self.optimizer_state!r}"
            )
        if self.bucket_size_mb <= 0:
            raise ValueError(f"parallel.bucket_size_mb must be positive, got {self.bucket_size_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"parallel.timeout_s must be positive, got {self.timeout_s}")

    def ignored_options(self) -> list[str]:
        """One line for each group of options set away from their defaults that this strategy never
        reads (any of them with strategy "none", which starts no process group; bucket_size_mb or
        optimizer_state with a strategy that has no buckets or keeps whole optimizer state), for a
        command to print: they would otherwise be ignored silently."""
        from scratchlm.parallel.registry import STRATEGIES
        from scratchlm.parallel.strategies.sharded import ShardedStateStrategy
        from scratchlm.parallel.strategy import DistributedStrategy

        changed = [name for name in changed_fields(self) if name != "strategy"]
        cls = STRATEGIES[self.strategy]
        if not issubclass(cls, DistributedStrategy):
            if not changed:
                return []
            return [f"{settings_text('parallel', self, changed)} no effect (parallel.strategy=\"{self.strategy}\" "
                    "trains in one process: no process group, no gradient communication)"]
        notes = []
        if "bucket_size_mb" in changed and not cls.uses_bucket_size:
            *others, last = [f'"{name}"' for name, c in STRATEGIES.items() if c.uses_bucket_size]
            users = f"{', '.join(others)} or {last}" if others else last
            notes.append(f"{settings_text('parallel', self, ['bucket_size_mb'])} no effect (it sizes the gradient "
                         f"buckets of parallel.strategy={users}; this run's is \"{self.strategy}\")")
        if "optimizer_state" in changed and not issubclass(cls, ShardedStateStrategy):
            notes.append(f"{settings_text('parallel', self, ['optimizer_state'])} no effect "
                         f"(parallel.strategy=\"{self.strategy}\" keeps the whole optimizer state on every rank and "
                         "saves it once)")
        return notes
