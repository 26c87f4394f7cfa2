"""The policy's per-token log-probabilities under `torch.compile`, for the SFT and GRPO updates.

`blockwise_compiled_log_probs` runs a scratchlm policy's blocks through one compiled block call
and its head and log-softmax through another; `log_probs_fn(compile)` picks it or the eager
`response_log_probs`. The compiled functions live in one table for the process, so SFT and GRPO
on the same policy share them: a GRPO run that follows a compiled SFT in the same process
reuses the graphs the SFT compiled instead of compiling its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from scratchlm.align.logprobs import compute_entropy, response_log_probs


_compiled: dict[tuple[str, Any], Any] = {}  # (what, backend) -> its torch.compile, shared by every call


def _compiled_fn(name: str, fn, backend) -> Any:
    key = (name, backend)
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=True, backend=backend)
    return _compiled[key]


def _head_log_probs(model: torch.nn.Module, h: Tensor, labels: Tensor, return_token_entropy: bool) -> dict[str, Tensor]:
    logits = model.lm_head(h)
    out = {"log_probs": torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)}
    if return_token_entropy:
        with torch.no_grad():
            out["token_entropy"] = compute_entropy(logits.detach())
    return out


def blockwise_compiled_log_probs(backend: Any = "inductor"):
    """`response_log_probs` of a scratchlm `TransformerLM` with its blocks run by one shared
    `torch.compile` of a block call (the model's `block_runner`, for the call), its final norm
    eager, and the head and log-softmax under another compile.

    The blocks of a model share their code, so one compiled graph serves every layer: the
    compilation costs about one block's, not the whole depth's: the first forward and backward
    of the 6-layer policy of docs/benchmarks/post_training.md took 29 s against 65 s on the CPU,
    each from an empty compile cache (on an H100 the whole-policy compile took 37 s of a 110 s
    GRPO run). Other models (Hugging Face) compile whole."""
    from scratchlm.model.transformer import TransformerLM, blocks_run_by, run_block

    whole = _compiled_fn("whole", response_log_probs, backend)
    block = _compiled_fn("block", run_block, backend)
    head = _compiled_fn("head", _head_log_probs, backend)

    def log_probs(model: torch.nn.Module, input_ids: Tensor, labels: Tensor,
                  return_token_entropy: bool = False) -> dict[str, Tensor]:
        if type(model) is not TransformerLM:
            return whole(model, input_ids, labels, return_token_entropy)
        with blocks_run_by(model, block):
            h = model.hidden_states(input_ids)
        return head(model, h, labels, return_token_entropy)

    return log_probs


def log_probs_fn(compile: bool, backend: Any = "inductor"):
    """`response_log_probs`, or its compiled form (`blockwise_compiled_log_probs`)."""
    return blockwise_compiled_log_probs(backend) if compile else response_log_probs
