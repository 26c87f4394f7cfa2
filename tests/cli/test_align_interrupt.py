"""`scratchlm sft | grpo | dpo` in a real process stopped by Ctrl-C (SIGINT) or SIGTERM: the policy
trained so far is saved where the end of the run saves it, with the training state, a last metrics
record says where it stopped, the process exits 130 / 143 with one line naming the policy and the
command that resumes the run, and that command continues it. (The loops' side is tested in-process
in tests/align/test_interrupt.py; resuming exactly in tests/align/test_resume.py and
tests/cli/test_align_resume.py.)"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from scratchlm.align import dpo as dpo_module
from scratchlm.align import grpo as grpo_module
from scratchlm.align import sft as sft_module
from scratchlm.align.policy import load_policy
from scratchlm.cli import main
from tests.cli.processes import EXIT_TIMEOUT_S, scratchlm_process, wait_until

TINY = ["--data.limit=8", "--data.eval_limit=2", "--sampling.max_new_tokens=6", "--sampling.eval_max_new_tokens=6",
        "--sampling.batch_size=8", "--policy.device=cpu", "--run.progress=false"]
# command: (preset, metrics phase, key of an evaluation's results, options). Each run is far too
# long to finish: the signal always comes during training.
RUNS = {
    "sft": ("align-sft", "sft", "eval_accuracy",
            ["--data.dataset=arith:1", "--sft.max_steps=1000000", "--sft.micro_batch_size=2",
             "--sft.grad_accum_steps=1", *TINY]),
    # Rollouts of a random policy earn no reward (no gradient): the weight decay shows the updates.
    "grpo": ("align-grpo", "grpo", "eval_accuracy",
             ["--data.dataset=arith:1", "--grpo.n_grpo_steps=1000000", "--grpo.eval_every=0",
              "--grpo.rollout_batch_size=4", "--grpo.group_size=2", "--grpo.train_batch_size=2",
              "--grpo.grad_accum_steps=1", "--optim.lr=1e-2", "--optim.weight_decay=0.1", *TINY]),
    "dpo": ("dpo", "dpo", "eval_loss",
            ["--dpo.max_steps=1000000", "--dpo.eval_every=0", "--dpo.micro_batch_size=2", "--dpo.grad_accum_steps=1",
             "--data.limit=8", "--data.eval_limit=2", "--policy.device=cpu", "--run.progress=false"]),
}


def _metrics(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines() if line.endswith("}")]


def _wait_until_training(proc: subprocess.Popen, out: Path) -> None:
    """Return once metrics.jsonl holds the row of an optimizer step (the loop, and its handlers, run)."""
    metrics = out / "metrics.jsonl"
    wait_until(proc, lambda: metrics.is_file() and any(r["step"] >= 1 for r in _metrics(out)), "a training row")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_policy(path).model.state_dict()


@pytest.mark.parametrize("command, signum", [("sft", signal.SIGINT), ("grpo", signal.SIGTERM), ("dpo", signal.SIGINT)],
                         ids=["sft-SIGINT", "grpo-SIGTERM", "dpo-SIGINT"])
@pytest.mark.usefixtures("sigint_handled")  # (for the resumed run, stopped in this process)
def test_a_signalled_run_saves_its_policy_records_the_stop_and_exits_with_the_signal_code(tiny_policy, tmp_path,
                                                                                       monkeypatch, command, signum):
    base = tmp_path / "base"
    tiny_policy.save(base)
    out = tmp_path / command
    preset, phase, evaluated, options = RUNS[command]
    with scratchlm_process(tmp_path, [command, preset, f"--policy.path={base}", f"--run.out_dir={out}",
                                      *options]) as proc:
        _wait_until_training(proc, out)
        proc.send_signal(signum)
        returncode = proc.wait(timeout=EXIT_TIMEOUT_S)
    stderr = (tmp_path / "stderr.txt").read_text()
    name = signal.Signals(signum).name
    assert returncode == 128 + signum, stderr
    assert f"received {name}: stopping after this optimizer step, once the policy and its training state are saved" \
        in stderr
    args = [command, preset, f"--policy.path={base}", f"--run.out_dir={out}", *options]
    match = re.fullmatch(rf"scratchlm {command}: interrupted by {name} at step (\d+); policy saved to (.+) \(its "
                         rf"final evaluation skipped\) and its training state to (.+); resume with: (.+)",
                         stderr.strip().splitlines()[-1])
    assert match, stderr
    step, saved = int(match[1]), Path(match[2])
    assert saved == out / "policy" and Path(match[3]) == out / "resume"
    assert match[4] == shlex.join(["scratchlm", *args, "--resume"])

    # The step it stopped at is whole and logged, without the evaluation of the end; then the record of the stop.
    rows = _metrics(out)
    assert rows[-1] == {"phase": phase, "step": step, "interrupted": name}
    assert rows[-2]["step"] == step and "loss" in rows[-2]
    assert [r["step"] for r in rows if evaluated in r] == [0]
    assert not (out / f"eval_step_{step}.jsonl").exists()

    # The policy saved is the trained one.
    assert (saved / "checkpoints" / f"step_{step:06d}").is_dir()
    assert load_policy(saved).model_config == tiny_policy.model_config
    start, trained = _weights(base), _weights(saved)
    assert start.keys() == trained.keys() and not all(torch.equal(start[k], trained[k]) for k in start)

    # The command it names continues the run: stopped again (in this process) after one more optimizer step,
    # its metrics go on from the step it stopped at, the first stop's records set aside.
    module = {"sft": sft_module, "grpo": grpo_module, "dpo": dpo_module}[command]
    real = module.optimizer_step

    def one_more(*a, **kw):
        signal.raise_signal(signal.SIGINT)
        return real(*a, **kw)

    monkeypatch.setattr(module, "optimizer_step", one_more)
    assert main(shlex.split(match[4])[1:]) == 130
    rows = _metrics(out)
    again = rows[-1]["step"]  # (a GRPO step stopped between its two updates ends with its second: stopped again there)
    assert again == step + 1 or (command == "grpo" and again == step)
    assert [r["step"] for r in rows if "interrupted" in r] == [again] and rows[-2]["step"] == again
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == again
    assert {"phase": phase, "step": step, "interrupted": name} in _metrics(out, "metrics.dropped.jsonl")


def _stopped_at_call(module, call: int, args: list[str], patch) -> int:
    """`main(args)` with a SIGINT raised in the `call`-th `module.optimizer_step`; its exit code."""
    real, calls = module.optimizer_step, []

    def signalled(*a, **kw):
        calls.append(1)
        if len(calls) == call:
            signal.raise_signal(signal.SIGINT)
        return real(*a, **kw)

    patch.setattr(module, "optimizer_step", signalled)
    return main(args)


@pytest.mark.usefixtures("sigint_handled")  # (for the runs stopped in this process)
def test_a_run_killed_with_sigkill_resumes_from_its_last_periodic_save(tiny_policy, tmp_path, monkeypatch):
    # SIGKILL leaves no handler a chance: what --resume continues is the last pair of policy and
    # state saved every 3 steps (the kill may even land in a save). Resumed, then stopped two steps
    # on, the run has the weights and the metrics of one that ran to that step without being killed.
    base = tmp_path / "base"
    tiny_policy.save(base)
    preset, _, _, options = RUNS["sft"]
    args = ["sft", preset, f"--policy.path={base}", *options, "--sft.log_every=1", "--run.resume_every=3"]
    out = tmp_path / "killed"
    with scratchlm_process(tmp_path, [*args, f"--run.out_dir={out}"]) as proc:
        metrics = out / "metrics.jsonl"
        wait_until(proc, lambda: metrics.is_file() and any(r["step"] >= 7 for r in _metrics(out)), "step 7")
        proc.kill()
        assert proc.wait(timeout=EXIT_TIMEOUT_S) == -signal.SIGKILL
    saved = int((out / "policy" / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert saved % 3 == 0 and saved >= 3

    with pytest.MonkeyPatch.context() as patch:
        assert _stopped_at_call(sft_module, 2, [*args, f"--run.out_dir={out}", "--resume"], patch) == 130
    with pytest.MonkeyPatch.context() as patch:
        assert _stopped_at_call(sft_module, saved + 2, [*args, f"--run.out_dir={tmp_path / 'whole'}"], patch) == 130
    a, b = _weights(tmp_path / "whole" / "policy"), _weights(out / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    timings = ("eval_tokens_per_s",)
    rows = [{k: v for k, v in r.items() if k not in timings} for r in _metrics(out)]
    assert rows == [{k: v for k, v in r.items() if k not in timings} for r in _metrics(tmp_path / "whole")]
    assert rows[-1] == {"phase": "sft", "step": saved + 2, "interrupted": "SIGINT"}
