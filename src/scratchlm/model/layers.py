"""Parameterised building blocks: Linear, Embedding, RMSNorm, the feed-forward nets, the soft-capped head.

All weights are bias-free, as in Llama. Every module takes `device=None, dtype=None` so a
model can be built directly on its target device and in its target dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from scratchlm.model.functional import silu


class Linear(nn.Module):
    """y = x Wᵀ with `weight` of shape (out_features, in_features); x: (..., in) -> (..., out).

    Initialised from a normal with std sqrt(2 / (in + out)) truncated at ±3 std (a
    Glorot-style scale, so activations keep roughly unit variance through the stack). `init_std`
    replaces that std, for a matrix that is one block of a larger map (attention's q, k, v).
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None, *,
                 init_std: float | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.init_std if self.init_std is not None else math.sqrt(2.0 / (self.in_features + self.out_features))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.t()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def hooked(module: nn.Module) -> bool:
    """Whether `module` has forward (pre-)hooks: code that computes its math in another way (fused
    projections, the decoding engine's weight copies and kernels) would skip them."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def can_fuse(x: Tensor, *linears: nn.Module) -> bool:
    """Whether `project_together(x, linears)` may stand in for calling each of `linears` on x.

    Only in mixed-precision training: autograd records and autocast is on for x's device, so
    each weight is cast to a low-precision copy that is saved for the backward anyway (in full
    precision the concatenated weight would be an extra copy; under no_grad, decoding, each
    weight is read once per token and concatenating them costs more than it saves). Only plain
    `Linear`s without hooks qualify: a wrapped, replaced or hooked projection (FSDP's sharded
    weights, a LoRA module, profiling ranges) is still called as a module.
    """
    return (torch.is_grad_enabled() and torch.is_autocast_enabled(x.device.type) and all(
        type(m) is Linear and not hooked(m) for m in linears))


def stacked_linear(x: Tensor, stacked: tuple[Tensor, Tensor | None]) -> Tensor:
    """x through a (weight, bias or None) pair that stacks several projections' rows, with the
    math of the modules stacked (`Linear`: x Wᵀ; a biased projection: F.linear, the bias in the
    weight's dtype). The decoding engine keeps such pairs (`scratchlm.infer.stacked`)."""
    w, b = stacked
    return x @ w.t() if b is None else torch.nn.functional.linear(x, w, b)


class _ProjectTogether(torch.autograd.Function):
    """Forward: one matmul against the concatenated weights. Backward: with `split`, per
    projection, as separate Linears would (the output gradients are never concatenated);
    otherwise the output is one tensor, and so is its gradient: one matmul each way."""

    @staticmethod
    def forward(ctx, x: Tensor, dtype: torch.dtype, split: bool, *weights: Tensor) -> Tensor | tuple[Tensor, ...]:
        xc = x.to(dtype)
        wc = [w.to(dtype) for w in weights]
        wcat = torch.cat(wc)
        # as a matmul does: the weights only if x needs a gradient, x only if a weight does
        needs_x, needs_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[3:])
        saved_w = wc if split else [wcat]
        ctx.save_for_backward(xc if needs_w else None, *(saved_w if needs_x else [None] * len(saved_w)))
        ctx.split = split
        ctx.dtypes = (x.dtype, [w.dtype for w in weights])
        ctx.sizes = [w.shape[0] for w in wc]
        y = xc @ wcat.t()
        return tuple(y.split(ctx.sizes, dim=-1)) if split else y

    @staticmethod
    def backward(ctx, *grads: Tensor):
        xc, *wc = ctx.saved_tensors
        x_dtype, w_dtypes = ctx.dtypes
        needs_w = ctx.needs_input_grad[3:]
        if not ctx.split:  # one gradient (..., sum of outs) against the concatenated weight
            (g,) = grads
            grad_x = (g @ wc[0]).to(x_dtype) if ctx.needs_input_grad[0] else None
            grad_w = [None] * len(needs_w)
            if xc is not None:
                gw = g.reshape(-1, g.shape[-1]).t() @ xc.reshape(-1, xc.shape[-1])
                grad_w = [gi.to(d) if need else None for gi, d, need in zip(gw.split(ctx.sizes), w_dtypes, needs_w)]
            return grad_x, None, None, *grad_w
        grad_x = None
        if ctx.needs_input_grad[0]:
            for g, w in zip(grads, wc):
                grad_x = g @ w if grad_x is None else grad_x + g @ w
            grad_x = grad_x.to(x_dtype)
        grad_w = [None] * len(grads)
        if xc is not None:
            flat_x = xc.reshape(-1, xc.shape[-1])
            grad_w = [(g.reshape(-1, g.shape[-1]).t() @ flat_x).to(d) if need else None
                      for g, d, need in zip(grads, w_dtypes, needs_w)]
        return grad_x, None, None, *grad_w


def project_together(x: Tensor, linears: tuple[Linear, ...], *,
                     concatenated: bool = False) -> tuple[Tensor, ...] | Tensor:
    """(x W_1ᵀ, x W_2ᵀ, ...) under autocast, the forward as one matmul with the weights
    concatenated (a wider matmul runs closer to the GPU's peak): x (..., in) -> a tuple of
    (..., out_i) in the autocast dtype. Same parameters and gradients as separate calls; the
    backward runs per projection, since concatenating the output gradients for one wide matmul
    costs more than it saves (docs/benchmarks/train_step.md).

    With `concatenated`, the one (..., sum of out_i) output is returned, for a consumer whose
    backward writes its gradient as one tensor (`flash_attention_qkv`, `swiglu`): the backward is
    then one matmul each way as well."""
    dtype = torch.get_autocast_dtype(x.device.type)
    with torch.autocast(x.device.type, enabled=False):
        return _ProjectTogether.apply(x, dtype, not concatenated, *(m.weight for m in linears))


class Embedding(nn.Module):
    """Lookup table: token ids (...) -> vectors (..., embedding_dim).

    `weight` is (num_embeddings, embedding_dim), initialised N(0, 1) truncated at ±3.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: Tensor) -> Tensor:
        # The same rows as self.weight[token_ids], but a lookup whose backward sums the gradients
        # of repeated ids in a fixed order: indexing's backward (index_put with accumulate) adds
        # them in parallel on CPU, so two runs of the same seed would drift apart.
        return torch.nn.functional.embedding(token_ids, self.weight)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension: x / sqrt(mean(x²) + eps) · weight.

    x: (..., d_model) -> same shape and dtype. The statistics are computed in float32 even for
    bf16/fp16 inputs (squares of bf16 values lose too many bits); `weight` starts at ones.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * inv_rms * self.weight.float()).to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class SwiGLU(nn.Module):
    """Gated feed-forward net `w2(silu(w1 x) * w3 x)`; x: (..., d_model) -> (..., d_model).

    w1, w3: d_model -> d_ff; w2: d_ff -> d_model. With `fused` (default), w1 x and w3 x are one
    matmul in mixed-precision training (`can_fuse`, `project_together`); the parameters stay separate.
    On CUDA their backward is one matmul each way too: the gate runs as
    `scratchlm.kernels.swiglu_triton.swiglu`, whose backward writes both gradients as one tensor.
    """

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None, *, fused: bool = True) -> None:
        super().__init__()
        self.fused = fused
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor, stacked: tuple[Tensor, Tensor | None] | None = None) -> Tensor:
        """`stacked`: w1 and w3 as one (2·d_ff, d_model) matrix (`stacked_linear`), which the
        decoding engine passes to make the two projections one matmul."""
        if stacked is not None:
            gate, up = stacked_linear(x, stacked).chunk(2, dim=-1)
            return self.w2(silu(gate) * up)
        fuse = self.fused and can_fuse(x, self.w1, self.w3)
        if fuse and x.is_cuda:
            # w1 x | w3 x as one tensor; the gate's backward kernel writes its gradient as one
            # tensor too, so the projections' backward is one matmul each way
            from scratchlm.kernels.swiglu_triton import swiglu

            return self.w2(swiglu(project_together(x, (self.w1, self.w3), concatenated=True)))
        if fuse:
            gate, up = project_together(x, (self.w1, self.w3))
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(silu(gate) * up)


class SiLUFFN(nn.Module):
    """Ungated feed-forward net `w2(silu(w1 x))` (the SwiGLU ablation); x: (..., d_model).

    w1: d_model -> d_ff; w2: d_ff -> d_model. For a parameter-matched comparison with SwiGLU,
    give it d_ff = 3/2 of SwiGLU's d_ff (two matrices instead of three).
    """

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(silu(self.w1(x)))


class ReLU2FFN(nn.Module):
    """Ungated feed-forward net `w2(relu(w1 x)²)` (So et al., 2021, "Primer"; the modded-nanogpt
    speedrun's FFN); x: (..., d_model) -> (..., d_model).

    w1: d_model -> d_ff; w2: d_ff -> d_model; no w3. Two matrices instead of SwiGLU's three: at
    d_ff = 3/2 of SwiGLU's width it has the same parameters and FLOPs, and its element-wise work
    is one max and one square.
    """

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(torch.relu(self.w1(x)).square())


def softcap(logits: Tensor, cap: float) -> Tensor:
    """cap · tanh(logits / cap): close to the identity for |logits| << cap, bounded by ±cap.

    Computed in float32 and returned in the input's dtype (tanh of bf16 loses the small
    differences between large logits). Example: softcap(torch.tensor([0.0, 30.0]), 15.0) ≈ [0, 14.46].
    """
    return (cap * torch.tanh(logits.float() / cap)).to(logits.dtype)


class SoftcappedLinear(Linear):
    """A `Linear` whose outputs are soft-capped: `softcap(x Wᵀ, cap)` (the LM head with
    `logit_softcap`). Same parameter and state_dict key as the plain head, so every caller of
    `lm_head` (decoding included) sees capped logits."""

    def __init__(self, in_features: int, out_features: int, cap: float, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, device=device, dtype=dtype)
        self.cap = cap

    def forward(self, x: Tensor) -> Tensor:
        return softcap(super().forward(x), self.cap)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, cap={self.cap}"
