"""scratchlm: language modelling from scratch, from PyTorch primitives.

The public API is re-exported here lazily: ``import scratchlm`` is instant and imports
neither torch nor numpy; ``scratchlm.Tokenizer`` imports only the tokenizer.
"""

from __future__ import annotations

from scratchlm.lazy_exports import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # tokenizer
    "train_bpe": "scratchlm.tokenizer.train",
    "Tokenizer": "scratchlm.tokenizer.tokenizer",
    # model
    "Linear": "scratchlm.model.layers",
    "Embedding": "scratchlm.model.layers",
    "RMSNorm": "scratchlm.model.layers",
    "SwiGLU": "scratchlm.model.layers",
    "RotaryEmbedding": "scratchlm.model.rope",
    "softmax": "scratchlm.model.functional",
    "silu": "scratchlm.model.functional",
    "cross_entropy": "scratchlm.model.functional",
    "scaled_dot_product_attention": "scratchlm.model.functional",
    "MultiHeadSelfAttention": "scratchlm.model.attention",
    "TransformerBlock": "scratchlm.model.transformer",
    "TransformerLM": "scratchlm.model.transformer",
    "ModelConfig": "scratchlm.model.config",
    # training
    "AdamW": "scratchlm.optim.adamw",
    "cosine_lr": "scratchlm.optim.schedule",
    "clip_grad_norm": "scratchlm.optim.clip",
    "get_batch": "scratchlm.data.batch",
    "save_checkpoint": "scratchlm.train.checkpoint",
    "load_checkpoint": "scratchlm.train.checkpoint",
    "TrainConfig": "scratchlm.train.config",
    # kernels and parallelism
    "FlashAttentionTorch": "scratchlm.kernels.flash_attention_torch",
    "FlashAttentionTriton": "scratchlm.kernels.flash_attention_triton",
    "DDP": "scratchlm.parallel.ddp",
    "ShardedOptimizer": "scratchlm.parallel.sharded_optimizer",
    "FSDP": "scratchlm.parallel.fsdp",
    # errors and configs
    "UserError": "scratchlm.errors",
    "load_config": "scratchlm.config",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
