"""Stopping a post-training run on Ctrl-C (SIGINT) or SIGTERM without losing its training.

The SFT, expert-iteration, GRPO and DPO loops take a `stop` note (a
`scratchlm.train.interrupt.StopSignals`) and read it after each optimizer step: once a signal has
come, they log the row of that step and return, skipping the evaluations still due (a user who
presses Ctrl-C wants out, and an evaluation can take minutes). The policy is then whole: no
update is ever half applied. `run_interruptible` runs such a loop with the handlers installed;
when the loop returned on a signal, it saves the policy where the end of the run would have, logs
a record ``{"phase": ..., "step": N, "interrupted": "SIGINT"}`` and raises `TrainingInterrupted`,
which the command line reports on one line before exiting with 130 (SIGINT) or 143 (SIGTERM). A
second signal stops at once, without saving.

Only the policy is kept, not the optimizer state, the schedule or the data order: a stopped run
is continued by a new run starting from the saved policy (``--policy.path``), whose warm-up and
schedule start afresh.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scratchlm.train.interrupt import StopSignals, TrainingInterrupted, signal_name, stop_signals

__all__ = ["run_interruptible", "stop_requested"]

History = list[dict[str, Any]]


def stop_requested(stop: StopSignals | None) -> bool:
    """Whether a loop given `stop` is to return after the optimizer step it just took."""
    return stop is not None and stop.signum is not None


def run_interruptible(train: Callable[[StopSignals], History], *, phase: str, policy: Any, out: Path,
                      log: Callable[[dict[str, Any]], None], evaluation: str | None = None) -> History:
    """``train(stop)``'s history, with SIGINT and SIGTERM noted in `stop` while it runs.

    When `train` returned on a signal, the policy is saved to `out` at the step of the last
    history row (as ``policy.save(out, step=N)``, the run's normal end), the record
    ``{"phase": phase, "step": N, "interrupted": "SIGINT"}`` goes to `log`, and
    `TrainingInterrupted` is raised, naming `out`. `evaluation` is the key of a row that holds the
    results of an evaluation (``"eval_accuracy"``) when the run ends with one: the message then
    says whether the saved policy went without it.
    """
    with stop_signals(announce=True, stops_after="this optimizer step, once the policy is saved",
                      second_loses="without saving the policy") as stop:
        history = train(stop)
        if stop.signum is None:
            return history
        last = history[-1] if history else {}
        step = last.get("step", 0)
        policy.save(out, step=step)
        name = signal_name(stop.signum)
        log({"phase": phase, "step": step, "interrupted": name})
    unevaluated = evaluation is not None and evaluation not in last
    raise TrainingInterrupted(
        f"interrupted by {name} at step {step}; policy saved to {out}"
        f"{' (its final evaluation skipped)' if unevaluated else ''}; continue from it with "
        f"--policy.path={shlex.quote(str(out))} and another --run.out_dir (the optimizer and schedule start afresh)",
        signum=stop.signum, step=step, checkpoint=out)
