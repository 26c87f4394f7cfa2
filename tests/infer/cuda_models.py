"""The small CUDA model the GPU decoding tests share."""

import torch

from scratchlm.model.transformer import TransformerLM


def peaked_cuda_lm(*, num_layers: int, context_length: int, **model_kw) -> TransformerLM:
    """A random-weight TransformerLM on the GPU whose logits are sharpened (LM head x 8), so that
    greedy decoding rarely meets near-ties that kernels of different rounding would break apart.
    `model_kw`: further TransformerLM arguments (grouped-query attention, a sliding window, ...)."""
    torch.manual_seed(0)
    m = TransformerLM(vocab_size=300, context_length=context_length, d_model=128, num_layers=num_layers,
                      num_heads=4, d_ff=384, rope_theta=10_000.0, device="cuda", **model_kw)
    with torch.no_grad():
        m.lm_head.weight.mul_(8)
    return m
