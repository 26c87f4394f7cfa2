"""Group-relative policy optimisation (GRPO) with verifiable rewards.

Each step samples `group_size` responses to each of `rollout_batch_size / group_size`
questions with the current policy, scores them, and turns rewards into advantages relative to
their group: A_i = (r_i - mean(group)) / (std(group) + eps), or without the division
(``normalize_by_std=False``, Dr. GRPO). Needing no learned value function is the point: the
group mean is the baseline.

Per-token losses, (B, T), for response tokens with log-probability logp:
- ``no_baseline``: -r · logp (REINFORCE on raw rewards)
- ``reinforce_with_baseline``: -A · logp
- ``grpo_clip``: -min(ρ A, clip(ρ, 1-ε, 1+ε) A), ρ = exp(logp - logp_old), where logp_old
  are the log-probabilities under the policy that sampled the rollouts. It keeps updates
  near that policy when a rollout batch is reused for several epochs (off-policy).

A response's loss is the masked mean of its token losses (``length_normalization="mean"``)
or their sum over a fixed constant (``"constant"``, so long and short responses weigh each
token alike), then averaged over the batch and divided by the accumulation steps.

`grpo_train` is a loop over named steps, each usable alone: `sample_rollouts` (questions and
a group of responses to each), `score_rollouts` (rewards and advantages), `rollout_batch`
(the token batch to train on), `update_policy` (the optimizer steps over that batch) and
`step_metrics` (the logged row), with the held-out evaluation every `eval_every` steps. Each
row also holds the wall seconds of its phases (`rollout_s`, `score_s`, `batch_s`, `update_s`
and `eval_s` when it evaluated), so a run shows where its time goes. A run stopped by a signal
hands its state to `on_stop`, part-way through a step's updates if need be (`UpdateProgress`),
and goes on from it given as `resume` (`scratchlm.align.resume`).

There is no KL penalty against a reference model: with verifiable rewards and few steps the
clip (or on-policy updates) keeps the policy close enough, and it saves a third model pass.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from scratchlm.align.compiled_logprobs import log_probs_fn
from scratchlm.align.config import GRPOConfig, OptimConfig, SamplingConfig
from scratchlm.align.datasets import MathExample
from scratchlm.align.interrupt import stop_requested
from scratchlm.align.logprobs import (
    masked_mean,
    masked_normalize,
    response_log_probs,
    tokenize_prompt_and_output,
)
from scratchlm.align.policy import Completion, autocast_context
from scratchlm.align.prompts import PromptTemplate
from scratchlm.align.resume import restore_random
from scratchlm.align.reward_registry import get_reward_fn
from scratchlm.align.rewards import RewardFn
from scratchlm.align.sft import (
    LogFn, LongWarmup, StateFn, _bar, checkpoint_due, eval_metrics, fit_warmup, learning_rate, make_optimizer,
    optimizer_step, recorder,
)
from scratchlm.errors import UserError
from scratchlm.train.checkpoint import rng_state, set_rng_state
from scratchlm.train.interrupt import StopSignals


def compute_group_normalized_rewards(
    reward_fn: RewardFn,
    rollout_responses: Sequence[str],
    repeated_ground_truths: Sequence[Any],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(advantages (N,), raw rewards (N,), metadata) for N = groups x group_size responses.

    Responses of one question are consecutive. Example: rewards [1, 0, 0, 1] in one group of
    4 -> mean 0.5, std 0.577 (unbiased) -> advantages [0.866, -0.866, -0.866, 0.866].
    """
    if len(rollout_responses) != len(repeated_ground_truths):
        raise ValueError("one ground truth per response")
    if len(rollout_responses) % group_size:
        raise ValueError(f"{len(rollout_responses)} responses do not split into groups of {group_size}")
    scores = [reward_fn(r, g) for r, g in zip(rollout_responses, repeated_ground_truths)]
    raw = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
    groups = raw.view(-1, group_size)  # (n_groups, G)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + advantage_eps)
    advantages = centred.reshape(-1)
    metadata = {
        "reward_mean": float(raw.mean()),
        "reward_std": float(raw.std()) if raw.numel() > 1 else 0.0,
        "reward_max": float(raw.max()),
        "reward_min": float(raw.min()),
        "format_reward_mean": sum(s["format_reward"] for s in scores) / len(scores),
        "answer_reward_mean": sum(s["answer_reward"] for s in scores) / len(scores),
        "solved_groups": float((groups.max(dim=1).values > 0).float().mean()),
        "zero_std_groups": float((groups.std(dim=1) == 0).float().mean()) if group_size > 1 else 1.0,
    }
    return advantages, raw, metadata


def compute_naive_policy_gradient_loss(raw_rewards_or_advantages: Tensor, policy_log_probs: Tensor) -> Tensor:
    """-A · logp per token: (B, 1) scores and (B, T) log-probs -> (B, T)."""
    return -raw_rewards_or_advantages * policy_log_probs


def compute_grpo_clip_loss(
    advantages: Tensor, policy_log_probs: Tensor, old_log_probs: Tensor, cliprange: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """-min(ρ A, clip(ρ, 1-ε, 1+ε) A) per token, (B, T); metadata["clipped"] marks where the
    clipped term was the smaller (the gradient is cut there), "clip_fraction" is its mean."""
    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    return loss, {"clipped": was_clipped, "ratio": ratio.detach()}


def compute_policy_gradient_loss(
    policy_log_probs: Tensor,
    loss_type: str,
    raw_rewards: Tensor | None = None,
    advantages: Tensor | None = None,
    old_log_probs: Tensor | None = None,
    cliprange: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss (B, T) of one of no_baseline, reinforce_with_baseline, grpo_clip."""
    if loss_type == "no_baseline":
        if raw_rewards is None:
            raise ValueError("no_baseline needs raw_rewards")
        return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}
    if loss_type == "reinforce_with_baseline":
        if advantages is None:
            raise ValueError("reinforce_with_baseline needs advantages")
        return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}
    if loss_type == "grpo_clip":
        if advantages is None or old_log_probs is None or cliprange is None:
            raise ValueError("grpo_clip needs advantages, old_log_probs and cliprange")
        return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def grpo_microbatch_train_step(
    policy_log_probs: Tensor,
    response_mask: Tensor,
    gradient_accumulation_steps: int,
    loss_type: str,
    raw_rewards: Tensor | None = None,
    advantages: Tensor | None = None,
    old_log_probs: Tensor | None = None,
    cliprange: float | None = None,
    *,
    length_normalization: str = "mean",
    normalize_constant: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Backward one microbatch's policy-gradient loss; returns (scaled loss, metadata).

    Scores are (B, 1); log-probs and mask (B, T). metadata["clip_fraction"] is the fraction of
    response tokens whose ratio was clipped (grpo_clip only).
    """
    per_token, meta = compute_policy_gradient_loss(policy_log_probs, loss_type, raw_rewards, advantages,
                                                   old_log_probs, cliprange)
    if length_normalization == "mean":
        per_sequence = masked_mean(per_token, response_mask, dim=-1)  # (B,)
    elif length_normalization == "constant":
        if not normalize_constant:
            raise ValueError("length_normalization='constant' needs a normalize_constant")
        per_sequence = masked_normalize(per_token, response_mask, normalize_constant, dim=-1)
    else:
        raise ValueError(f"unknown length_normalization {length_normalization!r}")
    loss = per_sequence.mean() / gradient_accumulation_steps
    loss.backward()
    out = {k: v for k, v in meta.items() if k != "clipped"}
    if "clipped" in meta:
        out["clip_fraction"] = masked_mean(meta["clipped"].float(), response_mask).detach()
    return loss.detach(), out


def _memo(encode: Callable[[str], list[int]]) -> Callable[[str], list[int]]:
    """`encode` remembering its results for the texts of one batch (each call returns a new list)."""
    seen: dict[str, list[int]] = {}

    def cached(text: str) -> list[int]:
        if text not in seen:
            seen[text] = encode(text)
        return list(seen[text])
    return cached


def rollout_response_ids(policy: Any, completions: Sequence[Any]) -> tuple[list[list[int]], float]:
    """The token ids to train on for each completion, and the fraction whose text re-encodes
    to other ids than those sampled.

    The policy gradient is only unbiased for the tokens the policy actually sampled, so the
    completion's own `token_ids` are used when the policy reports them; re-encoding the text
    (the fallback) gives the tokenizer's canonical split, which a sampled response need not
    follow. A response that stopped is trained to stop (end-of-text after it); an empty one
    still gets one token, so every row has a response to normalise over.
    """
    end = [policy.eos_id] if policy.eos_id is not None else [policy.pad_id]
    out, differ = [], 0
    encode = _memo(policy.encode)  # a group's responses often repeat one another
    for c in completions:
        encoded = encode(c.text)
        ids = encoded if c.token_ids is None else list(c.token_ids)
        if ids and ids[-1] == policy.eos_id and policy.eos_id is not None:
            body = ids[:-1]
        else:
            body = ids
            ids = ids + (end if c.stopped or not ids else [])
        differ += body != encoded
        out.append(ids)
    return out, differ / max(len(completions), 1)


def _sequence_log_probs(policy: Any, batch: dict[str, Tensor], micro: int, log_probs=response_log_probs) -> Tensor:
    """Log-probs (N, T) of a whole rollout batch without gradients, `micro` rows at a time."""
    parts = []
    with torch.no_grad(), autocast_context(policy.device):
        for s in range(0, batch["input_ids"].shape[0], micro):
            parts.append(log_probs(policy.model, batch["input_ids"][s:s + micro],
                                   batch["labels"][s:s + micro])["log_probs"].float())
    return torch.cat(parts)


class PhaseClock:
    """Wall seconds of a step's phases: ``with clock("rollout_s"): ...`` adds to clock.seconds.

    Each phase also shows as a range of its name in a `torch.profiler` trace. The phases end
    with a host read of their results (token ids, losses, the gradient norm), so GPU work is
    counted in the phase that queued it.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"grpo.{name.removesuffix('_s')}"):
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class Rollouts:
    """One rollout batch: `group_size` consecutive responses to each sampled question."""

    prompts: list[str]
    truths: list[Any]  # the ground truth of each response's question
    completions: list[Completion]
    seconds: float  # wall time of generation

    def state_dict(self) -> dict[str, Any]:
        """The batch as plain values, for a saved training state."""
        return {"prompts": self.prompts, "truths": self.truths, "seconds": self.seconds,
                "completions": [asdict(c) for c in self.completions]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Rollouts:
        return cls(state["prompts"], state["truths"], [Completion(**c) for c in state["completions"]],
                   state["seconds"])


def check_train_examples(train_examples: Sequence[MathExample], grpo: GRPOConfig) -> None:
    """UserError when there are fewer questions than one rollout batch draws (`rollout_batch_size / group_size`)."""
    needed = grpo.rollout_batch_size // grpo.group_size
    if len(train_examples) < needed:
        raise UserError(f"GRPO draws {needed} questions a step (grpo.rollout_batch_size / grpo.group_size) but "
                        f"the training set has {len(train_examples)}; lower grpo.rollout_batch_size or add examples")


def grpo_updates(grpo: GRPOConfig) -> tuple[int, str]:
    """Optimizer updates of a run of `grpo.n_grpo_steps` steps, and where that number comes from."""
    per_step = grpo.epochs_per_rollout_batch * (grpo.rollout_batch_size // grpo.train_batch_size)
    return grpo.n_grpo_steps * per_step, f"of this run (grpo.n_grpo_steps={grpo.n_grpo_steps} x {per_step} a step)"


def sample_rollouts(
    policy: Any,
    train_examples: Sequence[MathExample],
    *,
    template: PromptTemplate,
    grpo: GRPOConfig,
    sampling: SamplingConfig,
    rng: random.Random,
) -> Rollouts:
    """Draw `rollout_batch_size / group_size` questions with `rng` and sample a group of responses to each."""
    n_questions = grpo.rollout_batch_size // grpo.group_size
    questions = rng.sample(list(train_examples), min(n_questions, len(train_examples)))
    prompts = [template.format(q.question) for q in questions for _ in range(grpo.group_size)]
    truths = [q.answer for q in questions for _ in range(grpo.group_size)]
    t0 = time.perf_counter()
    completions = policy.generate(prompts, max_new_tokens=sampling.max_new_tokens,
                                  temperature=sampling.temperature, top_p=sampling.top_p,
                                  stop=template.stop, seed=rng.randrange(2**31), batch_size=sampling.batch_size)
    return Rollouts(prompts, truths, completions, time.perf_counter() - t0)


def score_rollouts(rollouts: Rollouts, reward_fn: RewardFn, grpo: GRPOConfig) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Rewards and group-normalised advantages of a rollout batch: (advantages (N,), raw (N,), metadata)."""
    responses = [c.text for c in rollouts.completions]
    return compute_group_normalized_rewards(reward_fn, responses, rollouts.truths, grpo.group_size,
                                            grpo.advantage_eps, grpo.normalize_by_std)


def rollout_batch(policy: Any, rollouts: Rollouts) -> tuple[dict[str, Tensor], float]:
    """The rollouts as a training batch on the policy's device (input_ids, labels, response_mask,
    each (N, T)), cut to the context, and the fraction of responses that re-encode differently."""
    encode = _memo(policy.encode)  # each prompt comes group_size times
    prompt_ids = [encode(p) for p in rollouts.prompts]
    response_ids, retokenized = rollout_response_ids(policy, rollouts.completions)
    limit = policy.context_length + 1
    response_ids = [r[: max(limit - len(p), 1)] for p, r in zip(prompt_ids, response_ids)]
    batch = tokenize_prompt_and_output(prompt_ids, response_ids, policy.pad_id)
    return {k: v.to(policy.device) for k, v in batch.items()}, retokenized


@dataclass
class UpdateProgress:
    """How far the optimizer updates over one rollout batch have gone (`update_policy`), so that a
    GRPO step stopped between two of them can be saved and taken up again."""

    taken: int = 0  # optimizer updates taken over the batch
    order: Tensor | None = None  # the row permutation of the pass in progress, (rollout_batch_size,)
    old: Tensor | None = None  # grpo_clip: log-probs (N, T) under the policy that sampled the rollouts
    lr: float = 0.0  # of the last update
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("loss", "token_entropy", "clip_fraction", "grad_norm"), 0.0))

    def state_dict(self) -> dict[str, Any]:
        old = None if self.old is None else self.old.cpu()
        return {"taken": self.taken, "order": self.order, "old": old, "lr": self.lr, "sums": dict(self.sums)}

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> UpdateProgress:
        old = None if state["old"] is None else state["old"].to(device)
        return cls(state["taken"], state["order"], old, state["lr"], dict(state["sums"]))


def update_policy(
    policy: Any,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Tensor],
    advantages: Tensor,
    raw_rewards: Tensor,
    *,
    grpo: GRPOConfig,
    optim: OptimConfig,
    normalize_constant: float,
    first_update: int,
    total_updates: int,
    rng: random.Random,
    stop: StopSignals | None = None,
    progress: UpdateProgress | None = None,
) -> tuple[dict[str, float], float, int]:
    """`epochs_per_rollout_batch` passes of optimizer steps over one scored rollout batch.

    Advantages and raw rewards are (N, 1) on the policy's device. Each pass shuffles the rows
    (with a seed drawn from `rng` when it starts) into optimizer steps of `train_batch_size` rows,
    each accumulated over `grad_accum_steps` microbatches; `first_update` is the number of updates
    of the run before this batch (the schedule's position). Returns (loss, token entropy, clip
    fraction and gradient norm averaged over the optimizer steps; the last learning rate; the
    number of optimizer steps taken). Once `stop` has noted a signal, no step follows the one in
    progress (`scratchlm.align.interrupt`). `progress`, when given, is kept up to date as the
    updates go, and one saved from a step stopped part-way takes its updates up where they stopped.
    """
    model = policy.model
    micro = grpo.train_batch_size // grpo.grad_accum_steps
    size, per_pass = grpo.train_batch_size, grpo.rollout_batch_size // grpo.train_batch_size
    progress = UpdateProgress() if progress is None else progress
    model.train()
    log_probs = log_probs_fn(grpo.compile)
    if grpo.loss_type == "grpo_clip" and progress.old is None:
        progress.old = _sequence_log_probs(policy, batch, micro, log_probs)
    while progress.taken < grpo.epochs_per_rollout_batch * per_pass:
        b = progress.taken % per_pass
        if b == 0:  # a pass starts: a fresh permutation of the batch
            seed = rng.randrange(2**31)
            progress.order = torch.randperm(grpo.rollout_batch_size, generator=torch.Generator().manual_seed(seed))
        rows = progress.order[b * size:(b + 1) * size]
        for m in range(grpo.grad_accum_steps):
            idx = rows[m * micro:(m + 1) * micro].to(policy.device)
            _microbatch_backward(model, batch, idx, advantages, raw_rewards, progress.old, grpo, normalize_constant,
                                 progress.sums, log_probs)
        progress.lr = learning_rate(first_update + progress.taken, total_updates, optim)
        progress.sums["grad_norm"] += optimizer_step(model, optimizer, progress.lr, optim.max_grad_norm)
        progress.taken += 1
        if stop_requested(stop):
            break
    model.eval()
    return {k: v / progress.taken for k, v in progress.sums.items()}, progress.lr, progress.taken


def _microbatch_backward(
    model: torch.nn.Module,
    batch: dict[str, Tensor],
    idx: Tensor,
    advantages: Tensor,
    raw_rewards: Tensor,
    old: Tensor | None,
    grpo: GRPOConfig,
    normalize_constant: float,
    sums: dict[str, float],
    log_probs=response_log_probs,
) -> None:
    """Forward and backward the rows `idx` of the batch; add their loss, entropy and clip fraction to `sums`."""
    mask = batch["response_mask"][idx]
    width = int(mask.any(dim=0).nonzero().max()) + 1  # drop columns that are padding in every row
    mask = mask[:, :width]
    with autocast_context(idx.device):
        out = log_probs(model, batch["input_ids"][idx, :width], batch["labels"][idx, :width],
                        return_token_entropy=True)
    loss, meta = grpo_microbatch_train_step(
        out["log_probs"], mask, grpo.grad_accum_steps, grpo.loss_type,
        raw_rewards=raw_rewards[idx], advantages=advantages[idx],
        old_log_probs=old[idx, :width] if old is not None else None, cliprange=grpo.cliprange,
        length_normalization=grpo.length_normalization, normalize_constant=normalize_constant)
    sums["loss"] += float(loss)
    sums["token_entropy"] += float(masked_mean(out["token_entropy"], mask)) / grpo.grad_accum_steps
    if "clip_fraction" in meta:
        sums["clip_fraction"] += float(meta["clip_fraction"]) / grpo.grad_accum_steps


def step_metrics(
    step: int, lr: float, update: dict[str, float], reward_meta: dict[str, float], rollouts: Rollouts,
    retokenized: float,
) -> dict[str, Any]:
    """The metrics row of one GRPO step."""
    completions = rollouts.completions
    generated = sum(c.num_tokens for c in completions)
    return {"phase": "grpo", "step": step, "lr": lr, **update, **reward_meta,
            "response_tokens_mean": generated / len(completions), "retokenized_fraction": retokenized,
            "rollout_tokens_per_s": generated / rollouts.seconds if rollouts.seconds > 0 else 0.0}


def grpo_train(
    policy: Any,
    train_examples: Sequence[MathExample],
    *,
    template: PromptTemplate,
    reward_fn: RewardFn | str,
    grpo: GRPOConfig,
    optim: OptimConfig,
    sampling: SamplingConfig,
    evaluate: Callable[[int], dict[str, Any]] | None = None,
    seed: int = 0,
    log: LogFn | None = None,
    progress: bool = False,
    long_warmup: LongWarmup = "refuse",
    stop: StopSignals | None = None,
    on_stop: StateFn | None = None,
    resume: dict[str, Any] | None = None,
    resume_every: int = 0,
    on_checkpoint: StateFn | None = None,
) -> list[dict[str, Any]]:
    """Run `grpo.n_grpo_steps` GRPO steps on `policy` (fewer when `grpo.max_seconds` runs out
    first); returns one metrics dict per step.

    `reward_fn` is a function or the name of a registered reward (reward_registry.REWARDS).
    `evaluate(step)`, when given, runs at step 0, every `grpo.eval_every` steps and at the end;
    its dict is merged into that step's metrics under ``eval_*`` keys. A warm-up not shorter
    than the run's updates is handled as `long_warmup` says (`sft.fit_warmup`), except in a
    time-limited run, whose length is not known in advance. Once `stop` has noted a signal, the
    step in progress ends after its optimizer step in progress, its row (averaging the updates
    it took, without evaluation) is the last, and the loop gives its training state to `on_stop`
    (with the rollouts and the updates of a step stopped part-way; `scratchlm.align.interrupt`).
    Given that state as `resume`, with the policy as it stopped, the loop goes on as if it had not
    stopped: the rest of the step's updates, or the evaluation the stop skipped, then the same
    rollouts after it; the history returned holds the rows before too, and ``elapsed_s`` counts on.
    Every `resume_every` steps but the last, once the step is logged (evaluated when due),
    `on_checkpoint` gets the state a stop there would give `on_stop` (to save, so that a run killed
    outright resumes from there).
    """
    check_train_examples(train_examples, grpo)
    reward_fn = get_reward_fn(reward_fn)
    total_updates, source = grpo_updates(grpo)
    optim = fit_warmup(optim, total_updates, source, long_warmup="keep" if grpo.max_seconds else long_warmup)
    rng = random.Random(seed)
    optimizer = make_optimizer(policy.model, optim)
    normalize_constant = grpo.normalize_constant or float(sampling.max_new_tokens)
    per_step = grpo.epochs_per_rollout_batch * (grpo.rollout_batch_size // grpo.train_batch_size)
    history: list[dict[str, Any]] = []
    record = recorder(history, log)
    bar = _bar(grpo.n_grpo_steps, progress, desc="grpo")

    def finish(step: int, row: dict[str, Any], clock: PhaseClock, *, evaluated: bool = False) -> tuple[bool, bool]:
        """Evaluate when due (not once a signal came, nor twice), log the row; (whether the run ends
        here, out of time or at its last step; whether the step is evaluated)."""
        out_of_time = bool(grpo.max_seconds) and row["elapsed_s"] >= grpo.max_seconds
        last = step == grpo.n_grpo_steps or out_of_time
        due = evaluate is not None and not evaluated and (last or (grpo.eval_every and step % grpo.eval_every == 0))
        if due and not stop_requested(stop):
            with clock("eval_s"):
                row.update(eval_metrics(evaluate, step))
            evaluated = True
        row.update(clock.seconds)
        record(row)
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}")
        return out_of_time, evaluated

    def hand_over(step: int, elapsed: float, evaluated: bool, updates: UpdateProgress | None = None,
                  rollouts: Rollouts | None = None, *, to: StateFn | None = on_stop) -> None:
        """Give `to` (`on_stop`) the training state after `step` (stopped part-way with `updates` of `rollouts`)."""
        if to is None:
            return
        state = {"step": step, "update": update, "optimizer": optimizer.state_dict(), "history": list(history),
                 "evaluated": evaluated, "elapsed_s": elapsed, "rollout_rng": rng.getstate(), "rng": rng_state()}
        if updates is not None and updates.taken < per_step:
            state["partial"] = {"rollouts": rollouts.state_dict(), **updates.state_dict()}
        to(state)

    update, first, started = 0, 1, time.perf_counter()
    resumed: UpdateProgress | None = None  # the updates of a step stopped part-way
    if resume is None:
        if evaluate is not None:
            record({"phase": "grpo", "step": 0, **eval_metrics(evaluate, 0)})
    else:
        optimizer.load_state_dict(resume["optimizer"])
        restore_random(rng, resume["rollout_rng"])
        set_rng_state(resume["rng"])
        history.extend(resume["history"][:-1])
        update, first, started = int(resume["update"]), int(resume["step"]), started - resume["elapsed_s"]
        bar.update(first - 1)
        partial = resume.get("partial")
        if partial is None:  # the step was whole: its evaluation, if the stop skipped it, and its row are left
            row = dict(resume["history"][-1])
            ends, evaluated = finish(first, row, PhaseClock(), evaluated=resume["evaluated"])
            if stop_requested(stop):  # (a signal during that evaluation)
                hand_over(first, row["elapsed_s"], evaluated)
                ends = True
            first = grpo.n_grpo_steps + 1 if ends else first + 1
        else:
            resumed = UpdateProgress.from_state(partial, policy.device)
            rollouts = Rollouts.from_state(partial["rollouts"])
    for step in range(first, grpo.n_grpo_steps + 1):
        clock = PhaseClock()
        updates = resumed if resumed is not None else UpdateProgress()
        if resumed is None:
            with clock("rollout_s"):
                rollouts = sample_rollouts(policy, train_examples, template=template, grpo=grpo, sampling=sampling,
                                           rng=rng)
        resumed = None
        with clock("score_s"):
            advantages, raw, reward_meta = score_rollouts(rollouts, reward_fn, grpo)
        with clock("batch_s"):
            batch, retokenized = rollout_batch(policy, rollouts)
        before = update - updates.taken  # the updates of the steps before this one
        with clock("update_s"):
            update_meta, lr, n_updates = update_policy(
                policy, optimizer, batch, advantages.to(policy.device)[:, None], raw.to(policy.device)[:, None],
                grpo=grpo, optim=optim, normalize_constant=normalize_constant, first_update=before,
                total_updates=total_updates, rng=rng, stop=stop, progress=updates)
        update = before + n_updates
        row = step_metrics(step, lr, update_meta, reward_meta, rollouts, retokenized)
        row["elapsed_s"] = time.perf_counter() - started  # GRPO wall time so far, evaluations included
        ends, evaluated = finish(step, row, clock)
        if stop_requested(stop):  # (a signal during the evaluation: no rollouts after it)
            hand_over(step, row["elapsed_s"], evaluated, updates, rollouts)
            break
        if ends:
            break
        if checkpoint_due(step, grpo.n_grpo_steps, resume_every):
            hand_over(step, row["elapsed_s"], evaluated, to=on_checkpoint)
    bar.close()
    return history
