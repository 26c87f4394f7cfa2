"""Per-token log-probabilities, entropies, masked reductions and the SFT microbatch step.

Sequences are ``prompt + response`` token ids cut into ``input_ids = ids[:-1]`` and
``labels = ids[1:]`` (B, T); ``response_mask`` (B, T) is 1 where the label is a response token,
so losses and statistics count the response only, never the prompt or the padding.

>>> import torch
>>> masked_mean(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]]))
tensor(1.5000)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def tokenize_prompt_and_output(
    prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]], pad_id: int
) -> dict[str, Tensor]:
    """Right-padded ``input_ids``, ``labels`` and ``response_mask`` (B, max_len - 1) for SFT/RL.

    Row b is ``prompt_ids[b] + output_ids[b]`` (length L_b) padded with `pad_id` to the longest
    row; ``response_mask[b, t]`` is True when ``labels[b, t]`` belongs to the output.
    """
    if len(prompt_ids) != len(output_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(output_ids)} outputs")
    rows = [[*p, *o] for p, o in zip(prompt_ids, output_ids)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long).reshape(len(rows), width)
    starts = torch.tensor([len(p) for p in prompt_ids])[:, None]
    ends = torch.tensor([len(r) for r in rows])[:, None]
    t = torch.arange(width)
    mask = (t >= starts) & (t < ends)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "response_mask": mask[:, 1:]}


def compute_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution, (..., V) -> (...), computed stably in float32.

    H = logsumexp(z) - sum softmax(z) * z, which never forms log(0).
    """
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return log_z - (probs * logits).sum(dim=-1)


def response_log_probs(
    model: torch.nn.Module, input_ids: Tensor, labels: Tensor, return_token_entropy: bool = False
) -> dict[str, Tensor]:
    """log p(labels[b, t] | input_ids[b, :t+1]) for every position, (B, T) float32.

    With `return_token_entropy`, also the entropy of each next-token distribution (B, T),
    detached (it is a diagnostic, not a loss term). `model(input_ids)` returns logits (B, T, V).
    """
    logits = model(input_ids)  # (B, T, V)
    if not isinstance(logits, Tensor):  # Hugging Face models return an output object
        logits = logits.logits
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    out = {"log_probs": log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)}
    if return_token_entropy:
        with torch.no_grad():
            out["token_entropy"] = compute_entropy(logits.detach())
    return out


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is true (all of them, or along `dim`).

    A slice with no true position gives nan, as the mean of nothing is undefined.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim)


def masked_normalize(x: Tensor, mask: Tensor, normalize_constant: float, dim: int | None = None) -> Tensor:
    """Sum of `x` where `mask` is true, divided by a fixed constant (all of it, or along `dim`).

    Unlike `masked_mean`, every token weighs the same whatever the length of its response
    (Dr. GRPO's length-unbiased normalisation).
    """
    mask = mask.to(x.dtype)
    total = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    return total / normalize_constant


def sft_microbatch_train_step(
    policy_log_probs: Tensor,
    response_mask: Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Backward the SFT loss of one microbatch; returns (loss, metadata).

    The loss is the negative log-likelihood of the response tokens, averaged over the batch of
    sequences: each sequence's sum of token NLLs divided by `normalize_constant` (default: the
    number of response tokens in the microbatch, i.e. a per-token mean), then divided by
    `gradient_accumulation_steps` so accumulated microbatches add up to one batch's gradient.
    """
    mask = response_mask.to(policy_log_probs.dtype)
    if normalize_constant is None:
        # Per-token mean over the microbatch: sum over tokens / number of response tokens.
        loss = -(policy_log_probs * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        per_sequence = masked_normalize(-policy_log_probs, response_mask, normalize_constant, dim=-1)  # (B,)
        loss = per_sequence.mean()
    loss = loss / gradient_accumulation_steps
    loss.backward()
    return loss.detach(), {"response_tokens": mask.sum().detach()}
