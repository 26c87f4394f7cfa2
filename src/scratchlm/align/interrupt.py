"""Stopping a post-training run on Ctrl-C (SIGINT) or SIGTERM without losing its training.

The SFT, expert-iteration, GRPO and DPO loops take a `stop` note (a
`scratchlm.train.interrupt.StopSignals`) and read it after each optimizer step: once a signal has
come, they log the row of that step, hand their training state to ``on_stop`` and return,
skipping the evaluations still due (a user who presses Ctrl-C wants out, and an evaluation can
take minutes). The policy is then whole: no update is ever half applied. `run_interruptible` runs
such a loop with the handlers installed; when the loop returned on a signal, it saves the policy
where the end of the run would have, then the training state the loop handed over
(`scratchlm.align.resume.ResumePoint`: optimizer, step, data position, random states, metrics
rows; `ResumePoint.save` writes the two so that a kill while saving leaves a pair that belongs
together), logs a record ``{"phase": ..., "step": N, "interrupted": "SIGINT"}`` and raises
`TrainingInterrupted`, which the command line reports on one line, naming the command that
resumes the run (the same one with ``--resume``), before exiting with 130 (SIGINT) or 143
(SIGTERM). A second signal stops at once, without saving.

The resumed run continues as if it had not stopped: it runs the evaluation the stop skipped,
logs the rows an uninterrupted run would have, and ends with the same policy (bitwise on CPU).
Without a `ResumePoint` (the loops called as a library), only the policy is kept: a new run
starts from it (``--policy.path``), its warm-up and schedule afresh.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scratchlm.train.interrupt import StopSignals, TrainingInterrupted, signal_name, stop_signals

if TYPE_CHECKING:
    from scratchlm.align.resume import ResumePoint

__all__ = ["run_interruptible", "stop_requested"]

History = list[dict[str, Any]]


def stop_requested(stop: StopSignals | None) -> bool:
    """Whether a loop given `stop` is to return after the optimizer step it just took."""
    return stop is not None and stop.signum is not None


def run_interruptible(train: Callable[[StopSignals], History], *, phase: str, policy: Any, out: Path,
                      log: Callable[[dict[str, Any]], None], evaluation: str | None = None,
                      resume: ResumePoint | None = None) -> History:
    """``train(stop)``'s history, with SIGINT and SIGTERM noted in `stop` while it runs.

    When `train` returned on a signal, the policy is saved to `out` at the step of the last
    history row (as ``policy.save(out, step=N)``, the run's normal end), then, when `resume` (a
    `scratchlm.align.resume.ResumePoint`, the loop's ``on_stop``) kept the loop's state, that state;
    the record ``{"phase": phase, "step": N, "interrupted": "SIGINT"}`` goes to `log`, and
    `TrainingInterrupted` is raised, naming `out` and the command that resumes the run.
    `evaluation` is the key of a row that holds the results of an evaluation
    (``"eval_accuracy"``) when the run ends with one: the message then says whether the saved
    policy went without it.
    """
    saved, verb = ("the policy", "is") if resume is None else ("the policy and its training state", "are")
    with stop_signals(announce=True, stops_after=f"this optimizer step, once {saved} {verb} saved",
                      second_loses=f"without saving {saved}") as stop:
        history = train(stop)
        if stop.signum is None:
            return history
        last = history[-1] if history else {}
        step = last.get("step", 0)
        if resume is not None and resume.loop is not None:
            state = resume.save(step, policy, out)  # (the policy with it, as one pair: `ResumePoint.save`)
        else:
            policy.save(out, step=step)
            state = None
        name = signal_name(stop.signum)
        log({"phase": phase, "step": step, "interrupted": name})
    unevaluated = evaluation is not None and evaluation not in last
    skipped = " (its final evaluation skipped)" if unevaluated else ""
    if state is not None:
        how = f" and its training state to {state}; resume with: {resume.command_line}"
    else:
        how = (f"; continue from it with --policy.path={shlex.quote(str(out))} and another --run.out_dir "
               "(the optimizer and schedule start afresh)")
    raise TrainingInterrupted(f"interrupted by {name} at step {step}; policy saved to {out}{skipped}{how}",
                              signum=stop.signum, step=step, checkpoint=out)
