"""LM head fused with cross-entropy, without materialising the (N x V) logits.

For a 151,936-token vocabulary and 32K tokens the logits alone are 20 GB in float32 (twice
that with their gradient). Here the tokens are processed in chunks: for each chunk the
forward computes the chunk's logits, its log-sum-exp and loss, and immediately the gradient
of the loss with respect to the chunk's logits, ``(softmax - onehot) / n_valid``, from which it
accumulates ``d hidden`` (chunk x d) and ``d weight`` (V x d, float32). Those gradients are
stashed; the backward only scales them by the incoming scalar gradient. Peak extra memory is
one chunk of logits plus the gradients that a plain path would hold anyway.

Computing the gradient in the forward costs nothing extra when the loss is backpropagated
(which is the only use in training); a forward-only call (evaluation) should pass
``compute_grad=False`` or run under ``torch.no_grad()``, which skips the gradient work.

Under autocast the matmuls run in the autocast dtype (as ``F.linear`` would), while the
log-sum-exp, the loss and the weight-gradient accumulation stay in float32.
"""

from __future__ import annotations

import torch

from scratchlm.model.functional import compute_dtype

__all__ = ["fused_linear_cross_entropy", "linear_cross_entropy_reference", "FusedLinearCrossEntropy"]

# Elements of one chunk of logits. The eager chunk math holds float32 copies of a chunk, so it
# takes 64M elements (256 MB each); on CUDA the chunk math (the Triton kernel of
# `cross_entropy_triton`, or the compiled math) reads the matmul's bf16/fp16 logits and writes
# their gradient in place, so chunks there are 4x larger (512 MB each in bf16): fewer chunks
# means fewer passes over the float32 (V x d) weight-gradient accumulator.
_CHUNK_ELEMENTS = 1 << 26
_CHUNK_ELEMENTS_SINGLE_PASS = 1 << 28


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """Plain path: F.cross_entropy(hidden @ weightᵀ, targets) with the full logits."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    return torch.nn.functional.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=ignore_index)


def _default_chunk_size(n: int, vocab: int, single_pass: bool = False) -> int:
    elements = _CHUNK_ELEMENTS_SINGLE_PASS if single_pass else _CHUNK_ELEMENTS
    return max(1, min(n, elements // max(vocab, 1)))


def _accumulate_weight_grad(grad_weight: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight += gᵀ h, with the float32 accumulation inside the matmul where torch can.

    On CUDA, ``addmm`` with ``out_dtype`` (torch >= 2.8) multiplies bf16/fp16 chunks into the
    float32 accumulator in the GEMM epilogue; otherwise the product is formed in the chunk's dtype
    and added (one extra (V x d) temporary and pass per chunk).
    """
    global _addmm_out_dtype
    if (_addmm_out_dtype and g.is_cuda and g.dtype in (torch.bfloat16, torch.float16)
            and grad_weight.dtype == torch.float32):
        try:
            torch.addmm(grad_weight, g.t(), h, out_dtype=torch.float32, out=grad_weight)
            return
        except (TypeError, RuntimeError, NotImplementedError):  # older torch: no out_dtype
            _addmm_out_dtype = False
    grad_weight += g.t() @ h


_addmm_out_dtype = True


# The chunk functions take targets in [0, V) on every row (an ignored row's target replaced by
# 0, once for all chunks, in the forward) and zero what the ignored rows contribute.

def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                acc: torch.dtype) -> torch.Tensor:
    """Summed cross-entropy of one chunk of logits (c, V) over its valid rows."""
    x = logits.to(acc)
    picked = x.gather(1, targets[:, None]).squeeze(1)
    return torch.where(valid, torch.logsumexp(x, dim=-1) - picked, 0.0).sum()


def _chunk_loss_and_grad_eager(logits, targets, valid, n_valid, acc, grad_dtype):
    """(summed loss, d mean-loss / d logits in grad_dtype) of one chunk; overwrites ``logits``."""
    x = logits.to(acc)
    lse = torch.logsumexp(x, dim=-1)
    loss = torch.where(valid, lse - x.gather(1, targets[:, None]).squeeze(1), 0.0).sum()
    # (softmax - onehot) / n_valid, zero on ignored rows, reusing one (c, V) buffer
    grad = x.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, targets[:, None], torch.full_like(lse[:, None], -1.0))
    grad.mul_((valid.to(acc) / n_valid)[:, None])
    return loss, grad.to(grad_dtype)


def _chunk_loss_and_grad_fusable(logits, targets, valid, n_valid, acc, grad_dtype):
    # The same math written as one elementwise expression so that torch.compile emits a
    # reduction plus a single read-logits/write-gradient pass instead of ~6 passes.
    x = logits.to(acc)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == targets[:, None]
    picked = torch.where(onehot, x, 0.0).sum(dim=1, keepdim=True)
    loss = torch.where(valid[:, None], lse - picked, 0.0).sum()
    scale = valid[:, None].to(acc) / n_valid
    grad = (torch.exp(x - lse) - onehot.to(acc)) * scale
    return loss, grad.to(grad_dtype)


_compiled_chunk = None
_compile_failed = False
_use_triton_rows = True  # False: the compiled chunk math instead of the Triton kernel (benchmarks, tests)


def _compiles_chunks(t: torch.Tensor) -> bool:
    return t.is_cuda and not _compile_failed and not torch.compiler.is_compiling()


def _single_pass_chunks(t: torch.Tensor) -> bool:
    """Whether the chunk math on `t`'s device reads the logits once and writes their gradient in
    place (the Triton kernel, or the compiled math), so that chunks may be larger."""
    from scratchlm.kernels.triton_support import triton_available

    return (t.is_cuda and not torch.compiler.is_compiling()
            and ((_use_triton_rows and triton_available()) or not _compile_failed))


def _chunk_loss_and_grad(logits, targets, valid, n_valid, acc, grad_dtype):
    """On CUDA the Triton kernel of `cross_entropy_rows` (in place), else compiled (once per
    chunk shape); eager elsewhere or if compilation fails."""
    global _compiled_chunk, _compile_failed
    if logits.is_cuda and acc == torch.float32 and logits.dtype == grad_dtype and _use_triton_rows:
        from scratchlm.kernels.cross_entropy_triton import cross_entropy_rows, cross_entropy_rows_supported

        if cross_entropy_rows_supported(logits):
            return cross_entropy_rows(logits, targets, valid.to(acc) / n_valid)
    if _compiles_chunks(logits):
        try:
            if _compiled_chunk is None:
                _compiled_chunk = torch.compile(_chunk_loss_and_grad_fusable, dynamic=False)
            return _compiled_chunk(logits, targets, valid, n_valid, acc, grad_dtype)
        except Exception:  # no compiler toolchain, unsupported build: stay correct, just slower
            _compile_failed = True
    return _chunk_loss_and_grad_eager(logits, targets, valid, n_valid, acc, grad_dtype)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weightᵀ`` against ``targets``, chunked over tokens."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                ignore_index: int = -100, chunk_size: int | None = None,
                compute_grad: bool = True) -> torch.Tensor:
        # hidden: (N, d), weight: (V, d), targets: (N,) int64
        n, d = hidden.shape
        vocab = weight.shape[0]
        dtype = compute_dtype(hidden)
        need_grad = compute_grad and (hidden.requires_grad or weight.requires_grad)
        chunk = chunk_size or _default_chunk_size(n, vocab, single_pass=need_grad and _single_pass_chunks(hidden))
        valid = targets != ignore_index
        targets = targets.masked_fill(~valid, 0)  # any index in [0, V): the chunks zero these rows
        acc = torch.promote_types(dtype, torch.float32)  # float64 stays float64 (exact tests)
        n_valid = valid.sum().clamp(min=1).to(acc)

        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            loss_sum = torch.zeros((), dtype=acc, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if need_grad and hidden.requires_grad else None
            grad_weight = (torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, acc), device=weight.device)
                           if need_grad and weight.requires_grad else None)
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                h = hidden[start:end].to(dtype)
                t = targets[start:end]
                ok = valid[start:end]
                logits = h @ w.t()  # (c, V) in the matmul dtype
                if need_grad:
                    chunk_loss, g = _chunk_loss_and_grad(logits, t, ok, n_valid, acc, dtype)
                    loss_sum += chunk_loss
                else:
                    loss_sum += _chunk_loss(logits, t, ok, acc)
                    continue
                if grad_hidden is not None:
                    grad_hidden[start:end] = (g @ w).to(hidden.dtype)
                if grad_weight is not None:
                    _accumulate_weight_grad(grad_weight, g, h)
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight) if t is not None))
        ctx.has = (grad_hidden is not None, grad_weight is not None)
        ctx.weight_dtype = weight.dtype
        ctx.compute_grad = need_grad
        return loss_sum / n_valid

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if not ctx.compute_grad:
            raise RuntimeError("fused_linear_cross_entropy was called with compute_grad=False; "
                               "it cannot be backpropagated")
        saved = list(ctx.saved_tensors)
        # grad_loss is a 0-dim float32 tensor: multiplying keeps the stashed dtypes.
        grad_hidden = saved.pop(0) * grad_loss if ctx.has[0] else None
        grad_weight = (saved.pop(0) * grad_loss).to(ctx.weight_dtype) if ctx.has[1] else None
        return grad_hidden, grad_weight, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               ignore_index: int = -100, chunk_size: int | None = None,
                               compute_grad: bool = True) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` vs ``targets`` without the full logits.

    hidden: (N, d) or (..., d); weight: (V, d) (the LM head's ``weight``); targets: (N,) or
    (...,) integer ids, ``ignore_index`` entries excluded from the mean. Equals
    ``F.cross_entropy(hidden @ weight.T, targets)`` in value and gradients.
    """
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden dim {hidden.shape[-1]} does not match weight {tuple(weight.shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if flat_targets.shape[0] != flat.shape[0]:
        raise ValueError(f"{flat.shape[0]} hidden rows but {flat_targets.shape[0]} targets")
    if not torch.is_grad_enabled():
        compute_grad = False
    return FusedLinearCrossEntropy.apply(flat, weight, flat_targets.long(), ignore_index, chunk_size,
                                         compute_grad)
