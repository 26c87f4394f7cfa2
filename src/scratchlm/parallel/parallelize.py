"""Apply activation checkpointing, torch.compile and a parallel strategy to a plain model, in one place.

As in torchtitan's parallelize step, the model is built plain and everything that changes how
it runs is applied here from outside, always in this order:

1. activation checkpointing of every `trainer.activation_checkpointing_every`-th block
   (in place: the blocks' forwards recompute in backward);
2. `torch.compile(model, mode=trainer.compile_mode)` under `trainer.compile` (with
   `trainer.compile_backend="cudagraphs"`: torch's "cudagraphs" backend instead of Inductor), or with
   `trainer.compile_scope="blocks"` one compiled block call shared by every block (the model's
   `block_runner`), the embedding, final norm and head left eager;
3. the strategy's wrapper (`strategy.wrap_model`: DDP hooks, FSDP sharding, ...) around the
   compiled module, so gradient hooks and collectives stay outside the compiled graph.

The loss is compiled with the same mode (Inductor fuses the float32 upcast, log-sum-exp and
target gather over the (tokens x vocab) logits into one pass each way; "reduce-overhead"
replays it as CUDA graphs), and so is the trunk of the fused LM head (`trainer.fused_lm_head`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from scratchlm.errors import UserError
from scratchlm.model.functional import cross_entropy
from scratchlm.model.transformer import run_block

if TYPE_CHECKING:
    from scratchlm.parallel.strategy import Strategy
    from scratchlm.train.config import TrainerConfig


@dataclass
class Parallelized:
    """What training runs: the wrapped model, the loss and (with the fused head) the head's inputs."""

    model: nn.Module  # plain model -> checkpointed blocks -> compiled -> strategy wrapper
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> mean loss
    head_inputs: Callable[[torch.Tensor], torch.Tensor] | None  # trunk of the fused LM head, else None
    cudagraphs: bool  # compiled with "reduce-overhead" on CUDA: mark each step's start


def compiled(fn, cfg: TrainerConfig, device: torch.device):
    """``torch.compile`` of `fn` as `cfg` asks: Inductor with ``compile_mode``, or the
    "cudagraphs" backend (no code generation: the eager kernels replayed as CUDA graphs), which
    needs a CUDA device: elsewhere `fn` itself, run eagerly."""
    if cfg.compile_backend == "cudagraphs":
        return torch.compile(fn, backend="cudagraphs") if device.type == "cuda" else fn
    return torch.compile(fn, mode=cfg.compile_mode)


def parallelize(model: nn.Module, cfg: TrainerConfig, strategy: Strategy) -> Parallelized:
    """Wrap the plain `model` (already on `strategy.device`) for training under `cfg` and `strategy`."""
    if cfg.fused_lm_head and not strategy.supports_fused_lm_head:
        raise UserError("trainer.fused_lm_head runs single-process only: the data-parallel wrappers "
                        "synchronise gradients through the model's forward, which the fused head bypasses")
    plain = model
    if cfg.activation_checkpointing:
        from scratchlm.train.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model, every=cfg.activation_checkpointing_every)
    blockwise = cfg.compile and cfg.compile_scope == "blocks"
    if blockwise:
        if not hasattr(plain, "block_runner"):
            raise UserError(f"trainer.compile_scope='blocks' needs a scratchlm Transformer, not {type(plain).__name__}")
        plain.block_runner = compiled(run_block, cfg, strategy.device)
    elif cfg.compile:
        model = compiled(model, cfg, strategy.device)
    model = strategy.wrap_model(model)
    loss_fn = compiled(cross_entropy, cfg, strategy.device) if cfg.compile else cross_entropy
    head_inputs = None
    if cfg.fused_lm_head:
        trunk = plain.head_inputs
        head_inputs = compiled(trunk, cfg, strategy.device) if cfg.compile and not blockwise else trunk
    graphed = cfg.compile_backend == "cudagraphs" or cfg.compile_mode == "reduce-overhead"
    cudagraphs = cfg.compile and graphed and strategy.device.type == "cuda"
    return Parallelized(model=model, loss_fn=loss_fn, head_inputs=head_inputs, cudagraphs=cudagraphs)
