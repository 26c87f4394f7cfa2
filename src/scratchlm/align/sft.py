"""Supervised fine-tuning on prompt/response pairs, the loss on response tokens only.

Each pair becomes ``prompt ids + response ids + end-of-text``: the end-of-text token is part
of the target so the tuned model stops by itself after ``</answer>``. An optimizer step
accumulates `grad_accum_steps` microbatches of `micro_batch_size` sequences (each loss scaled
by 1/grad_accum_steps, see `sft_microbatch_train_step`), clips the global gradient norm, and
follows a cosine learning-rate schedule with linear warm-up.

With ``sft.packed`` the pairs are instead packed end to end, ``prompt response EOS`` after
one another, into windows of ``sft.pack_length`` tokens (`scratchlm.align.packed`; 0, the
default, fits the window to the longest pair, see `default_pack_length`): no padding is
computed, a microbatch is ``micro_batch_size`` windows, and an epoch is one pass over the
windows. The last partial window is padded (its padding carries no loss), so no pair is lost.
``sft.mask_prompt = false`` puts the loss on every token, as in pretraining.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch

from scratchlm.align.compiled_logprobs import log_probs_fn
from scratchlm.align.config import OptimConfig, SFTConfig
from scratchlm.align.interrupt import stop_requested
from scratchlm.align.logprobs import (
    masked_mean,
    sft_microbatch_train_step,
    tokenize_prompt_and_output,
)
from scratchlm.align.policy import autocast_context
from scratchlm.errors import UserError
from scratchlm.train.checkpoint import rng_state, set_rng_state
from scratchlm.train.interrupt import StopSignals

LogFn = Callable[[dict[str, Any]], None]
StateFn = Callable[[dict[str, Any]], None]  # a loop's on_stop: takes its training state (scratchlm.align.resume)
ReportFn = Callable[[str], None]
EvaluateFn = Callable[[int], dict[str, Any]]
PACK_MULTIPLE = 64  # default packed windows (sft.pack_length = 0) are a whole number of 64-token blocks


def recorder(history: list[dict[str, Any]], log: LogFn | None) -> LogFn:
    """A function that appends a metrics row to `history` and also passes it to `log`, if given."""

    def record(row: dict[str, Any]) -> None:
        history.append(row)
        if log is not None:
            log(row)

    return record


def eval_metrics(evaluate: EvaluateFn, step: int) -> dict[str, Any]:
    """The results of ``evaluate(step)`` under ``eval_*`` keys, as the loops' metrics rows hold them."""
    return {f"eval_{k}": v for k, v in evaluate(step).items()}


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """scratchlm's AdamW over the trainable parameters."""
    from scratchlm.optim.adamw import AdamW

    params = [p for p in model.parameters() if p.requires_grad]
    return AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


def learning_rate(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """The rate of update `step` (0-based) of `total_steps`: a linear warm-up over
    cfg.warmup_steps updates, then a cosine from cfg.lr down to cfg.lr * cfg.min_lr_ratio at the
    last update.

    The warm-up counts the update being taken, so its first update already moves the weights
    (the k-th of them at cfg.lr * k / warmup_steps; `cosine_lr` alone would give the first 0,
    all of a 1-step run). Example with lr 1, warmup 2 over 5 updates, min_lr_ratio 0:
    [0.5, 1.0, 1.0, 0.5, 0.0].
    """
    from scratchlm.optim.schedule import cosine_lr

    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cosine_lr(step, cfg.lr, cfg.lr * cfg.min_lr_ratio, cfg.warmup_steps, max(total_steps - 1, cfg.warmup_steps))


def schedule_length(max_steps: int, num_epochs: float, items: int, per_step: int,
                    *, section: str, what: str = "pairs") -> tuple[int, str]:
    """Optimizer updates of an SFT or DPO run, and where that number comes from (`fit_warmup`'s
    `source`): `max_steps` when set, else `num_epochs` passes over `items` at `per_step` a step
    (at least 1).

    >>> schedule_length(0, 1.0, 10, 4, section="sft")
    (3, 'of this run (1 epoch(s) of 10 pairs, 4 a step)')
    """
    if max_steps:
        return max_steps, f"of this run ({section}.max_steps={max_steps})"
    return (max(1, math.ceil(num_epochs * items / per_step)),
            f"of this run ({num_epochs:g} epoch(s) of {items} {what}, {per_step} a step)")


LongWarmup = Literal["refuse", "shorten", "keep"]


def fit_warmup(optim: OptimConfig, total_steps: int, source: str, *, long_warmup: LongWarmup = "refuse") -> OptimConfig:
    """`optim` for a run of `total_steps` optimizer updates, its warm-up checked to end before the run does.

    A warm-up of `total_steps` updates or more makes the whole run a warm-up, at a fraction of
    optim.lr (a 1-step run with a 5-step warm-up updates at lr / 5, and learnt nothing when the
    warm-up started from 0). By `long_warmup`, such a warm-up is: ``"refuse"``d, a UserError
    naming both numbers and optim.warmup_steps (for a warm-up the user chose); ``"shorten"``ed to
    a tenth of the run, with a logged warning (for a preset's, which the user did not choose); or
    kept as it is (``"keep"``: the run's length was not known in advance). `source` says where
    `total_steps` comes from, after the number, such as ``"of this run (sft.max_steps=1)"``.
    """
    warmup = optim.warmup_steps
    if long_warmup == "keep" or warmup == 0 or warmup < total_steps or total_steps == 0:
        return optim
    updates = f"the {total_steps} optimizer update{'s' if total_steps != 1 else ''} {source}"
    if long_warmup == "refuse":
        raise UserError(f"optim.warmup_steps={warmup} is not shorter than {updates}: the whole run would be "
                        f"warm-up, at a fraction of optim.lr; set optim.warmup_steps below {total_steps} (0 for none)")
    shortened = total_steps // 10
    logging.getLogger("scratchlm.align").warning(
        "warning: the default optim.warmup_steps=%d (the preset's) is not shorter than %s; warming up over %d instead "
        "(set --optim.warmup_steps to choose)", warmup, updates, shortened)
    return dataclasses.replace(optim, warmup_steps=shortened)


def checkpoint_due(step: int, last: int, every: int) -> bool:
    """Whether a loop saves its resume state after `step` (1-based) of `last`: every `every` steps
    (0 = never) but the last, which the run's end saves.

    >>> [s for s in range(1, 8) if checkpoint_due(s, 7, 3)]
    [3, 6]
    """
    return every > 0 and step % every == 0 and step < last


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float, max_grad_norm: float) -> float:
    """Clip (when max_grad_norm > 0), set the learning rate, step, zero the gradients; returns the norm."""
    from scratchlm.optim.clip import clip_grad_norm

    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm > 0:
        norm = float(clip_grad_norm(params, max_grad_norm))
    else:
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params]))) if params else 0.0
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


class ContextFit(NamedTuple):
    """How `total` pairs fit a context of `context_length` tokens: `left_out` were dropped (the
    prompt alone fills the context), `cut` kept with a response cut short (its end-of-text too)."""

    total: int
    left_out: int = 0
    cut: int = 0
    context_length: int = 0

    def metrics(self, prefix: str = "") -> dict[str, int]:
        """The counts as metrics-row keys: ``pairs``, ``pairs_left_out``, ``pairs_cut`` after `prefix`."""
        return {f"{prefix}pairs": self.total, f"{prefix}pairs_left_out": self.left_out, f"{prefix}pairs_cut": self.cut}

    def describe(self, what: str = "pairs") -> str:
        """A clause on the pairs that do not fit whole, "" when all do.

        >>> ContextFit(7473, 0, 12, 1024).describe()
        "12 of 7,473 pairs are longer than the model's context of 1,024 tokens: 12 with the response cut short"
        """
        if not self.left_out and not self.cut:
            return ""
        parts = ([f"{self.left_out:,} left out (the prompt fills it)"] if self.left_out else []) + (
            [f"{self.cut:,} with the response cut short"] if self.cut else [])
        return (f"{self.left_out + self.cut:,} of {self.total:,} {what} are longer than the model's context of "
                f"{self.context_length:,} tokens: " + ", ".join(parts))


def fit_pairs(policy: Any, pairs: Sequence[tuple[str, str]], *,
              add_eos: bool = True) -> tuple[list[tuple[list[int], list[int]]], ContextFit]:
    """`encode_pairs`, and how many pairs it left out or cut to fit the context."""
    limit = policy.context_length + 1  # input_ids and labels are each one shorter
    out, cut = [], 0
    for prompt, response in pairs:
        p, r = policy.encode(prompt), policy.encode(response)
        if add_eos and policy.eos_id is not None:
            r = r + [policy.eos_id]
        if len(p) >= limit:
            continue  # a prompt that fills the context leaves nothing to learn from
        cut += len(p) + len(r) > limit
        out.append((p, r[: limit - len(p)]))
    return out, ContextFit(len(pairs), len(pairs) - len(out), cut, policy.context_length)


def encode_pairs(policy: Any, pairs: Sequence[tuple[str, str]], *, add_eos: bool = True) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids [+ eos]) per pair, cut to fit the policy's context length
    (a pair whose prompt fills the context is left out)."""
    return fit_pairs(policy, pairs, add_eos=add_eos)[0]


def default_pack_length(context_length: int, documents: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
    """The window of ``sft.pack_length = 0``: the longest ``prompt response EOS`` of `documents`
    rounded up to a multiple of `PACK_MULTIPLE`, or `context_length` when that is smaller.

    The context length alone is no measure of the data: a Hugging Face policy reports
    ``max_position_embeddings`` (4096 to 32768 for Qwen2 models), and windows that long for
    pairs of a few hundred tokens only multiply the activation memory of a microbatch. A window
    fitted to the longest pair holds any pair whole when it starts one, and a packed microbatch
    needs about the memory of a padded one holding that pair. Whole 64-token blocks keep the
    shapes friendly to the matmul kernels.

    >>> default_pack_length(32768, [([1] * 10, [2] * 60), ([1], [2])])
    128
    >>> default_pack_length(100, [([1] * 10, [2] * 200)])
    100
    """
    longest = max((len(prompt) + len(response) + 1 for prompt, response in documents), default=1)
    return min(context_length, -(-longest // PACK_MULTIPLE) * PACK_MULTIPLE)


def packed_sft_dataset(policy: Any, pairs: Sequence[tuple[str, str]], *, sft: SFTConfig, seed: int = 0):
    """The pairs as a `PackedDataset` of windows of ``sft.pack_length`` tokens (the last one padded);
    ``sft.pack_length = 0`` fits the window to the pairs (`default_pack_length`)."""
    from scratchlm.align.packed import PackedDataset

    if policy.eos_id is None:
        raise UserError("sft.packed needs a tokenizer with an end-of-text token to put between the pairs")
    if sft.pack_length > policy.context_length:
        raise UserError(f"sft.pack_length={sft.pack_length} exceeds the model's context length "
                        f"{policy.context_length}")
    documents = [(policy.encode(prompt), policy.encode(response)) for prompt, response in pairs]
    length = sft.pack_length or default_pack_length(policy.context_length, documents)
    return PackedDataset(documents, context_length=length, eos_id=policy.eos_id, mask_prompt=sft.mask_prompt,
                         pad_last=True, pad_id=policy.pad_id, seed=seed)


def _padded_microbatches(policy: Any, data: list[tuple[list[int], list[int]]], size: int, seed: int, *,
                         skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Microbatches of `size` pairs, right-padded, in a fresh shuffle of the pairs each pass; the
    first `skip` are drawn but not built (those a resumed run trained on before it stopped)."""
    rng = random.Random(seed)
    order: list[int] = []
    drawn = 0
    while True:
        if len(order) < size:
            fresh = list(range(len(data)))
            rng.shuffle(fresh)
            order += fresh
        idx, order = order[:size], order[size:]
        drawn += 1
        if drawn <= skip:
            continue
        batch = tokenize_prompt_and_output([data[i][0] for i in idx], [data[i][1] for i in idx], policy.pad_id)
        yield {k: v.to(policy.device) for k, v in batch.items()}


def _packed_microbatches(data: Any, size: int, device: torch.device, *,
                         skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Microbatches of `size` packed windows, epoch after epoch (a microbatch may span two), from
    the `skip`-th on (each epoch's order depends on the epoch alone, so the stream starts there)."""
    epoch, offset = divmod(skip * size, len(data))
    stream = data.index_stream(epoch)
    for _ in range(offset):
        next(stream)
    while True:
        x, y, mask = data.batch([next(stream) for _ in range(size)], device)
        yield {"input_ids": x, "labels": y, "response_mask": mask}


def sft_train(
    policy: Any,
    pairs: Sequence[tuple[str, str]],
    *,
    sft: SFTConfig,
    optim: OptimConfig,
    seed: int = 0,
    log: LogFn | None = None,
    step_offset: int = 0,
    progress: bool = False,
    report: ReportFn | None = None,
    evaluate: EvaluateFn | None = None,
    long_warmup: LongWarmup = "refuse",
    stop: StopSignals | None = None,
    on_stop: StateFn | None = None,
    resume: dict[str, Any] | None = None,
    resume_every: int = 0,
    on_checkpoint: StateFn | None = None,
) -> list[dict[str, Any]]:
    """Fine-tune `policy.model` on (prompt, response) pairs; returns one metrics dict per step.

    The first step's row also counts the pairs and those left out or cut short to fit the
    context (`ContextFit.metrics`); `report`, when given, gets one line on the latter once the
    pairs are encoded, if there are any. (Packed windows leave out and cut nothing.) A warm-up
    not shorter than the run is then handled as `long_warmup` says (`fit_warmup`). Then
    `evaluate`, when given, runs on the starting policy: its results go to `log` as the
    ``eval_*`` keys of a row for step `step_offset`, which the returned history leaves out.
    Once `stop` has noted a signal, the loop logs the row of the step it just took, gives its
    training state to `on_stop` and returns (`scratchlm.align.interrupt`). Given that state as
    `resume` (with the policy as it stopped), the loop goes on from there as if it had not stopped:
    no starting evaluation, the row of the step it stopped at logged if an uninterrupted run logs
    it, the same batches after it; the history returned holds the rows of the steps before too.
    Every `resume_every` steps but the last, `on_checkpoint` gets the state a stop there would give
    `on_stop` (to save, so that a run killed outright resumes from there).
    """
    model = policy.model
    if not pairs:
        return []
    if sft.packed:
        packed = packed_sft_dataset(policy, pairs, sft=sft, seed=seed)
        fit = ContextFit(len(pairs), context_length=policy.context_length)
        items = len(packed)
    else:
        data, fit = fit_pairs(policy, pairs)
        if not data:  # a silent no-op would save the starting policy as the fine-tuned one
            raise UserError(f"no SFT pair fits the model's context of {policy.context_length} tokens (every "
                            "prompt fills it); use a model with a longer context or shorter prompts")
        items = len(data)
    note = fit.describe()
    if report is not None and note:
        report(f"sft: {note}")
    total, source = schedule_length(sft.max_steps, sft.num_epochs, items, sft.micro_batch_size * sft.grad_accum_steps,
                                    section="sft", what="packed windows" if sft.packed else "pairs")
    optim = fit_warmup(optim, total, source, long_warmup=long_warmup)
    if evaluate is not None and resume is None:
        start = {"phase": "sft", "step": step_offset, **eval_metrics(evaluate, step_offset)}
        if log is not None:
            log(start)
    optimizer = make_optimizer(model, optim)
    normalize_constant = sft.normalize_constant or None
    history: list[dict[str, Any]] = []
    first = 0

    def logs(step: int) -> bool:  # whether the row of `step` (0-based) goes to `log`
        return step % max(sft.log_every, 1) == 0 or step == total - 1

    def loop_state(steps: int) -> dict[str, Any]:  # what a resumed loop needs after `steps` steps
        return {"step": steps, "optimizer": optimizer.state_dict(), "history": list(history), "rng": rng_state()}

    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        history, first = list(resume["history"]), int(resume["step"])
        set_rng_state(resume["rng"])
        if log is not None and logs(first - 1):  # (the row the stop logged was dropped from the metrics)
            log(history[-1])
    skip = first * sft.grad_accum_steps
    microbatches = (_packed_microbatches(packed, sft.micro_batch_size, policy.device, skip=skip) if sft.packed
                    else _padded_microbatches(policy, data, sft.micro_batch_size, seed, skip=skip))
    log_probs = log_probs_fn(sft.compile)
    model.train()
    bar = _bar(total, progress)
    bar.update(first)
    for step in range(first, total):
        loss_sum, entropy_sum, tokens = 0.0, 0.0, 0.0
        for _ in range(sft.grad_accum_steps):
            batch_t = next(microbatches)
            with autocast_context(policy.device):
                out = log_probs(model, batch_t["input_ids"], batch_t["labels"], return_token_entropy=True)
            loss, meta = sft_microbatch_train_step(out["log_probs"], batch_t["response_mask"], sft.grad_accum_steps,
                                                   normalize_constant)
            loss_sum += float(loss)
            entropy_sum += float(masked_mean(out["token_entropy"], batch_t["response_mask"])) / sft.grad_accum_steps
            tokens += float(meta["response_tokens"])
        lr = learning_rate(step, total, optim)
        norm = optimizer_step(model, optimizer, lr, optim.max_grad_norm)
        row = {"phase": "sft", "step": step_offset + step + 1, "loss": loss_sum, "lr": lr, "grad_norm": norm,
               "token_entropy": entropy_sum, "response_tokens": tokens, **(fit.metrics() if step == 0 else {})}
        history.append(row)
        stopping = stop_requested(stop)
        if log is not None and (logs(step) or stopping):
            log(row)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum:.3f}")
        if stopping:
            if on_stop is not None:
                on_stop(loop_state(step + 1))
            break
        if on_checkpoint is not None and checkpoint_due(step + 1, total, resume_every):
            on_checkpoint(loop_state(step + 1))
    bar.close()
    model.eval()
    return history


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, enabled: bool, desc: str = "sft"):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step")
