"""A padded copy of the LM head's weight for decoding, where the vocabulary size is odd.

The head's matmul writes logits (b, V). With V not a multiple of 8 (GPT-2's 50257), the rows of
a bf16 output are not 16-byte aligned, and at batch > 1 cuBLAS falls back to an unaligned
kernel: for GPT-2-small at batch 64 the head took 149 us of a 0.85 ms decode step on an H100
(an sm75 `..._align1` GEMM at ~17 TFLOP/s), where reading its 77 MB of weights takes ~25-30 us
(docs/benchmarks/generate.md, the profile). Multiplying by a (V_pad, d) copy whose rows beyond
V are zeros, V_pad the next multiple of `HEAD_ROW_MULTIPLE`, gives an aligned (b, V_pad) output;
the logits are its first V columns, a strided view (b, V) that argmax, sampling and the copy to
float32 read as they would a contiguous one.

As with the stacked projections (`scratchlm.infer.stacked`), the model keeps its own parameter:
the engine refreshes the copy in place at the start of every run (a policy trained between
rollouts; a tied head, which is the embedding table), in the autocast dtype under autocast, so
captured CUDA graphs keep reading the same buffer. Only a head whose math the copy reproduces
gets one: the model's plain `Linear`, or its `SoftcappedLinear` (the cap is applied to the
sliced logits, as the module applies it to its output), without hooks. A LoRA wrapper, a bias,
hooks (profiling, FSDP) or a cap the model applies elsewhere leave the head to the module.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from scratchlm.infer.stacked import fits_free_memory
from scratchlm.model.layers import Linear, SoftcappedLinear, hooked, softcap

# The padded copy has a multiple of this many rows: bf16 output rows 128 bytes apart, a whole
# number of the GEMM's tiles in V.
HEAD_ROW_MULTIPLE = 64


def _padded_rows(vocab: int) -> int:
    """`vocab` rounded up to a multiple of HEAD_ROW_MULTIPLE: the rows of the padded copy."""
    return -(-vocab // HEAD_ROW_MULTIPLE) * HEAD_ROW_MULTIPLE


def _head_spec(model: nn.Module) -> tuple[Tensor, float | None] | None:
    """(weight, cap or None) of a head the padded copy reproduces, or None.

    None also where the vocabulary is already a multiple of HEAD_ROW_MULTIPLE (no copy needed)."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(model, "hidden_states"):
        return None
    if type(head) not in (Linear, SoftcappedLinear) or hooked(head):
        return None
    weight = head.weight
    if type(weight) not in (Tensor, nn.Parameter) or weight.dim() != 2 or weight.shape[0] % HEAD_ROW_MULTIPLE == 0:
        return None
    if type(head) is SoftcappedLinear:
        return weight, head.cap
    if getattr(model, "logit_softcap", 0):  # a cap the model applies outside lm_head: not ours to copy
        return None
    return weight, None


class PaddedHead:
    """The LM head as one (V_pad, d) matrix, rows V .. V_pad - 1 zero: `head(h)` -> logits (..., V).

    `weight` is None until the first `refresh` (and after one that finds the head no longer
    plain); `head(h)` then calls the model's `lm_head`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.weight: Tensor | None = None
        self.vocab = 0
        self.cap: float | None = None

    @classmethod
    def for_model(cls, model: nn.Module) -> PaddedHead | None:
        """A padded head for `model`, or None where it needs none or the copy would not reproduce it."""
        return cls(model) if _head_spec(model) is not None else None

    def nbytes(self) -> int:
        """Bytes of the copy in the weight's own dtype (under autocast, to bf16, half that for a float32 model)."""
        spec = _head_spec(self.model)
        if spec is None:
            return 0
        weight = spec[0]
        return _padded_rows(weight.shape[0]) * weight.shape[1] * weight.element_size()

    def fits(self, device: torch.device, share: float = 0.25, reserved: int = 0) -> bool:
        """Whether the copy, with `reserved` bytes of other copies, takes at most `share` of the
        device memory free now (always on the CPU)."""
        return fits_free_memory(self.nbytes() + reserved, device, share)

    @torch.no_grad()
    def refresh(self, dtype: torch.dtype | None = None) -> bool:
        """Copy the head's current weight in (cast to `dtype` if given). Returns True when the
        buffer was (re)allocated or dropped (the head became one the copy does not reproduce),
        which makes steps captured over the old one invalid."""
        spec = _head_spec(self.model)
        if spec is None:
            dropped, self.weight = self.weight is not None, None
            return dropped
        weight, self.cap = spec
        V, d = weight.shape
        rows = _padded_rows(V)
        dt = dtype if dtype is not None else weight.dtype
        w, new = self.weight, False
        if w is None or w.dtype != dt or w.shape != (rows, d) or w.device != weight.device:
            with torch.inference_mode(False):  # a normal tensor, refreshable in or out of inference mode
                w = self.weight = torch.zeros(rows, d, dtype=dt, device=weight.device)  # padding rows stay 0
            new = True
        w[:V].copy_(weight)
        self.vocab = V
        return new

    def __call__(self, h: Tensor) -> Tensor:
        """Logits (..., V) of hidden states h (..., d), as `model.lm_head(h)` computes them."""
        if self.weight is None:
            return self.model.lm_head(h)
        logits = (h @ self.weight.t())[..., :self.vocab]  # Linear's math: x Wᵀ
        return logits if self.cap is None else softcap(logits, self.cap)
