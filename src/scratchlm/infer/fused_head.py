"""The end of a fused decode step: the final RMSNorm, the LM head and the greedy pick in two kernels.

After the blocks, a module-by-module step runs the final norm, the head's matmul (cuBLAS; 32 us
for GPT-2-small's 77 MB on an H100, at 2.4 of the 3.0 TB/s a copy reaches) and the argmax over
the vocabulary (one or two more kernels): docs/benchmarks/generate.md. With the engine's fused
blocks and `DecodeEngine.fused_head` on, `fused_logits` gives the same (logits, argmax) from
`scratchlm.kernels.decode_head_triton.decode_head`: the norm inside the head's kernel, each of
its programs leaving the maximum of its outputs, and a small kernel picking the row's first
maximum from those.

It is off by default. On an H100 the two kernels first took 40.3 us at GPT-2-small's shape and
one row against 34.7 us for the compiled head and `chunked_argmax` (98.9 against 35.6 us at
four rows); only the 1B shape's one-row head was faster (176.2 against 182.2 us). With the
tiles of a later sweep they take 31.9 us at GPT-2-small's shape and one row (another call):
the engine with the fused head has not been timed since. docs/benchmarks/decode_linear.md has
the tables.

`head_spec(model, padded)` is the (weight, vocab, final norm) that reproduces the model's own
head, or None: a plain `RMSNorm` as the final norm, no logit soft-capping, and the head's
weight as the engine's padded copy (`scratchlm.infer.padded_head`, in the autocast dtype) or
the model's plain `Linear` in the dtype the matmul runs in.
"""

from __future__ import annotations

from torch import Tensor, nn

from scratchlm.infer.padded_head import PaddedHead
from scratchlm.kernels.decode_head_triton import decode_head
from scratchlm.model.functional import compute_dtype
from scratchlm.model.layers import Linear, RMSNorm, hooked

__all__ = ["fused_logits", "head_spec"]


def head_spec(model: nn.Module, padded: PaddedHead | None) -> tuple[Tensor, int, RMSNorm] | None:
    """(head weight (V_pad, d), vocab V, final norm) for `fused_logits`, or None where the fused
    head would not compute what the model does (see the module docstring)."""
    norm, head = getattr(model, "ln_final", None), getattr(model, "lm_head", None)
    if (type(norm) is not RMSNorm or hooked(norm) or head is None or getattr(model, "logit_softcap", 0)
            or not hasattr(model, "hidden_states")):
        return None
    if padded is not None and padded.weight is not None:
        return (padded.weight, padded.vocab, norm) if padded.cap is None else None
    if type(head) is not Linear or hooked(head) or head.weight.dtype != compute_dtype(head.weight):
        return None
    return head.weight, head.weight.shape[0], norm


def fused_logits(model: nn.Module, spec: tuple[Tensor, int, RMSNorm], tokens: Tensor, positions: Tensor, view,
                 pdl: bool) -> tuple[Tensor, Tensor]:
    """(logits (b, V) float32, argmax (b,)) of one decode step of `tokens` (b,) at `positions`
    (b,): the blocks as the model runs them through `view`, then the fused head."""
    weight, vocab, norm = spec
    h = model.hidden_states(tokens[:, None], positions[:, None], view, final_norm=False)[:, -1]  # (b, d)
    return decode_head(h, weight, vocab, norm.weight, norm.eps, pdl=pdl)
