"""Data-parallel / sharding strategy options (the `[parallel]` section of a training config)."""

from __future__ import annotations

from dataclasses import dataclass

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
