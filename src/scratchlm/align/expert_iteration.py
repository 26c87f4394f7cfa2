"""Expert iteration: sample, keep what the verifier accepts, fine-tune on it, repeat.

Each of `n_ei_steps` steps draws `questions_per_step` training questions, samples
`group_size` responses to each at the rollout temperature, keeps the distinct responses with
reward 1, and runs SFT (sft.py) on those (prompt, response) pairs. It is rejection-sampling
fine-tuning: the policy only ever imitates its own verified successes, so it needs no
reference solutions once it can solve some questions. A run stopped by a signal hands its state
to `on_stop` (with its SFT's, when that stopped part-way) and goes on from it given as `resume`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from scratchlm.align.config import ExpertIterationConfig, OptimConfig, SamplingConfig, SFTConfig
from scratchlm.align.datasets import MathExample
from scratchlm.align.interrupt import stop_requested
from scratchlm.align.prompts import PromptTemplate
from scratchlm.align.resume import restore_random
from scratchlm.align.reward_registry import get_reward_fn
from scratchlm.align.rewards import RewardFn
from scratchlm.align.sft import (
    LogFn, LongWarmup, StateFn, checkpoint_due, eval_metrics, fit_warmup, recorder, schedule_length, sft_train,
)
from scratchlm.errors import UserError
from scratchlm.train.checkpoint import rng_state, set_rng_state
from scratchlm.train.interrupt import StopSignals


def filter_rewarded(
    prompts: Sequence[str], responses: Sequence[str], rewards: Sequence[dict[str, float]]
) -> list[tuple[str, str]]:
    """The distinct (prompt, response) pairs whose reward is 1, in order of first appearance.

    >>> filter_rewarded(["q", "q", "q"], ["a", "a", "b"], [{"reward": 1.0}] * 2 + [{"reward": 0.0}])
    [('q', 'a')]
    """
    seen: set[tuple[str, str]] = set()
    kept = []
    for p, r, s in zip(prompts, responses, rewards):
        if s["reward"] == 1.0 and (p, r) not in seen:
            seen.add((p, r))
            kept.append((p, r))
    return kept


def check_train_examples(train_examples: Sequence[MathExample], ei: ExpertIterationConfig) -> None:
    """UserError when there are fewer questions than a step draws (`questions_per_step`)."""
    if len(train_examples) < ei.questions_per_step:
        raise UserError(f"expert iteration draws {ei.questions_per_step} questions a step (ei.questions_per_step) but "
                        f"the training set has {len(train_examples)}; lower ei.questions_per_step or add examples")


def round_updates(ei: ExpertIterationConfig, sft: SFTConfig) -> tuple[int, str] | None:
    """The most optimizer updates one EI step's SFT can take (every response kept), and where
    that number comes from; None for packed SFT, whose windows are only counted once the kept
    responses are encoded."""
    if sft.packed:
        return None
    responses = ei.questions_per_step * ei.group_size
    total, _ = schedule_length(0, ei.sft_epochs, responses, sft.micro_batch_size * sft.grad_accum_steps, section="ei")
    return total, (f"that the SFT of an expert-iteration step takes at most (ei.sft_epochs={ei.sft_epochs:g} over "
                   f"ei.questions_per_step x ei.group_size = {responses} responses, "
                   f"{sft.micro_batch_size * sft.grad_accum_steps} a step)")


def expert_iteration(
    policy: Any,
    train_examples: Sequence[MathExample],
    *,
    template: PromptTemplate,
    reward_fn: RewardFn | str,
    ei: ExpertIterationConfig,
    sft: SFTConfig,
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
    """Run expert iteration on `policy`; returns one metrics dict per EI step (step 0: start).

    `reward_fn` is a function or the name of a registered reward (reward_registry.REWARDS).
    Each step's SFT starts a fresh schedule (warm-up included) over that step's updates, which
    depend on how many responses it keeps; a warm-up not shorter than the most a step can take
    (`round_updates`) is handled as `long_warmup` says (`sft.fit_warmup`). Once `stop` has noted
    a signal, the step in progress ends after its SFT's optimizer step in progress, its row
    (without evaluation) is the last, and the loop gives its training state to `on_stop` (with
    the kept responses and the SFT's own state when it stopped part-way;
    `scratchlm.align.interrupt`). Given that state as `resume`, with the policy as it stopped, the
    loop goes on as if it had not stopped: the rest of the step's SFT, or the evaluation the stop
    skipped, then the same samples after it; the history returned holds the rows before too.
    Every `resume_every` EI steps but the last, once the step is evaluated and logged,
    `on_checkpoint` gets the state a stop there would give `on_stop` (to save, so that a run killed
    outright resumes from there).
    """
    check_train_examples(train_examples, ei)
    reward_fn = get_reward_fn(reward_fn)
    bound = round_updates(ei, sft)
    if bound is not None:
        optim = fit_warmup(optim, *bound, long_warmup=long_warmup)
    rng = random.Random(seed)
    history: list[dict[str, Any]] = []
    record = recorder(history, log)
    step_sft = SFTConfig(**{**vars(sft), "num_epochs": ei.sft_epochs, "max_steps": 0})

    def finish(step: int, row: dict[str, Any], *, evaluated: bool = False) -> bool:
        """Evaluate (not once a signal came, nor twice), log the row; whether the step is evaluated."""
        if evaluate is not None and not evaluated and not stop_requested(stop):
            row.update(eval_metrics(evaluate, step))
            evaluated = True
        record(row)
        return evaluated

    def hand_over(step: int, sft_steps: int, evaluated: bool, partial: dict[str, Any] | None = None, *,
                  to: StateFn | None = on_stop) -> None:
        """Give `to` (`on_stop`) the training state after `step` (`partial`: its SFT stopped part-way)."""
        if to is not None:
            to({"step": step, "sft_steps": sft_steps, "history": list(history), "round": partial,
                "evaluated": evaluated, "rollout_rng": rng.getstate(), "rng": rng_state()})

    sft_steps, first = 0, 1
    resumed = None  # the step stopped during its SFT: its kept pairs, rollout metrics and the SFT's state
    if resume is None:
        if evaluate is not None:
            record({"phase": "ei", "step": 0, **eval_metrics(evaluate, 0)})
    else:
        restore_random(rng, resume["rollout_rng"])
        set_rng_state(resume["rng"])
        history.extend(resume["history"][:-1])
        sft_steps, first, resumed = int(resume["sft_steps"]), int(resume["step"]), resume["round"]
        if resumed is None:  # the step was whole: its evaluation, which the stop skipped, and its row are left
            row = dict(resume["history"][-1])
            evaluated = finish(first, row, evaluated=resume["evaluated"])
            if stop_requested(stop):  # (a signal during that evaluation)
                hand_over(first, sft_steps, evaluated)
                return history
            sft_steps += row["sft_steps"]
            first += 1
    for step in range(first, ei.n_ei_steps + 1):
        if resumed is None:
            questions = rng.sample(list(train_examples), ei.questions_per_step)
            prompts = [template.format(q.question) for q in questions for _ in range(ei.group_size)]
            truths = [q.answer for q in questions for _ in range(ei.group_size)]
            t0 = time.perf_counter()
            completions = policy.generate(prompts, max_new_tokens=sampling.max_new_tokens,
                                          temperature=sampling.temperature, top_p=sampling.top_p, stop=template.stop,
                                          seed=rng.randrange(2**31), batch_size=sampling.batch_size)
            rollout_s = time.perf_counter() - t0
            responses = [c.text for c in completions]
            rewards = [reward_fn(r, t) for r, t in zip(responses, truths)]
            kept = filter_rewarded(prompts, responses, rewards)
            generated = sum(c.num_tokens for c in completions)
            rollout = {
                "rollout_reward": sum(r["reward"] for r in rewards) / len(rewards),
                "rollout_format": sum(r["format_reward"] for r in rewards) / len(rewards),
                "kept": len(kept),
                "response_tokens_mean": generated / len(completions),
                "rollout_tokens_per_s": generated / rollout_s if rollout_s > 0 else 0.0,
            }
            sft_seed, sft_state = rng.randrange(2**31), None
        else:
            kept, rollout = [tuple(pair) for pair in resumed["kept"]], resumed["rollout"]
            sft_seed, sft_state, resumed = resumed["sft_seed"], resumed["sft"], None
        stopped_sft: list[dict[str, Any]] = []
        sft_history = sft_train(policy, kept, sft=step_sft, optim=optim, seed=sft_seed, step_offset=sft_steps,
                                progress=progress, long_warmup="keep", stop=stop, on_stop=stopped_sft.append,
                                resume=sft_state)
        row = {
            "phase": "ei", "step": step, **rollout,
            "sft_steps": len(sft_history),
            "sft_loss": sft_history[-1]["loss"] if sft_history else float("nan"),
            "token_entropy": (sum(h["token_entropy"] for h in sft_history) / len(sft_history)
                              if sft_history else float("nan")),
        }
        evaluated = finish(step, row)
        if stop_requested(stop):  # (a signal during the evaluation: no samples after it)
            hand_over(step, sft_steps, evaluated, {"kept": kept, "rollout": rollout, "sft_seed": sft_seed,
                                                   "sft": stopped_sft[0]} if stopped_sft else None)
            break
        if checkpoint_due(step, ei.n_ei_steps, resume_every):
            hand_over(step, sft_steps, evaluated, to=on_checkpoint)
        sft_steps += len(sft_history)
    return history
