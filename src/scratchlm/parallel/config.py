"""Data-parallel / sharding strategy options."""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = (
    "none", "ddp", "ddp_bucketed", "naive_ddp", "flat_ddp", "zero1", "fsdp", "torch_ddp", "torch_fsdp2",
)


@dataclass
class ParallelConfig:
    strategy: str = "none"  # one of STRATEGIES; "none" = a single process
    bucket_size_mb: float = 25.0  # gradient bucket size for "ddp_bucketed"
    backend: str = "auto"  # "auto" (nccl on CUDA, else gloo), "nccl" or "gloo"
    compute_dtype: str = "none"  # FSDP compute dtype: "none" (= master fp32), "bf16" or "fp16"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"parallel.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
