"""Resuming interrupted post-training loops: a loop stopped by a signal at step k, its state saved
and loaded back (`scratchlm.align.resume`) with its policy (saved and loaded as the commands do),
ends with exactly the weights, the history and the logged rows of a run that never stopped. Then
the resume state on disk: written whole, read back only for the run it belongs to.
(The commands end to end: tests/cli/test_align_resume.py.)"""

from __future__ import annotations

import io
import signal
from pathlib import Path

import pytest
import torch

from scratchlm.align import dpo as dpo_module
from scratchlm.align import expert_iteration as ei_module
from scratchlm.align import grpo as grpo_module
from scratchlm.align import sft as sft_module
from scratchlm.align.config import (
    DPOConfig,
    ExpertIterationConfig,
    GRPOConfig,
    OptimConfig,
    SamplingConfig,
    SFTConfig,
    SFTRunConfig,
)
from scratchlm.align.dpo import dpo_train, frozen_copy
from scratchlm.align.expert_iteration import expert_iteration
from scratchlm.align.grpo import grpo_train
from scratchlm.align.policy import load_policy
from scratchlm.align.preferences import arithmetic_preference_pairs
from scratchlm.align.prompts import get_template
from scratchlm.align.resume import ResumePoint, config_differences
from scratchlm.align.sft import sft_train
from scratchlm.align.task import ArithmeticTask
from scratchlm.errors import UserError
from scratchlm.train.interrupt import stop_signals

pytestmark = pytest.mark.usefixtures("sigint_handled")

TEMPLATE = get_template("r1_zero")
# A warm-up then a cosine: a resumed run must pick the schedule up at its step, not start it again.
SCHEDULE = OptimConfig(lr=1e-2, warmup_steps=2, min_lr_ratio=0.1, weight_decay=0.1)
TIMINGS = ("rollout_s", "score_s", "batch_s", "update_s", "eval_s", "elapsed_s", "rollout_tokens_per_s")
PARITY = lambda response, truth: {  # noqa: E731  (rewards that differ within a group: advantages not all 0)
    "format_reward": 1.0, "answer_reward": 0.0, "reward": float(len(response) % 2)}
EVERYTHING = lambda response, truth: {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}  # noqa: E731


def _at_call(module, name, number, action):
    """What makes the `number`-th call of `module.name` run `action()` first (a patch to arm)."""

    def arm(patch) -> None:
        real, calls = getattr(module, name), []

        def wrapped(*args, **kwargs):
            calls.append(1)
            if len(calls) == number:
                action()
            return real(*args, **kwargs)

        patch.setattr(module, name, wrapped)

    return arm


def _signal_at_call(module, name, number):
    """What arms a SIGINT in this process at the `number`-th call of `module.name`, before it runs."""
    return _at_call(module, name, number, lambda: signal.raise_signal(signal.SIGINT))


SIGNAL_IN_EVALUATION = {"step": None}  # the step whose evaluation `_evaluated` raises SIGINT in
EVALUATED: list[int] = []  # the steps `_evaluated` evaluated


def _signal_in_evaluation(step):
    return lambda patch: patch.setitem(SIGNAL_IN_EVALUATION, "step", step)


def _evaluated(results):
    """`results(step)` as an evaluation, which a signal can interrupt (`_signal_in_evaluation`)."""

    def evaluate(step):
        EVALUATED.append(step)
        if step == SIGNAL_IN_EVALUATION["step"]:
            signal.raise_signal(signal.SIGINT)
        return results(step)

    return evaluate


def _through_disk(state):
    """`state` as torch.save and torch.load (weights only) give it back, as a resumed run reads it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _weights(policy):
    return {k: v.clone() for k, v in policy.model.state_dict().items()}


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def _untimed(rows):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


class Runs:
    """One loop run three ways: uninterrupted, stopped by a signal (its state handed over), and
    resumed from that state on the policy saved and loaded back, with the global RNGs scrambled as
    a new process would have them."""

    def __init__(self, tiny_policy, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.base = tmp_path / "base"
        tiny_policy.save(self.base)

    def policy(self, path=None):
        return load_policy(path or self.base)

    def compare(self, train, arm, *, timed=False):
        """`train(policy, log, **controls)` (the loop's stop, on_stop and resume arguments)
        uninterrupted, then stopped by the signal that
        `arm(monkeypatch)` sets up and resumed; asserts the same weights, history and logged rows
        (`timed`: but wall times). Returns the state the stopped run handed over."""
        EVALUATED.clear()
        whole, whole_log = self.policy(), []
        expected = train(whole, whole_log.append)
        evaluated = EVALUATED[:]
        EVALUATED.clear()

        stopped, logged, kept = self.policy(), [], []
        with pytest.MonkeyPatch.context() as patch:
            arm(patch)
            with stop_signals() as stop:
                history = train(stopped, logged.append, stop=stop, on_stop=kept.append)
        assert len(kept) == 1 and stop.signum == signal.SIGINT
        step = history[-1]["step"]
        stopped.save(self.tmp_path / "stopped", step=step)
        state = _through_disk(kept[0])

        torch.manual_seed(12345)  # a resumed run starts in a new process
        resumed = self.policy(self.tmp_path / "stopped")
        logged = [r for r in logged if r["step"] < step]  # what the command keeps of metrics.jsonl
        with stop_signals() as stop:
            history = train(resumed, logged.append, stop=stop, resume=state)
        _assert_same_weights(_weights(resumed), _weights(whole))
        assert EVALUATED == evaluated  # the evaluations of both parts: each step's once
        if timed:
            assert _untimed(history) == _untimed(expected) and _untimed(logged) == _untimed(whole_log)
        else:
            assert history == expected and logged == whole_log
        return state


@pytest.fixture
def runs(tiny_policy, tmp_path):
    return Runs(tiny_policy, tmp_path)


def _sft_pairs(n=6):
    return [(TEMPLATE.format(e.question), TEMPLATE.response(e.reasoning, e.answer))
            for e in ArithmeticTask(difficulty=1).examples(n, seed=3)]


# Each loop's test run, as `train(policy, log, **controls)` with the loop-control arguments the
# harnesses pass (stop, on_stop, resume, resume_every, on_checkpoint).

def _sft(**config):
    """SFT of 6 pairs, 2 microbatches of 3 a step, 6 steps: the shuffles cross step boundaries."""
    sft = SFTConfig(micro_batch_size=3, grad_accum_steps=2, max_steps=6, log_every=4, **config)

    def train(policy, log, **controls):
        return sft_train(policy, _sft_pairs(), sft=sft, optim=SCHEDULE, seed=7, log=log,
                         evaluate=_evaluated(lambda step: {"accuracy": 0.5}), **controls)

    return train


def _grpo(steps):
    """GRPO, 4 updates a step (2 passes of 2 over each rollout batch, grpo_clip off-policy),
    evaluated (the policy's weights summed) at every step."""
    grpo = GRPOConfig(n_grpo_steps=steps, rollout_batch_size=4, group_size=2, train_batch_size=2, grad_accum_steps=1,
                      epochs_per_rollout_batch=2, loss_type="grpo_clip", eval_every=1)
    examples = ArithmeticTask(difficulty=1).examples(8)

    def train(policy, log, **controls):
        weights = _evaluated(lambda step: {"weights": sum(float(p.detach().sum()) for p in policy.model.parameters())})
        return grpo_train(policy, examples, template=TEMPLATE, reward_fn=PARITY, grpo=grpo, optim=SCHEDULE,
                          sampling=SamplingConfig(max_new_tokens=5, batch_size=4), evaluate=weights, seed=5, log=log,
                          **controls)

    return train


def _dpo(runs):
    """DPO on 10 pairs (2 held out), 5 steps, evaluated every 2."""
    pairs = arithmetic_preference_pairs(12)
    dpo = DPOConfig(micro_batch_size=2, grad_accum_steps=2, max_steps=5, eval_every=2, log_every=3)

    def train(policy, log, **controls):
        # The reference is the starting policy: copied at the start, loaded again to resume.
        reference = None if controls.get("resume") is None else frozen_copy(runs.policy().model)
        return dpo_train(policy, pairs[:10], dpo=dpo, optim=SCHEDULE, eval_pairs=pairs[10:], reference=reference,
                         seed=2, log=log, **controls)

    return train


def _expert_iteration():
    """3 EI steps of 2 questions x 2 responses, every response kept: each step's SFT takes an
    optimizer step per response."""
    ei = ExpertIterationConfig(n_ei_steps=3, questions_per_step=2, group_size=2)

    def train(policy, log, **controls):
        return expert_iteration(policy, ArithmeticTask(difficulty=1).examples(4), template=TEMPLATE,
                                reward_fn=EVERYTHING, ei=ei, sft=SFTConfig(micro_batch_size=1, grad_accum_steps=1),
                                optim=SCHEDULE, sampling=SamplingConfig(max_new_tokens=4, batch_size=4),
                                evaluate=_evaluated(lambda step: {"accuracy": 0.0}), seed=4, log=log, **controls)

    return train


# ---------------------------------------------------------------------------- the loops


@pytest.mark.parametrize("packed, call", [(False, 3), (False, 6), (True, 4)],
                         ids=["padded-step-2", "padded-last-step", "packed-step-2"])
def test_sft_resumed_ends_as_an_uninterrupted_run(runs, packed, call):
    state = runs.compare(_sft(packed=packed), _signal_at_call(sft_module, "sft_microbatch_train_step", 2 * call - 1))
    assert state["step"] == call


@pytest.mark.parametrize("arm, partial", [
    (_signal_at_call(grpo_module, "optimizer_step", 4), False),
    (_signal_in_evaluation(1), False),
    (_signal_at_call(grpo_module, "optimizer_step", 6), True),
    (_signal_at_call(grpo_module, "optimizer_step", 7), True),
], ids=["whole-step", "during-evaluation", "between-passes", "within-a-pass"])
def test_grpo_resumed_ends_as_an_uninterrupted_run(runs, arm, partial):
    # 4 updates a step: the signal comes in the last update of step 1 (its evaluation skipped,
    # done on resuming), in that evaluation (not done twice), or part-way through step 2, whose
    # rollouts, old log-probabilities and row order carry over.
    state = runs.compare(_grpo(3), arm, timed=True)
    assert ("partial" in state) == partial
    if partial:
        assert state["step"] == 2 and state["partial"]["old"] is not None
    else:
        assert state["step"] == 1 and state["evaluated"] == ("eval_weights" in state["history"][-1])


def test_dpo_resumed_ends_as_an_uninterrupted_run(runs):
    # The signal comes in step 2, an evaluation step: the stop skips its evaluation, the resumed run does it.
    state = runs.compare(_dpo(runs), _signal_at_call(dpo_module, "optimizer_step", 2))
    assert state["step"] == 2 and "eval_loss" not in state["history"][-1]


@pytest.mark.parametrize("arm, within", [(_signal_at_call(ei_module, "sft_train", 2), True),
                                         (_signal_in_evaluation(2), False)], ids=["in-its-sft", "in-its-evaluation"])
def test_expert_iteration_resumed_ends_as_an_uninterrupted_run(runs, arm, within):
    # The signal comes as the SFT of step 2 starts (it stops after its first optimizer step), or
    # in the evaluation of step 2.
    state = runs.compare(_expert_iteration(), arm, timed=True)
    assert state["step"] == 2 and (state["round"] is not None) == within and state["evaluated"] != within
    if within:  # stopped in the SFT of step 2: it goes on from its own state
        assert state["round"]["sft"]["step"] == 1 < state["round"]["rollout"]["kept"]


# ---------------------------------------------------------------------------- killed outright


class Killed(Exception):
    """A process killed outright (SIGKILL, the OOM killer): no handler runs, nothing is saved then."""


def _killed_at_call(module, name, number):
    """What makes the `number`-th call of `module.name` kill the run (raise `Killed`) before it runs."""

    def kill():
        raise Killed

    return _at_call(module, name, number, kill)


def _resumed_after_a_kill(runs, train, arm, every):
    """`train(policy, log, **controls)` (the loop's resume, resume_every and on_checkpoint
    arguments) uninterrupted, then with its states
    saved every `every` steps as the commands save them (`ResumePoint.saver`, policy and state in a
    run folder) and killed as `arm(monkeypatch)` sets up, then resumed in a "new process" from what
    the folder holds; asserts the same weights, history and logged rows (wall times aside) and
    that the resumed run evaluates what the uninterrupted one did after the saved step. Returns
    the state it resumed from."""
    EVALUATED.clear()
    whole, whole_log = runs.policy(), []
    expected = train(whole, whole_log.append)
    evaluated = EVALUATED[:]

    out = runs.tmp_path / "run"
    killed, logged = runs.policy(), []
    point = _point(out)
    with pytest.MonkeyPatch.context() as patch:
        arm(patch)
        with pytest.raises(Killed):
            train(killed, logged.append, resume_every=every, on_checkpoint=point.saver(killed, out / "policy"))

    torch.manual_seed(12345)  # a resumed run starts in a new process
    resumed = runs.policy(out / "policy")
    saved = _point(out).read().check_policy(resumed, out / "policy")
    logged = [r for r in logged if r["step"] < saved.step]  # what the command keeps of metrics.jsonl
    EVALUATED.clear()
    history = train(resumed, logged.append, resume=saved.loop, resume_every=every)
    _assert_same_weights(_weights(resumed), _weights(whole))
    assert EVALUATED == [s for s in evaluated if s > saved.step]
    assert _untimed(history) == _untimed(expected) and _untimed(logged) == _untimed(whole_log)
    return saved


@pytest.mark.parametrize("every, killed_in, saved", [(2, 5, 4), (5, 6, 5)],
                         ids=["row-not-logged", "row-logged"])
def test_sft_killed_resumes_from_its_last_periodic_state(runs, every, killed_in, saved):
    kill = _killed_at_call(sft_module, "sft_microbatch_train_step", 2 * killed_in - 1)  # as step `killed_in` starts
    state = _resumed_after_a_kill(runs, _sft(), kill, every)
    assert state.step == saved and len(state.loop["history"]) == saved


def test_grpo_killed_resumes_from_its_last_periodic_state(runs):
    # 4 updates a step, evaluated at every step; saved after step 2 (its evaluation in the state),
    # killed in the 2nd update of step 4: the rows and evaluation of step 3 are done again.
    state = _resumed_after_a_kill(runs, _grpo(4), _killed_at_call(grpo_module, "optimizer_step", 14), every=2)
    assert state.step == 2 and state.loop["evaluated"] and "partial" not in state.loop


def test_dpo_killed_resumes_from_its_last_periodic_state(runs):
    # Saved after step 4, an evaluation step whose evaluation the state holds (not done again).
    evaluations = []
    with pytest.MonkeyPatch.context() as patch:
        real = dpo_module.evaluate_preferences
        patch.setattr(dpo_module, "evaluate_preferences", lambda *a, **k: evaluations.append(1) or real(*a, **k))
        state = _resumed_after_a_kill(runs, _dpo(runs), _killed_at_call(dpo_module, "optimizer_step", 5), every=2)
    assert state.step == 4 and "eval_loss" in state.loop["history"][-1]
    assert len(evaluations) == 4 + 3 + 1  # uninterrupted: steps 0, 2, 4, 5; killed: 0, 2, 4; resumed: 5


def test_expert_iteration_killed_resumes_from_its_last_periodic_state(runs):
    state = _resumed_after_a_kill(runs, _expert_iteration(), _killed_at_call(ei_module, "sft_train", 3), every=1)
    assert state.step == 2 and state.loop["round"] is None and state.loop["evaluated"]


def test_loops_save_their_state_only_every_n_steps(tiny_policy):
    saved = []
    sft_train(tiny_policy, _sft_pairs(), sft=SFTConfig(micro_batch_size=3, grad_accum_steps=1, max_steps=7),
              optim=SCHEDULE, resume_every=3, on_checkpoint=saved.append)
    assert [s["step"] for s in saved] == [3, 6]  # (not the last: the end of the run saves the policy)


def test_resume_every_is_a_count_of_steps():
    from scratchlm.align.config import RunConfig

    assert RunConfig().resume_every == 0  # (the presets set one: configs/align-*.toml, dpo.toml)
    with pytest.raises(ValueError, match=r"run\.resume_every must be >= 0, got -1"):
        RunConfig(resume_every=-1)


def test_dpo_policy_saves_carry_their_state_when_periodic_states_are_on(tiny_policy):
    # A policy saved alone between two states would leave the last state without its policy.
    saves, states = [], []
    dpo = DPOConfig(micro_batch_size=2, grad_accum_steps=1, max_steps=7, eval_every=0, save_every=3)
    dpo_train(tiny_policy, arithmetic_preference_pairs(8), dpo=dpo, optim=SCHEDULE, save=saves.append,
              resume_every=2, on_checkpoint=lambda state: states.append(state["step"]))
    assert saves == [] and states == [2, 3, 4, 6]
    dpo_train(tiny_policy, arithmetic_preference_pairs(8), dpo=dpo, optim=SCHEDULE, save=saves.append,
              on_checkpoint=lambda state: states.append(state["step"]))
    assert saves == [3, 6]  # (periodic states off: the policy alone)


# ---------------------------------------------------------------------------- the state on disk


class FakePolicy:
    def __init__(self, value: float) -> None:
        self.model = torch.nn.Linear(2, 2)
        torch.nn.init.constant_(self.model.weight, value)
        torch.nn.init.zeros_(self.model.bias)


def _point(out: Path, command="sft", config=None, data=("pair",)) -> ResumePoint:
    return ResumePoint(out, command=command, config=config or SFTRunConfig(), data=list(data),
                       argv=["align-sft", "--policy.path=base dir"])


def _write(out: Path, step=3, value=1.0, **kwargs) -> ResumePoint:
    point = _point(out, **kwargs)
    point.keep({"step": step, "optimizer": {"state": {}, "param_groups": []}, "history": [{"step": step}]})
    point.write(step, FakePolicy(value))
    return point


def test_a_written_state_reads_back_with_the_command_that_resumes_it(tmp_path):
    point = _write(tmp_path, step=4)
    assert sorted(p.name for p in (tmp_path / "resume").iterdir()) == ["checksums.json", "loop.pt", "state.pt"]
    assert point.command_line == "scratchlm sft align-sft '--policy.path=base dir' --resume"
    saved = _point(tmp_path).read()
    assert saved.step == 4 and saved.loop["history"] == [{"step": 4}]
    saved.check_policy(FakePolicy(1.0), tmp_path / "policy")
    with pytest.raises(UserError, match=r"is not the policy saved with the training state in .* \(step 4\)"):
        saved.check_policy(FakePolicy(2.0), tmp_path / "policy")


def test_a_state_cut_short_while_written_leaves_the_previous_one(tmp_path, monkeypatch):
    from scratchlm.train import checkpoint

    _write(tmp_path, step=3)
    real = checkpoint.write_torch

    def full_disk(obj, path):
        real(obj, path)
        if path.name == "state.pt":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_torch", full_disk)
    with pytest.raises(OSError):
        _write(tmp_path, step=5)
    assert _point(tmp_path).read().step == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resume"]  # no staging folder left


def _loop_state(step):
    return {"step": step, "optimizer": {"state": {}, "param_groups": []}, "history": [{"step": step}]}


SAVE_WRITES = {"fileio": 5, "torch": 3}  # files a save writes through fileio.open, and through write_torch


@pytest.mark.parametrize("writer, cut", [(w, k) for w, n in SAVE_WRITES.items() for k in range(n + 1)])
def test_a_save_cut_short_leaves_the_policy_beside_its_state(tiny_policy, tmp_path, cut_writes, monkeypatch,
                                                            writer, cut):
    # A save of the policy and its state (`ResumePoint.save`, as a periodic save or a signal does)
    # cut at each of its writes, as a kill or a full disk would: the policy on disk is the one of
    # the state --resume picks, the new pair when the save completed, else the one before.
    from scratchlm.train import checkpoint

    out = tmp_path / "policy"
    _point(tmp_path).save(2, tiny_policy, out, _loop_state(2))
    before = _weights(tiny_policy)
    with torch.no_grad():
        for p in tiny_policy.model.parameters():
            p.add_(0.5)
    after = _weights(tiny_policy)
    if writer == "fileio":
        cut_writes(after=cut)
    else:
        real, calls = checkpoint.write_torch, []

        def full_disk(obj, path):
            calls.append(path)
            if len(calls) > cut:
                raise OSError(28, "No space left on device")
            real(obj, path)

        monkeypatch.setattr(checkpoint, "write_torch", full_disk)
    try:
        _point(tmp_path).save(4, tiny_policy, out, _loop_state(4))
        completed = True
    except OSError:
        completed = False
    monkeypatch.undo()
    assert completed == (cut == SAVE_WRITES[writer])  # (every write but the last is cut once)

    policy = load_policy(out)
    point = _point(tmp_path)
    state = point.read().check_policy(policy, out)
    assert state.step == (4 if completed else 2) and state.loop == _loop_state(state.step)
    _assert_same_weights(_weights(policy), after if completed else before)
    point.settle(state)  # (as a resumed run does) the next save keeps it until the one after is whole
    point.save(6, policy, out, _loop_state(6))
    assert _point(tmp_path).read().step == 6 and not (tmp_path / "resume.previous").exists()


def test_resume_picks_the_state_before_when_the_policy_of_the_new_one_was_not_saved(tiny_policy, tmp_path,
                                                                                     monkeypatch):
    out = tmp_path / "policy"
    _point(tmp_path).save(2, tiny_policy, out, _loop_state(2))
    saved = load_policy(out)
    with torch.no_grad():
        for p in tiny_policy.model.parameters():
            p.add_(0.5)
    monkeypatch.setattr(type(tiny_policy), "save", lambda *a, **k: (_ for _ in ()).throw(Killed))
    with pytest.raises(Killed):  # killed once the new state is written, as the policy is
        _point(tmp_path).save(4, tiny_policy, out, _loop_state(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy", "resume", "resume.previous"]
    newest = _point(tmp_path).read()
    assert newest.step == 4 and newest.before.step == 2
    assert newest.check_policy(saved, out).step == 2
    with torch.no_grad():
        for p in tiny_policy.model.parameters():
            p.add_(0.5)
    with pytest.raises(UserError, match=r"is not the policy saved with the training state in .*resume \(step 4\)"):
        newest.check_policy(tiny_policy, out)
    _point(tmp_path).discard()  # a finished run leaves neither
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


@pytest.mark.parametrize("change, message", [
    (lambda p: p.joinpath("resume").rename(p / "elsewhere"), r"holds no training state to resume"),
    (lambda p: p.joinpath("resume", "loop.pt").write_bytes(b"cut"), r"loop.pt is damaged"),
    (lambda p: p.joinpath("resume", "state.pt").write_bytes(b"cut"), r"state.pt is damaged"),
])
def test_a_missing_or_damaged_state_is_refused(tmp_path, change, message):
    _write(tmp_path)
    change(tmp_path)
    with pytest.raises(UserError, match=message):
        _point(tmp_path).read()


def test_a_state_of_another_command_or_run_is_refused_naming_what_differs(tmp_path):
    from scratchlm.align.config import GRPORunConfig

    _write(tmp_path, config=SFTRunConfig())
    with pytest.raises(UserError, match=r"is the training state of `scratchlm sft`, not `scratchlm grpo`"):
        _point(tmp_path, command="grpo", config=GRPORunConfig()).read()
    other = SFTRunConfig()
    other.sft.max_steps, other.optim.lr = 7, 0.5
    with pytest.raises(UserError, match=r"other settings \(optim\.lr=1e-05 then, 0\.5 now; sft\.max_steps=0 then, "
                                        r"7 now\)"):
        _point(tmp_path, config=other).read()
    with pytest.raises(UserError, match=r"the training data are not those the run .* trained on"):
        _point(tmp_path, data=("another pair",)).read()
    shown = SFTRunConfig()
    shown.sft.log_every, shown.run.progress, shown.policy.device = 1, False, "cpu"  # how it runs and what it shows
    assert _point(tmp_path, config=shown).read().step == 3


def test_config_differences_leave_out_what_may_change():
    saved = {"run": {"progress": True, "seed": 0}, "grpo": {"eval_every": 10, "n_grpo_steps": 5}}
    now = {"run": {"progress": False, "seed": 1}, "grpo": {"eval_every": 2, "n_grpo_steps": 5, "new": 1}}
    assert config_differences(saved, now) == [("grpo.new", None, 1), ("run.seed", 0, 1)]


def test_discard_removes_the_state(tmp_path):
    point = _write(tmp_path)
    point.discard()
    assert not (tmp_path / "resume").exists()
    point.discard()  # (nothing to remove)
