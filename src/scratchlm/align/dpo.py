"""Direct preference optimisation (DPO) against a frozen reference model.

DPO fits a policy to preference pairs (x, y_w, y_l), y_w preferred, without a reward model or
sampling: the policy's implicit reward of a response is r(x, y) = β (log πθ(y|x) − log πref(y|x)),
and the loss is the logistic loss of the reward difference,

    L = −log σ( r(x, y_w) − r(x, y_l) ),

which pushes log πθ(y_w|x) up and log πθ(y_l|x) down relative to the reference, β setting how
far the policy may move from it. log π(y|x) is the sum of the response tokens'
log-probabilities; the prompt tokens are conditioned on, not scored. The reference is a frozen
copy of the starting policy, evaluated without gradients.

A pair is encoded as prompt ids + response ids + end-of-text for each response (as SFT
targets are), cut to the model's context length. Chosen and rejected rows of a microbatch go
through the model in one forward pass. An optimizer step accumulates `grad_accum_steps`
microbatches of `micro_batch_size` pairs, clips the global gradient norm and follows the cosine
schedule of `OptimConfig`. Logged per step: loss, reward accuracy (the share of pairs whose
chosen reward exceeds the rejected one), reward margin, mean chosen/rejected reward and
log-probability; with held-out pairs, the same on them every `eval_every` steps.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.align.config import DPOConfig, OptimConfig
from scratchlm.align.interrupt import stop_requested
from scratchlm.align.logprobs import response_log_probs, tokenize_prompt_and_output
from scratchlm.align.policy import autocast_context
from scratchlm.align.preferences import PreferencePair
from scratchlm.align.resume import weights_digest
from scratchlm.align.sft import (
    ContextFit,
    LogFn,
    LongWarmup,
    ReportFn,
    StateFn,
    _bar,
    checkpoint_due,
    fit_warmup,
    learning_rate,
    make_optimizer,
    optimizer_step,
    recorder,
    schedule_length,
)
from scratchlm.errors import UserError
from scratchlm.train.checkpoint import rng_state, set_rng_state
from scratchlm.train.interrupt import StopSignals

EncodedPair = tuple[list[int], list[int], list[int]]  # prompt ids, chosen ids, rejected ids


def dpo_loss(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor,
             ref_rejected_logps: Tensor, beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair DPO losses and the implicit rewards of both responses, each (B,).

    loss = −log σ(β·[(log πθ(y_w|x) − log πref(y_w|x)) − (log πθ(y_l|x) − log πref(y_l|x))]),
    rewards = β·(log πθ(y|x) − log πref(y|x)) for y = y_w and y = y_l (detached).
    The inputs are sequence log-probabilities, summed over response tokens.

    >>> z = torch.zeros(1)
    >>> round(float(dpo_loss(z, z, z, z, beta=0.1)[0]), 4)  # policy == reference: log 2
    0.6931
    """
    chosen = policy_chosen_logps - ref_chosen_logps
    rejected = policy_rejected_logps - ref_rejected_logps
    losses = -F.logsigmoid(beta * (chosen - rejected))
    return losses, (beta * chosen).detach(), (beta * rejected).detach()


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` in eval mode whose parameters take no gradient: the DPO reference."""
    return freeze(copy.deepcopy(model))


def freeze(model: nn.Module) -> nn.Module:
    """`model` itself, in eval mode, its parameters taking no gradient (a reference loaded for the purpose)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None
    return model


def fit_preference_pairs(policy: Any, pairs: Sequence[PreferencePair]) -> tuple[list[EncodedPair], ContextFit]:
    """`encode_preference_pairs`, and how many pairs it left out or cut (either response) to fit the context."""
    limit = policy.context_length + 1  # input_ids and labels are each one shorter
    eos = [policy.eos_id] if policy.eos_id is not None else []
    out, cut = [], 0
    for pair in pairs:
        prompt = policy.encode(pair.prompt)
        if len(prompt) >= limit:
            continue
        room = limit - len(prompt)
        chosen, rejected = policy.encode(pair.chosen) + eos, policy.encode(pair.rejected) + eos
        cut += max(len(chosen), len(rejected)) > room
        out.append((prompt, chosen[:room], rejected[:room]))
    return out, ContextFit(len(pairs), len(pairs) - len(out), cut, policy.context_length)


def encode_preference_pairs(policy: Any, pairs: Sequence[PreferencePair]) -> list[EncodedPair]:
    """(prompt ids, chosen ids + eos, rejected ids + eos) per pair, responses cut to the context.

    A pair whose prompt alone fills the context is left out: neither response could be scored.
    """
    return fit_preference_pairs(policy, pairs)[0]


def preference_batch(pairs: Sequence[EncodedPair], pad_id: int, device: torch.device) -> dict[str, Tensor]:
    """The rows ``chosen_1..chosen_B, rejected_1..rejected_B`` as input_ids, labels, response_mask (2B, T)."""
    prompts = [p for p, _, _ in pairs] * 2
    responses = [c for _, c, _ in pairs] + [r for _, _, r in pairs]
    batch = tokenize_prompt_and_output(prompts, responses, pad_id)
    return {k: v.to(device) for k, v in batch.items()}


def sequence_log_probs(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """log π(y|x) of every row, (N,) float32: the sum of its response tokens' log-probabilities."""
    device = batch["input_ids"].device
    with autocast_context(device):
        log_probs = response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"]  # (N, T)
    return (log_probs * batch["response_mask"]).sum(-1)


def pair_log_probs(model: nn.Module, reference: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """(policy chosen, policy rejected, reference chosen, reference rejected) log-probs, each (B,).

    The policy's carry gradients; the reference's are computed under no_grad.
    """
    policy_logps = sequence_log_probs(model, batch)
    with torch.no_grad():
        ref_logps = sequence_log_probs(reference, batch)
    B = policy_logps.shape[0] // 2
    return policy_logps[:B], policy_logps[B:], ref_logps[:B], ref_logps[B:]


def pair_metrics(losses: Tensor, chosen_logps: Tensor, rejected_logps: Tensor, chosen_rewards: Tensor,
                 rejected_rewards: Tensor) -> dict[str, float]:
    """Sums over the pairs of a batch of what a metrics row reports as means."""
    return {"loss": float(losses.detach().sum()),
            "reward_accuracy": float((chosen_rewards > rejected_rewards).float().sum()),
            "reward_margin": float((chosen_rewards - rejected_rewards).sum()),
            "chosen_reward": float(chosen_rewards.sum()), "rejected_reward": float(rejected_rewards.sum()),
            "chosen_logp": float(chosen_logps.detach().sum()), "rejected_logp": float(rejected_logps.detach().sum())}


def _mean_of_sums(sums: list[dict[str, float]], count: int) -> dict[str, float]:
    return {k: sum(s[k] for s in sums) / max(count, 1) for k in sums[0]} if sums else {}


def evaluate_preferences(model: nn.Module, reference: nn.Module, pairs: Sequence[EncodedPair], *, beta: float,
                         pad_id: int, batch_size: int = 8) -> dict[str, float]:
    """Mean DPO loss, reward accuracy, margin, rewards and log-probs over `pairs`, without gradients."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums = []
    try:
        with torch.no_grad():
            for start in range(0, len(pairs), batch_size):
                batch = preference_batch(pairs[start:start + batch_size], pad_id, device)
                pc, pr, rc, rr = pair_log_probs(model, reference, batch)
                losses, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, rc, rr, beta)
                sums.append(pair_metrics(losses, pc, pr, chosen_rewards, rejected_rewards))
    finally:
        model.train(was_training)
    return _mean_of_sums(sums, len(pairs))


def _shuffled_microbatches(n: int, size: int, seed: int) -> Iterator[list[int]]:
    """Index lists of `size`, from a fresh shuffle of range(n) at each pass (a list may span two)."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        while len(order) < size:  # fewer pairs than `size`: the list takes several passes
            fresh = list(range(n))
            rng.shuffle(fresh)
            order += fresh
        idx, order = order[:size], order[size:]
        yield idx


def dpo_train(
    policy: Any,
    pairs: Sequence[PreferencePair],
    *,
    dpo: DPOConfig,
    optim: OptimConfig,
    eval_pairs: Sequence[PreferencePair] = (),
    reference: nn.Module | None = None,
    save: Callable[[int], Any] | None = None,
    seed: int = 0,
    log: LogFn | None = None,
    progress: bool = False,
    report: ReportFn | None = None,
    long_warmup: LongWarmup = "refuse",
    stop: StopSignals | None = None,
    on_stop: StateFn | None = None,
    resume: dict[str, Any] | None = None,
    resume_every: int = 0,
    on_checkpoint: StateFn | None = None,
) -> list[dict[str, Any]]:
    """Train `policy.model` with DPO on preference pairs; returns one metrics dict per step.

    `reference` defaults to a frozen copy of the policy as it is when called. With
    `eval_pairs`, a row for step 0 holds their metrics before training, and every
    `dpo.eval_every` steps and the last step add them under ``eval_*`` keys. `save(step)`, when
    given, runs every `dpo.save_every` steps (the caller saves the final policy). The step-1 row
    also counts the training and held-out pairs and those left out or cut short to fit the
    context (`ContextFit.metrics`); `report`, when given, gets one line on the latter before
    training starts, if there are any. A warm-up not shorter than the run is handled as
    `long_warmup` says (`sft.fit_warmup`), before the reference is copied. Once `stop` has noted
    a signal, the loop logs the row of the step it just took, without evaluation, gives its
    training state to `on_stop` (with the digest of the reference) and returns
    (`scratchlm.align.interrupt`). Given that state as `resume`, with the policy as it stopped and
    the starting policy as `reference`, the loop goes on as if it had not stopped: the evaluation
    the stop skipped, the same batches after it; the history returned holds the rows before too.
    Every `resume_every` steps but the last, once the step is evaluated when due, `on_checkpoint`
    gets the state a stop there would give `on_stop` (to save with the policy, so that a run killed
    outright resumes from there); with it on, a `save` due is such a save instead, so that the
    policy on disk always has its state beside it.
    """
    model = policy.model
    data, fit = fit_preference_pairs(policy, pairs)
    if not data:
        raise UserError("no preference pair fits the model's context (every prompt fills it)")
    held_out, eval_fit = fit_preference_pairs(policy, eval_pairs)
    notes = [note for note in (fit.describe("training pairs"), eval_fit.describe("held-out pairs")) if note]
    if report is not None and notes:
        report("dpo: " + "; ".join(notes))
    batch = dpo.micro_batch_size * dpo.grad_accum_steps
    total, source = schedule_length(dpo.max_steps, dpo.num_epochs, len(data), batch, section="dpo")
    optim = fit_warmup(optim, total, source, long_warmup=long_warmup)
    if reference is None and resume is not None:
        raise ValueError("resuming DPO needs the starting policy as its reference")
    reference = frozen_copy(model) if reference is None else reference
    microbatches = _shuffled_microbatches(len(data), dpo.micro_batch_size, seed)
    optimizer = make_optimizer(model, optim)
    history: list[dict[str, Any]] = []
    record = recorder(history, log)
    log_every = max(dpo.log_every, 1)

    def evaluate() -> dict[str, float]:
        metrics = evaluate_preferences(model, reference, held_out, beta=dpo.beta, pad_id=policy.pad_id,
                                       batch_size=dpo.micro_batch_size)
        return {f"eval_{k}": v for k, v in metrics.items()}

    def finish(step: int, row: dict[str, Any], stopping: bool) -> None:
        """Evaluate when due (unless `stopping`), then log the row, or keep it between log lines."""
        last = step == total
        due = last or (dpo.eval_every and step % dpo.eval_every == 0)
        if held_out and not stopping and due and "eval_loss" not in row:  # (a resumed row may hold it)
            row.update(evaluate())
        if last or stopping or "eval_loss" in row or (step - 1) % log_every == 0:
            record(row)
        else:
            history.append(row)  # between log lines: in the history only

    def loop_state(step: int) -> dict[str, Any]:  # what a resumed loop needs after `step`
        return {"step": step, "optimizer": optimizer.state_dict(), "history": list(history), "rng": rng_state(),
                "reference": weights_digest(reference)}

    first = 1
    if resume is None:
        if held_out:
            record({"phase": "dpo", "step": 0, **evaluate()})
    else:
        optimizer.load_state_dict(resume["optimizer"])
        history.extend(resume["history"][:-1])
        first = int(resume["step"])
        set_rng_state(resume["rng"])
        for _ in range(first * dpo.grad_accum_steps):
            next(microbatches)  # those of the steps taken
        finish(first, dict(resume["history"][-1]), False)  # its evaluation, which the stop skipped
        first += 1
    model.train()
    bar = _bar(total, progress, desc="dpo")
    bar.update(first - 1)
    for step in range(first, total + 1):
        sums = []
        for _ in range(dpo.grad_accum_steps):
            idx = next(microbatches)
            pc, pr, rc, rr = pair_log_probs(model, reference,
                                            preference_batch([data[i] for i in idx], policy.pad_id, policy.device))
            losses, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, rc, rr, dpo.beta)
            (losses.mean() / dpo.grad_accum_steps).backward()
            sums.append(pair_metrics(losses, pc, pr, chosen_rewards, rejected_rewards))
        lr = learning_rate(step - 1, total, optim)
        norm = optimizer_step(model, optimizer, lr, optim.max_grad_norm)
        row = {"phase": "dpo", "step": step, **_mean_of_sums(sums, batch), "lr": lr, "grad_norm": norm}
        if step == 1:
            row.update(fit.metrics(), **eval_fit.metrics("eval_"))
        stopping = stop_requested(stop)  # (the caller then saves the policy, so no save_every save here)
        finish(step, row, stopping)
        saving = save is not None and dpo.save_every and step % dpo.save_every == 0 and not (step == total or stopping)
        checkpoint = on_checkpoint is not None and resume_every > 0 and not stopping and (
            saving or checkpoint_due(step, total, resume_every))
        if saving and not checkpoint:
            save(step)
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['reward_accuracy']:.2f}")
        if stopping:
            if on_stop is not None:
                on_stop(loop_state(step))
            break
        if checkpoint:
            on_checkpoint(loop_state(step))
    bar.close()
    model.eval()
    return history
