"""Trainer options and the root config of `scratchlm train`."""

from __future__ import annotations

from dataclasses import dataclass, field

from scratchlm.data.config import DataConfig
from scratchlm.model.config import ModelConfig
from scratchlm.optim.config import OptimConfig
from scratchlm.parallel.config import ParallelConfig


@dataclass
class TrainerConfig:
    out_dir: str = "runs/default"  # run directory (config, metrics, checkpoints, plots)
    batch_size: int = 32  # sequences per optimizer step (global, across accumulation and ranks)
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    max_steps: int = 5000  # optimizer steps
    eval_interval: int = 500  # steps between validation passes; 0 = only at the end
    eval_batches: int = 20  # batches per validation pass
    log_interval: int = 10  # steps between console/metrics lines
    checkpoint_interval: int = 1000  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2  # newest step directories kept
    seed: int = 0
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto" (bf16 autocast on CUDA, fp32 on CPU), "fp32", "bf16"
    compile: bool = False  # torch.compile the model
    deterministic: bool = False  # torch.use_deterministic_algorithms(True)
    sample_tokens: int = 0  # tokens sampled at the end of training (0 = none)
    wandb_project: str = ""  # log to Weights & Biases when set and wandb is installed
    tensorboard: bool = False  # also write TensorBoard events when tensorboard is installed


@dataclass
class TrainConfig:
    """Everything `scratchlm train` needs; each section is one component's own config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
