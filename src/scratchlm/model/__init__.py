"""The Llama-style Transformer LM, built from PyTorch primitives.

Names are resolved lazily so that `import scratchlm.model.config` (read by the config loader)
does not import torch.
"""

from __future__ import annotations

from scratchlm.lazy_exports import lazy_exports

_EXPORTS: dict[str, str] = {
    "softmax": "scratchlm.model.functional",
    "silu": "scratchlm.model.functional",
    "cross_entropy": "scratchlm.model.functional",
    "scaled_dot_product_attention": "scratchlm.model.functional",
    "Linear": "scratchlm.model.layers",
    "Embedding": "scratchlm.model.layers",
    "RMSNorm": "scratchlm.model.layers",
    "SwiGLU": "scratchlm.model.layers",
    "SiLUFFN": "scratchlm.model.layers",
    "RotaryEmbedding": "scratchlm.model.rope",
    "MultiHeadSelfAttention": "scratchlm.model.attention",
    "TransformerBlock": "scratchlm.model.transformer",
    "TransformerLM": "scratchlm.model.transformer",
    "build_model": "scratchlm.model.transformer",
    "ModelConfig": "scratchlm.model.config",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
