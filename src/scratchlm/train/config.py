"""Trainer options and the root config of `scratchlm train`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scratchlm.data.config import DataConfig
from scratchlm.dtypes import canonical_dtype
from scratchlm.model.config import MAX_DIM, ModelConfig
from scratchlm.model.fp8 import RECIPES as FP8_RECIPES
from scratchlm.optim.config import OptimConfig
from scratchlm.parallel.config import ParallelConfig


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "cudagraphs")


@dataclass
class TrainerConfig:
    out_dir: str = "runs/default"  # run directory (config, metrics, checkpoints, plots)
    batch_size: int = 32  # sequences per optimizer step (global, across accumulation and ranks)
    grad_accum_steps: int = 1  # micro-batches per optimizer step (per rank)
    max_steps: int = 5000  # optimizer steps (with time_budget_s: the most the budget may reach)
    # Wall-clock budget in seconds; 0 = off. The run trains until its training clock reaches the
    # budget (or max_steps), then checkpoints, evaluates and finishes. The clock starts with the
    # first step and counts compilation and warm-up, not evaluations or checkpoint writes; a
    # resumed run continues it. The learning-rate decay then follows elapsed / budget instead of
    # step / max_steps (the warm-up stays optim.warmup_steps steps), so warm-up, cosine, linear
    # and WSD decays end when the time does. The schedule then depends on the machine's speed:
    # such runs are NOT bitwise reproducible, even with `deterministic`.
    time_budget_s: float = 0.0
    # Sequence-length warm-up over this many first steps (0 = off): each row of a batch is cut
    # into shorter windows, 1/8, 1/4, 1/2 of context_length for a quarter of the steps each, then
    # whole rows. The tokens of a step and their targets stay the same, only attention spans
    # less; four sizes, so compiled graphs are reused. context_length must divide by 8.
    seq_len_warmup_steps: int = 0
    eval_interval: int = 500  # steps between validation passes; 0 = only at the end
    eval_batches: int = 20  # validation windows: the first eval_batches x batch_size (global), every pass
    # The last evaluation of the run (at max_steps or at the time budget) scores the whole
    # validation file instead of the first eval_batches x batch_size windows.
    final_eval_full: bool = False
    eval_at_start: bool = True  # also evaluate before the first step (the baseline loss)
    log_interval: int = 10  # steps between console/metrics lines (train loss is averaged over them)
    checkpoint_interval: int = 1000  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2  # newest step directories kept (older ones are deleted)
    seed: int = 0  # seeds python, numpy, torch and the data sampler
    device: str = "auto"  # "auto" (cuda, else mps, else cpu), "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto" (bf16 autocast on CUDA, fp32 on CPU), "fp32", "bf16" ("float32", "bfloat16" too)
    compile: bool = False  # torch.compile the model (and the loss)
    compile_mode: str = "default"  # torch.compile mode: "default", "reduce-overhead" (CUDA graphs), "max-autotune", ...
    # torch.compile backend: "inductor" (generated, fused kernels; compile_mode applies) or "cudagraphs"
    # (the eager kernels, traced once and replayed as CUDA graphs: no code generation, so it starts in
    # seconds, at the eager kernels' speed without their launch overhead; CUDA only).
    compile_backend: str = "inductor"
    # What torch.compile takes: "model" (the whole forward: one graph, fused across blocks) or
    # "blocks" (one compiled block call that every block shares: the compilation costs about one
    # block's, not the whole depth's; scratchlm Transformers only).
    compile_scope: str = "model"
    # With compile: where torch.compile's on-disk caches live (compiled graphs, autotuning, Dynamo's
    # dynamic-shape profile), so a later run of the same model starts faster. "" = torch's default
    # (/tmp/torchinductor_<user>, lost when /tmp is cleaned); "auto" = ~/.cache/scratchlm/compile;
    # or a path. See scratchlm.train.compile_cache.
    compile_cache_dir: str = ""
    # Evaluate with the compiled model too. Off: single-process evaluation runs the model eagerly,
    # which spares a second compilation (no_grad) and, under reduce-overhead, a second set of
    # CUDA graphs; worth turning on only for long evaluations of large models.
    compile_eval: bool = False
    activation_checkpointing: bool = False  # recompute block activations in backward to save memory
    # With activation_checkpointing: checkpoint every k-th block (1: all; 2: half; ...). Fewer
    # checkpointed blocks recompute less and keep more: at 32K context on an H200, one block in 12
    # made the step 18% faster than all of them (docs/benchmarks/train_step.md).
    activation_checkpointing_every: int = 1
    # The LM head fused with the loss (scratchlm.kernels.fused_linear_cross_entropy): chunks of
    # tokens, never the full (tokens x vocab) float32 logits. Half the step's memory and ~10% faster
    # at GPT-2-small size on an H200 (docs/benchmarks/train_step.md); single-process runs only.
    fused_lm_head: bool = False
    # The Transformer blocks' matmuls in FP8 (e4m3 forward, e5m2 gradients, torch._scaled_mm;
    # scratchlm.model.fp8). CUDA needs compute capability 8.9+ (Ada, Hopper).
    fp8: bool = False
    # With fp8: "tensorwise" (one scale per tensor, all three matmuls in FP8) or "rowwise" (one
    # scale per row, forward and input gradient in FP8, the weight gradient in bf16).
    fp8_recipe: str = "tensorwise"
    deterministic: bool = False  # torch.use_deterministic_algorithms(True) (bitwise-reproducible runs)
    peak_flops: float = 0.0  # device peak FLOP/s for MFU; 0 = look it up (GPUs) or report n/a (CPU)
    progress: bool = True  # show a tqdm progress bar (log lines are printed either way)
    sample_tokens: int = 0  # tokens sampled per prompt at the end of training (0 = none)
    sample_prompts: list[str] = field(default_factory=list)  # prompts for the samples; empty = one from <|endoftext|>
    sample_temperature: float = 0.8  # sampling temperature of the end-of-training samples
    sample_top_p: float = 0.95  # nucleus threshold of the end-of-training samples
    wandb_project: str = ""  # log to Weights & Biases when set and wandb is installed
    tensorboard: bool = False  # also write TensorBoard events when tensorboard is installed

    def __post_init__(self) -> None:
        if not self.out_dir.strip():  # would be the current directory: typically an unset $VARIABLE
            raise ValueError("trainer.out_dir is empty; name the run directory (e.g. runs/exp1, or . on purpose)")
        for name in ("batch_size", "grad_accum_steps", "eval_batches", "log_interval", "activation_checkpointing_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"trainer.{name} must be positive, got {getattr(self, name)}")
        if self.batch_size > MAX_DIM:  # (a dimension of the batch tensors: numpy's ValueError past it)
            raise ValueError(f"trainer.batch_size must be at most 2**31 - 1, got {self.batch_size}")
        for name in ("max_steps", "seq_len_warmup_steps", "eval_interval", "checkpoint_interval", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.time_budget_s < math.inf:  # an infinite budget never decays the learning rate
            raise ValueError(f"trainer.time_budget_s must be a finite number >= 0 (0 = no budget), "
                             f"got {self.time_budget_s}")
        # Checked here, not when the samples are drawn after the whole run has trained.
        if not 0 <= self.sample_temperature < math.inf:  # an infinite one samples every token alike
            raise ValueError(f"trainer.sample_temperature must be a finite number >= 0 (0 = greedy), "
                             f"got {self.sample_temperature}")
        if not 0 < self.sample_top_p <= 1:
            raise ValueError(f"trainer.sample_top_p must be in (0, 1], got {self.sample_top_p}")
        if not 0 <= self.peak_flops < math.inf:  # a negative one was looked up as 0 is, an infinite one gave MFU 0
            raise ValueError(f"trainer.peak_flops must be a finite number >= 0 (0 = look it up), got {self.peak_flops}")
        if not 0 <= self.seed < 2**32:  # numpy's range; it seeds the data sampler
            raise ValueError(f"trainer.seed must be in [0, 2**32), got {self.seed}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"trainer.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(
                f"trainer.batch_size ({self.batch_size}) must be divisible by "
                f"trainer.grad_accum_steps ({self.grad_accum_steps})"
            )
        if self.compile_scope not in ("model", "blocks"):
            raise ValueError(f"trainer.compile_scope must be 'model' or 'blocks', got {self.compile_scope!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"trainer.compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"trainer.fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe!r}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"trainer.compile_backend must be one of {', '.join(COMPILE_BACKENDS)}, "
                             f"got {self.compile_backend!r}")
        if self.dtype != "auto":
            try:
                self.dtype = canonical_dtype(self.dtype, allowed=("fp32", "bf16"))
            except ValueError as exc:
                raise ValueError(f"trainer.dtype: {exc}, or auto") from None


@dataclass
class TrainConfig:
    """Everything `scratchlm train` needs; each section is one component's own config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
