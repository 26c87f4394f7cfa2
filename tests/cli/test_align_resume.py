"""`scratchlm sft | grpo | dpo | expert-iteration ... --resume`: a run stopped by a signal (raised
in this process from inside its loop) and resumed with the same command ends with the policy and
the metrics of a run that never stopped; what cannot be resumed is refused in one line, leaving
the run as it was. (The loops alone: tests/align/test_resume.py; real signals to a real process:
tests/cli/test_align_interrupt.py.)"""

from __future__ import annotations

import json
import re
import shlex
import signal

import pytest
import torch

from scratchlm.align import dpo as dpo_module
from scratchlm.align import expert_iteration as ei_module
from scratchlm.align import grpo as grpo_module
from scratchlm.align import sft as sft_module
from scratchlm.align.policy import load_policy
from scratchlm.cli import main

pytestmark = pytest.mark.usefixtures("sigint_handled")

TINY = ["--data.limit=8", "--data.eval_limit=2", "--sampling.max_new_tokens=6", "--sampling.eval_max_new_tokens=6",
        "--sampling.batch_size=8", "--policy.device=cpu", "--run.progress=false"]
# command: (preset, options, where the signal comes: module, function, call). Each stops part-way.
RUNS = {
    "sft": ("align-sft", ["--data.dataset=arith:1", "--sft.max_steps=5", "--sft.micro_batch_size=2",
                          "--sft.grad_accum_steps=1", "--sft.log_every=2", "--optim.warmup_steps=2", *TINY],
            (sft_module, "optimizer_step", 3)),
    # 4 updates a step; the signal comes in the 2nd of step 2, whose evaluation is due.
    "grpo": ("align-grpo", ["--data.dataset=arith:1", "--grpo.n_grpo_steps=3", "--grpo.eval_every=2",
                            "--grpo.rollout_batch_size=4", "--grpo.group_size=2", "--grpo.train_batch_size=2",
                            "--grpo.grad_accum_steps=1", "--grpo.epochs_per_rollout_batch=2",
                            "--grpo.loss_type=grpo_clip", "--optim.lr=1e-2", "--optim.weight_decay=0.1", *TINY],
             (grpo_module, "optimizer_step", 6)),
    "dpo": ("dpo", ["--dpo.max_steps=4", "--dpo.eval_every=2", "--dpo.micro_batch_size=2", "--dpo.grad_accum_steps=1",
                    "--optim.warmup_steps=1", "--data.limit=8", "--data.eval_limit=2", "--policy.device=cpu",
                    "--run.progress=false"],
            (dpo_module, "optimizer_step", 2)),
    # Nothing a random policy samples earns a reward: the signal comes in step 2, its evaluation left for the resume.
    "expert-iteration": ("align-ei", ["--data.dataset=arith:1", "--ei.n_ei_steps=3", "--ei.questions_per_step=2",
                                      "--ei.group_size=2", "--sft.micro_batch_size=1", "--sft.grad_accum_steps=1",
                                      "--optim.warmup_steps=0", *TINY],
                         (ei_module, "sft_train", 2)),
}
WALL_TIME = ("rollout_s", "score_s", "batch_s", "update_s", "eval_s", "elapsed_s", "rollout_tokens_per_s",
             "eval_tokens_per_s")


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(rows):
    return [{k: v for k, v in r.items() if k not in WALL_TIME} for r in rows]


def _assert_same_run(whole, stopped):
    """The same policy weights and the same metrics rows (wall times aside) in two run folders."""
    a = load_policy(whole / "policy").model.state_dict()
    b = load_policy(stopped / "policy").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _untimed(_metrics(stopped / "metrics.jsonl")) == _untimed(_metrics(whole / "metrics.jsonl"))


def _signal_at(patch, module, name, call) -> None:
    real, calls = getattr(module, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    patch.setattr(module, name, wrapped)


def _stopped(args, where, capsys) -> str:
    """Run `args` with a SIGINT at `where`; returns the last line on stderr."""
    with pytest.MonkeyPatch.context() as patch:
        _signal_at(patch, *where)
        assert main(args) == 130
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def base(tiny_policy, tmp_path):
    tiny_policy.save(tmp_path / "base")
    return tmp_path / "base"


@pytest.mark.parametrize("command", list(RUNS))
def test_a_resumed_run_ends_as_if_it_had_not_stopped(base, tmp_path, capsys, command):
    preset, options, where = RUNS[command]
    args = [command, preset, f"--policy.path={base}", *options]
    assert main([*args, f"--run.out_dir={tmp_path / 'whole'}"]) == 0
    out = tmp_path / "stopped"
    line = _stopped([*args, f"--run.out_dir={out}"], where, capsys)
    resume = shlex.join(["scratchlm", *args, f"--run.out_dir={out}", "--resume"])
    assert line.endswith(f"policy saved to {out / 'policy'} (its final evaluation skipped) and its training state to "
                         f"{out / 'resume'}; resume with: {resume}"), line
    stopped_rows = _metrics(out / "metrics.jsonl")
    assert "interrupted" in stopped_rows[-1] and (out / "resume" / "state.pt").is_file()

    assert main(shlex.split(resume)[1:]) == 0
    whole, resumed = load_policy(tmp_path / "whole" / "policy"), load_policy(out / "policy")
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _untimed(_metrics(out / "metrics.jsonl")) == _untimed(_metrics(tmp_path / "whole" / "metrics.jsonl"))
    # The rows from the step it stopped at on (logged again by the resumed run) are set aside, not lost.
    step = stopped_rows[-1]["step"]
    assert _metrics(out / "metrics.dropped.jsonl") == [r for r in stopped_rows if r["step"] >= step]
    assert not (out / "resume").exists()  # the run finished: nothing left to resume
    evaluations = sorted(p.name for p in out.glob("eval_step_*.jsonl"))
    assert evaluations == sorted(p.name for p in (tmp_path / "whole").glob("eval_step_*.jsonl"))


def test_a_run_stopped_twice_resumes_twice(base, tmp_path, capsys):
    preset, options, _ = RUNS["sft"]
    args = ["sft", preset, f"--policy.path={base}", *options]
    assert main([*args, f"--run.out_dir={tmp_path / 'whole'}"]) == 0
    stopped = [*args, f"--run.out_dir={tmp_path / 'stopped'}"]
    assert "at step 2;" in _stopped(stopped, (sft_module, "optimizer_step", 2), capsys)
    assert "at step 4;" in _stopped([*stopped, "--resume"], (sft_module, "optimizer_step", 2), capsys)
    assert main([*stopped, "--resume"]) == 0
    _assert_same_run(tmp_path / "whole", tmp_path / "stopped")


class Killed(BaseException):
    """A process killed outright (SIGKILL, the OOM killer): nothing after it runs, nothing is saved then."""


# command: (--run.resume_every, where the run is killed: module, function, call, the step it resumes from)
KILLS = {
    "sft": (3, (sft_module, "optimizer_step", 5), 3),  # the row of step 3 logged, set aside, logged again
    "grpo": (1, (grpo_module, "optimizer_step", 10), 2),  # in step 3, after step 2's evaluation was saved
    "dpo": (2, (dpo_module, "optimizer_step", 4), 2),
    "expert-iteration": (1, (ei_module, "sft_train", 3), 2),
}


@pytest.mark.parametrize("command", list(KILLS))
def test_a_run_killed_outright_resumes_from_its_last_periodic_save(base, tmp_path, command):
    preset, options, _ = RUNS[command]
    every, (module, name, call), saved = KILLS[command]
    args = [command, preset, f"--policy.path={base}", *options, f"--run.resume_every={every}"]
    assert main([*args, f"--run.out_dir={tmp_path / 'whole'}"]) == 0
    out = tmp_path / "killed"
    with pytest.MonkeyPatch.context() as patch:
        real, calls = getattr(module, name), []

        def killed(*a, **kw):
            calls.append(1)
            if len(calls) == call:
                raise Killed
            return real(*a, **kw)

        patch.setattr(module, name, killed)
        with pytest.raises(Killed):
            main([*args, f"--run.out_dir={out}"])
    killed_rows = _metrics(out / "metrics.jsonl")
    assert not any("interrupted" in r for r in killed_rows) and (out / "resume" / "state.pt").is_file()
    assert [p.name for p in (out / "policy" / "checkpoints").glob("step_*")] == [f"step_{saved:06d}"]

    assert main([*args, f"--run.out_dir={out}", "--resume"]) == 0
    whole, resumed = load_policy(tmp_path / "whole" / "policy"), load_policy(out / "policy")
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _untimed(_metrics(out / "metrics.jsonl")) == _untimed(_metrics(tmp_path / "whole" / "metrics.jsonl"))
    # The rows from the saved step on (logged again by the resumed run) are set aside, not lost.
    assert _metrics(out / "metrics.dropped.jsonl") == [r for r in killed_rows if r["step"] >= saved]
    assert not (out / "resume").exists() and not (out / "resume.previous").exists()
    evaluations = sorted(p.name for p in out.glob("eval_step_*.jsonl"))
    assert evaluations == sorted(p.name for p in (tmp_path / "whole").glob("eval_step_*.jsonl"))


def test_a_periodic_save_then_a_signal_resumes_from_the_signal(base, tmp_path, capsys):
    preset, options, where = RUNS["sft"]
    args = ["sft", preset, f"--policy.path={base}", *options, "--run.resume_every=2"]
    assert main([*args, f"--run.out_dir={tmp_path / 'whole'}"]) == 0
    stopped = [*args, f"--run.out_dir={tmp_path / 'stopped'}"]
    assert "at step 3;" in _stopped(stopped, where, capsys)  # after the periodic save of step 2
    assert main([*stopped, "--resume"]) == 0
    _assert_same_run(tmp_path / "whole", tmp_path / "stopped")


# ---------------------------------------------------------------------------- what is refused


@pytest.fixture
def stopped_sft(base, tmp_path, capsys):
    """The arguments of an sft run stopped at step 3, its run.out_dir last."""
    preset, options, where = RUNS["sft"]
    args = ["sft", preset, f"--policy.path={base}", *options, f"--run.out_dir={tmp_path / 'run'}"]
    _stopped(args, where, capsys)
    return args


def _refused(args, capsys) -> str:
    assert main(args) == 2
    return capsys.readouterr().err.strip()


def test_resume_without_a_state_is_refused(base, tmp_path, capsys):
    preset, options, _ = RUNS["sft"]
    message = _refused(["sft", preset, f"--policy.path={base}", *options, f"--run.out_dir={tmp_path / 'new'}",
                        "--resume"], capsys)
    assert message == (f"scratchlm sft: error: --resume: {tmp_path / 'new'} holds no training state to resume "
                       f"({tmp_path / 'new' / 'resume' / 'state.pt'} is missing): the run finished, was never "
                       "interrupted, or a second signal stopped it before saving; pass --overwrite instead of "
                       "--resume to start it afresh")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("change, message", [
    # the schedule's length: its position would mean another learning rate
    (["--sft.max_steps=6"], r"trained with other settings \(sft\.max_steps=5 then, 6 now\)"),
    (["--run.seed=1", "--optim.lr=1e-3"], r"\(optim\.lr=2e-05 then, 0\.001 now; run\.seed=0 then, 1 now\)"),
    (["--data.limit=7"], r"\(data\.limit=8 then, 7 now\)"),
])
def test_resume_with_other_settings_is_refused_naming_them(stopped_sft, tmp_path, capsys, change, message):
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    refusal = _refused([*stopped_sft, *change, "--resume"], capsys)
    assert len(refusal.splitlines()) == 1 and re.search(message, refusal), refusal
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # nothing written
    assert main([*stopped_sft, "--resume"]) == 0  # the state is still there


def test_resume_may_change_how_the_run_shows_and_logs(stopped_sft, tmp_path):
    assert main([*stopped_sft, "--sft.log_every=1", "--run.progress=true", "--data.eval_limit=1", "--resume"]) == 0
    assert [r["step"] for r in _metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r] == [1, 3, 4, 5]


def test_resume_of_another_commands_run_is_refused(stopped_sft, base, tmp_path, capsys):
    preset, options, _ = RUNS["grpo"]
    message = _refused(["grpo", preset, f"--policy.path={base}", *options, f"--run.out_dir={tmp_path / 'run'}",
                        "--resume"], capsys)
    assert "is the training state of `scratchlm sft`, not `scratchlm grpo`" in message


def test_resume_of_a_policy_saved_since_is_refused(stopped_sft, base, tmp_path, capsys):
    load_policy(base).save(tmp_path / "run" / "policy", step=9)
    message = _refused([*stopped_sft, "--resume"], capsys)
    assert f"{tmp_path / 'run' / 'policy'} is not the policy saved with the training state" in message


def test_resume_of_a_dpo_run_whose_starting_policy_changed_is_refused(base, tmp_path, capsys):
    from scratchlm.align.policy import ScratchPolicy
    from scratchlm.model.transformer import build_model

    preset, options, where = RUNS["dpo"]
    args = ["dpo", preset, f"--policy.path={base}", *options, f"--run.out_dir={tmp_path / 'run'}"]
    _stopped(args, where, capsys)
    old = load_policy(base)
    torch.manual_seed(1)
    ScratchPolicy(build_model(old.model_config), old.tokenizer, old.model_config).save(base)
    message = _refused([*args, "--resume"], capsys)
    assert f"policy.path {base} is no longer the model the run started from (its DPO reference)" in message


def test_a_run_again_without_resume_or_overwrite_is_refused(stopped_sft, tmp_path, capsys):
    # It started afresh: the stopped run's metrics were emptied at once and its state discarded.
    out = tmp_path / "run"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    message = _refused(stopped_sft, capsys)
    assert message == (f"scratchlm sft: error: run.out_dir {out} already holds a run (policy, resume, metrics.jsonl); "
                       "pass --resume to continue it or --overwrite to replace it, or choose another run.out_dir")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    with pytest.raises(SystemExit):
        main([*stopped_sft, "--resume", "--overwrite"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_run_again_with_overwrite_starts_afresh(stopped_sft, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="scratchlm.align"):
        assert main([*stopped_sft, "--overwrite"]) == 0
    (warning,) = [r.getMessage() for r in caplog.records if "training state" in r.getMessage()]
    assert f"{tmp_path / 'run' / 'resume'} held the training state of an interrupted run" in warning
    rows = _metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 3, 5, 5] and not any("interrupted" in r for r in rows)
    assert not (tmp_path / "run" / "resume").exists()
