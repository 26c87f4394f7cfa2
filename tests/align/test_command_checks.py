"""What the grpo and expert-iteration commands refuse before they write into run.out_dir."""

from __future__ import annotations

import json

import pytest

from scratchlm.cli import main

COMMON = ["--data.limit=8", "--data.eval_limit=2", "--sampling.max_new_tokens=6", "--sampling.eval_max_new_tokens=6",
          "--sampling.batch_size=8", "--policy.device=cpu", "--run.progress=false"]
OPTIONS = {
    "grpo": ["align-grpo", "--grpo.n_grpo_steps=1", "--grpo.rollout_batch_size=4", "--grpo.group_size=2",
             "--grpo.train_batch_size=4", "--grpo.grad_accum_steps=2"],
    "expert-iteration": ["align-ei", "--ei.n_ei_steps=1", "--ei.questions_per_step=2", "--ei.group_size=2"],
}


def _earlier_run(out):
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"phase": "grpo", "step": 7}\n')
    (out / "config.toml").write_text("# an earlier run\n")
    return {p.name: p.read_bytes() for p in out.iterdir()}


@pytest.mark.parametrize("command", ["grpo", "expert-iteration"])
@pytest.mark.parametrize("split", ["training", "evaluation"])
def test_prompts_too_long_for_the_context_are_refused_before_anything_is_written(tiny_policy, tmp_path, capsys,
                                                                                 command, split):
    # The first rollout (or the step-0 evaluation) failed on the long prompt after metrics.jsonl
    # had been emptied and config.toml rewritten.
    tiny_policy.save(tmp_path / "base")
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(3)]
    rows.append({"question": "What is " + " + ".join(["1"] * 150) + "?", "answer": "#### 150"})
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flag = "--data.dataset" if split == "training" else "--data.eval_dataset"
    out = tmp_path / "run"
    before = _earlier_run(out)
    preset, *options = OPTIONS[command]
    code = main([command, preset, f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                 "--data.dataset=arith:1", *COMMON, "--data.eval_limit=4", f"{flag}={data}", *options])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert f"1 of 4 {split} prompts ({data}/" in err
    assert "context of 160 tokens (the longest has" in err and "filter the data to shorter questions" in err
    longest = int(err.split("the longest has ")[1].split(")")[0])
    assert longest > 160
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_expert_iteration_refuses_more_questions_a_step_than_the_training_set_has(tmp_path, capsys, monkeypatch):
    # ei.questions_per_step was quietly cut to the training set's size; then it was refused only
    # once the policy had loaded.
    def no_loading(*args, **kwargs):
        raise AssertionError("the policy was loaded")

    monkeypatch.setattr("scratchlm.align.policy.load_policy", no_loading)
    out = tmp_path / "run"
    before = _earlier_run(out)
    code = main(["expert-iteration", "align-ei", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                 "--data.dataset=arith:1", *COMMON, "--data.limit=3", "--ei.questions_per_step=4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "expert iteration draws 4 questions a step (ei.questions_per_step) but the training set has 3" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
