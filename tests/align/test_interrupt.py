"""SIGINT and SIGTERM during post-training: each loop finishes the optimizer step in progress,
logs its row without the evaluations still due and returns; `run_interruptible` then saves the
policy (and the training state the loop handed over), logs the record of the stop and raises. The
signals are real (raised in this process from inside the loops), so the handlers installed are
what runs. The commands, in a real process, are tested in tests/cli/test_align_interrupt.py;
resuming in tests/align/test_resume.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from scratchlm.align import dpo as dpo_module
from scratchlm.align import grpo as grpo_module
from scratchlm.align import sft as sft_module
from scratchlm.align.config import (
    DPOConfig,
    ExpertIterationConfig,
    GRPOConfig,
    OptimConfig,
    SamplingConfig,
    SFTConfig,
)
from scratchlm.align.dpo import dpo_train
from scratchlm.align.expert_iteration import expert_iteration
from scratchlm.align.grpo import grpo_train
from scratchlm.align.interrupt import run_interruptible
from scratchlm.align.preferences import arithmetic_preference_pairs
from scratchlm.align.prompts import get_template
from scratchlm.align.sft import sft_train
from scratchlm.align.task import ArithmeticTask
from scratchlm.train.interrupt import TrainingInterrupted, stop_signals

pytestmark = pytest.mark.usefixtures("sigint_handled")

TEMPLATE = get_template("r1_zero")
CONSTANT_LR = OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0)  # the same updates however long the run
NO_REWARD = lambda response, truth: {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}  # noqa: E731


class SavingPolicy:
    """Records the calls of `save`."""

    def __init__(self) -> None:
        self.saved: list[tuple[Path, int]] = []

    def save(self, out: Path, *, step: int = 0) -> Path:
        self.saved.append((out, step))
        return out


def _signal_on_call(monkeypatch, module, name, number, signum=signal.SIGINT) -> list[int]:
    """Raise `signum` in this process at the `number`-th call of `module.name`, before it runs;
    returns the list counting the calls."""
    real, calls = getattr(module, name), []

    def wrapped(*args, **kwargs):
        calls.append(len(calls) + 1)
        if len(calls) == number:
            signal.raise_signal(signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def _sft_pairs(n=4):
    return [(TEMPLATE.format(e.question), TEMPLATE.response(e.reasoning, e.answer))
            for e in ArithmeticTask(difficulty=1).examples(n, seed=3)]


# ---------------------------------------------------------------------------- run_interruptible


def test_without_a_signal_the_history_is_returned_and_nothing_saved():
    policy, logged = SavingPolicy(), []
    handler = signal.getsignal(signal.SIGINT)
    history = run_interruptible(lambda stop: [{"phase": "sft", "step": 1}], phase="sft", policy=policy,
                                out=Path("out/policy"), log=logged.append)
    assert history == [{"phase": "sft", "step": 1}] and policy.saved == [] and logged == []
    assert signal.getsignal(signal.SIGINT) is handler


@pytest.mark.parametrize("last, skipped", [({"eval_accuracy": 0.5}, False), ({}, True)])
def test_a_signal_saves_the_policy_at_the_last_step_logs_the_stop_and_raises(last, skipped):
    policy, logged = SavingPolicy(), []
    handler = signal.getsignal(signal.SIGTERM)

    def train(stop):
        signal.raise_signal(signal.SIGTERM)  # would end the process under the default action
        assert stop.signum == signal.SIGTERM
        return [{"phase": "grpo", "step": 0, "eval_accuracy": 0.0}, {"phase": "grpo", "step": 3, **last}]

    with pytest.raises(TrainingInterrupted) as info:
        run_interruptible(train, phase="grpo", policy=policy, out=Path("runs/g/policy"), log=logged.append,
                          evaluation="eval_accuracy")
    assert policy.saved == [(Path("runs/g/policy"), 3)]
    assert logged == [{"phase": "grpo", "step": 3, "interrupted": "SIGTERM"}]
    exc = info.value
    assert exc.exit_code == 143 and exc.step == 3 and exc.checkpoint == Path("runs/g/policy")
    assert str(exc) == ("interrupted by SIGTERM at step 3; policy saved to runs/g/policy"
                        + (" (its final evaluation skipped)" if skipped else "")
                        + "; continue from it with --policy.path=runs/g/policy and another --run.out_dir "
                          "(the optimizer and schedule start afresh)")
    assert signal.getsignal(signal.SIGTERM) == handler


def test_a_signal_saves_the_training_state_the_loop_kept_and_names_the_command_that_resumes(tmp_path):
    from scratchlm.align.config import GRPORunConfig
    from scratchlm.align.resume import ResumePoint

    policy, logged = SavingPolicy(), []
    policy.model = torch.nn.Linear(2, 2)
    point = ResumePoint(tmp_path, command="grpo", config=GRPORunConfig(), data=[], argv=["align-grpo", "--x.y=a b"])

    def train(stop):
        signal.raise_signal(signal.SIGINT)
        point.keep({"step": 3, "history": [{"phase": "grpo", "step": 3}]})  # (the loop's on_stop)
        return [{"phase": "grpo", "step": 3}]

    with pytest.raises(TrainingInterrupted) as info:
        run_interruptible(train, phase="grpo", policy=policy, out=tmp_path / "policy", log=logged.append,
                          evaluation="eval_accuracy", resume=point)
    (where, step), = policy.saved  # into a folder of its own, put in place whole as policy/ (ResumePoint.save)
    assert step == 3 and where.parent == tmp_path and not where.exists() and (tmp_path / "policy").is_dir()
    assert logged == [{"phase": "grpo", "step": 3, "interrupted": "SIGINT"}]
    assert str(info.value) == (f"interrupted by SIGINT at step 3; policy saved to {tmp_path / 'policy'} (its final "
                               f"evaluation skipped) and its training state to {tmp_path / 'resume'}; resume with: "
                               "scratchlm grpo align-grpo '--x.y=a b' --resume")
    saved = point.read()
    assert saved.step == 3 and saved.loop["history"] == [{"phase": "grpo", "step": 3}]
    saved.check_policy(policy, tmp_path / "policy")


def test_a_second_signal_stops_at_once_without_saving():
    policy, logged = SavingPolicy(), []

    def train(stop):
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        raise AssertionError("the second signal raises")

    with pytest.raises(TrainingInterrupted, match="stopped at once by a second SIGINT, without saving the policy"):
        run_interruptible(train, phase="sft", policy=policy, out=Path("p"), log=logged.append)
    assert policy.saved == [] and logged == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ---------------------------------------------------------------------------- in the loops


def test_sft_finishes_the_step_in_progress_logs_it_and_stops(tiny_policy, monkeypatch):
    start = {k: v.clone() for k, v in tiny_policy.model.state_dict().items()}
    sft = SFTConfig(micro_batch_size=2, grad_accum_steps=2, max_steps=3, log_every=100)
    sft_train(tiny_policy, _sft_pairs(), sft=sft, optim=CONSTANT_LR)
    three_steps = {k: v.clone() for k, v in tiny_policy.model.state_dict().items()}
    tiny_policy.model.load_state_dict(start)

    # The signal comes in the first of the two microbatches of step 3.
    _signal_on_call(monkeypatch, sft_module, "sft_microbatch_train_step", 5)
    logged = []
    with stop_signals() as stop:
        history = sft_train(tiny_policy, _sft_pairs(), sft=SFTConfig(micro_batch_size=2, grad_accum_steps=2,
                                                                     max_steps=50, log_every=100),
                            optim=CONSTANT_LR, log=logged.append, stop=stop)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [r["step"] for r in logged] == [1, 3]  # the step it stopped at is logged between log lines
    # Step 3 is whole: both microbatches accumulated and applied, as in a run of 3 steps.
    state = tiny_policy.model.state_dict()
    assert all(torch.equal(state[k], three_steps[k]) for k in state)


def test_grpo_stops_after_the_update_in_progress_without_evaluating(tiny_policy, monkeypatch):
    # Two updates a step; the signal comes in the first update of step 2.
    calls = _signal_on_call(monkeypatch, grpo_module, "optimizer_step", 3, signal.SIGTERM)
    evaluated = []
    with stop_signals() as stop:
        history = grpo_train(tiny_policy, ArithmeticTask(difficulty=1).examples(8), template=TEMPLATE,
                             reward_fn=NO_REWARD,
                             grpo=GRPOConfig(n_grpo_steps=5, rollout_batch_size=4, group_size=2, train_batch_size=2,
                                             grad_accum_steps=1, eval_every=1),
                             optim=CONSTANT_LR, sampling=SamplingConfig(max_new_tokens=4, batch_size=4),
                             evaluate=lambda step: evaluated.append(step) or {"accuracy": 0.0}, stop=stop)
    assert len(calls) == 3  # no update after the one in progress
    assert [h["step"] for h in history] == [0, 1, 2] and evaluated == [0, 1]
    assert "eval_accuracy" in history[1] and "eval_accuracy" not in history[2] and "loss" in history[2]


def test_dpo_stops_after_the_step_in_progress_without_evaluating_or_saving(tiny_policy, monkeypatch):
    calls = _signal_on_call(monkeypatch, dpo_module, "optimizer_step", 2)
    saved, logged = [], []
    pairs = arithmetic_preference_pairs(4)
    with stop_signals() as stop:
        history = dpo_train(tiny_policy, pairs, dpo=DPOConfig(micro_batch_size=2, grad_accum_steps=1, max_steps=10,
                                                              eval_every=1, save_every=1, log_every=100),
                            optim=CONSTANT_LR, eval_pairs=pairs[:2], save=saved.append, log=logged.append, stop=stop)
    assert len(calls) == 2 and saved == [1]  # the caller saves the policy it stopped with
    assert [h["step"] for h in history] == [0, 1, 2] and history == logged
    assert "eval_loss" in history[1] and "eval_loss" not in history[2] and "loss" in history[2]


def test_expert_iteration_stops_after_the_step_in_progress_without_evaluating(tiny_policy, monkeypatch):
    # The signal comes while step 1 samples: its SFT takes one optimizer step (none here: nothing
    # earns a reward), then the loop ends without the evaluation of step 1 or the steps after it.
    _signal_on_call(monkeypatch, tiny_policy, "generate", 1)
    evaluated = []
    with stop_signals() as stop:
        history = expert_iteration(tiny_policy, ArithmeticTask(difficulty=1).examples(4), template=TEMPLATE,
                                   reward_fn=NO_REWARD,
                                   ei=ExpertIterationConfig(n_ei_steps=3, questions_per_step=2, group_size=2),
                                   sft=SFTConfig(micro_batch_size=2, grad_accum_steps=1), optim=CONSTANT_LR,
                                   sampling=SamplingConfig(temperature=1.0, max_new_tokens=4, batch_size=4),
                                   evaluate=lambda step: evaluated.append(step) or {"accuracy": 0.0}, stop=stop)
    assert [h["step"] for h in history] == [0, 1] and evaluated == [0]
    assert "eval_accuracy" not in history[1] and history[1]["kept"] == 0


def test_expert_iteration_stops_its_sft_after_the_step_in_progress(tiny_policy, monkeypatch):
    everything = lambda response, truth: {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}  # noqa: E731
    calls = _signal_on_call(monkeypatch, sft_module, "optimizer_step", 2)
    with stop_signals() as stop:
        history = expert_iteration(tiny_policy, ArithmeticTask(difficulty=1).examples(4), template=TEMPLATE,
                                   reward_fn=everything,
                                   ei=ExpertIterationConfig(n_ei_steps=3, questions_per_step=2, group_size=2),
                                   sft=SFTConfig(micro_batch_size=1, grad_accum_steps=1), optim=CONSTANT_LR,
                                   sampling=SamplingConfig(temperature=1.0, max_new_tokens=4, batch_size=4), stop=stop)
    assert len(calls) == 2 and [h["step"] for h in history] == [1] and history[0]["sft_steps"] == 2
