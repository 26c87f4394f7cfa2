"""The sft / expert-iteration / grpo commands on a tiny run directory, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scratchlm.align.config import DPORunConfig, ExpertIterationRunConfig, GRPORunConfig, SFTRunConfig
from scratchlm.align.policy import load_policy
from scratchlm.cli import main
from scratchlm.config import ConfigError, load_config

COMMON = ["--data.dataset=arith:1", "--data.limit=8", "--data.eval_limit=2", "--sampling.max_new_tokens=6",
          "--sampling.eval_max_new_tokens=6", "--sampling.batch_size=8", "--policy.device=cpu", "--run.progress=false"]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_presets_load_with_overrides():
    cfg = load_config(GRPORunConfig, "align-grpo", ["--grpo.loss_type=grpo_clip", "--optim.lr=3e-6"])
    assert cfg.grpo.loss_type == "grpo_clip" and cfg.optim.lr == 3e-6
    assert load_config(SFTRunConfig, "align-sft").data.template == "r1_zero"
    with pytest.raises(ConfigError):
        load_config(GRPORunConfig, "align-grpo", ["--grpo.loss_type=ppo"])
    with pytest.raises(ConfigError):
        load_config(GRPORunConfig, "align-grpo", ["--grpo.nope=1"])


@pytest.mark.parametrize("cls, preset, override, message", [
    (SFTRunConfig, "align-sft", "--data.limit=-1", "data.limit must be >= 0"),  # quietly dropped the last row
    (SFTRunConfig, "align-sft", "--data.eval_limit=-1", "data.eval_limit must be >= 0"),
    (SFTRunConfig, "align-sft", "--sft.micro_batch_size=0", "sft.micro_batch_size must be >= 1"),
    (SFTRunConfig, "align-sft", "--sft.grad_accum_steps=0", "sft.grad_accum_steps must be >= 1"),  # loss 0.0
    (SFTRunConfig, "align-sft", "--sft.num_epochs=-1", "sft.num_epochs must be positive"),
    (SFTRunConfig, "align-sft", "--sft.max_steps=-1", "sft.max_steps must be >= 0"),
    (SFTRunConfig, "align-sft", "--sft.log_every=0", "sft.log_every must be >= 1"),
    (SFTRunConfig, "align-sft", "--sampling.batch_size=0", "sampling.batch_size must be >= 1"),
    (SFTRunConfig, "align-sft", "--sampling.eval_max_new_tokens=-1", "sampling.eval_max_new_tokens must be >= 0"),
    (SFTRunConfig, "align-sft", "--sampling.top_p=1.5", "sampling.top_p must be in"),
    (SFTRunConfig, "align-sft", "--optim.lr=-1", "optim.lr must be >= 0"),
    (SFTRunConfig, "align-sft", "--optim.warmup_steps=-1", "optim.warmup_steps must be >= 0"),
    (SFTRunConfig, "align-sft", "--optim.max_grad_norm=-1", "optim.max_grad_norm must be >= 0"),
    (SFTRunConfig, "align-sft", "--optim.min_lr_ratio=2", "optim.min_lr_ratio must be in"),
    (GRPORunConfig, "align-grpo", "--grpo.group_size=0", "grpo.group_size must be >= 1"),  # ZeroDivisionError
    (GRPORunConfig, "align-grpo", "--grpo.grad_accum_steps=0", "grpo.grad_accum_steps must be >= 1"),
    # an infinite rate or decay trained to NaN weights; infinite epochs were an OverflowError after the first eval
    (SFTRunConfig, "align-sft", "--optim.lr=inf", "optim.lr must be a finite number"),
    (SFTRunConfig, "align-sft", "--optim.weight_decay=inf", "optim.weight_decay must be a finite number"),
    (SFTRunConfig, "align-sft", "--sft.num_epochs=inf", "sft.num_epochs must be a finite number"),
    (SFTRunConfig, "align-sft", "--sft.normalize_constant=inf", "sft.normalize_constant must be a finite number"),
    (SFTRunConfig, "align-sft", "--sampling.temperature=inf", "sampling.temperature must be a finite number"),
    (ExpertIterationRunConfig, "align-ei", "--ei.sft_epochs=inf", "ei.sft_epochs must be a finite number"),
    (DPORunConfig, "dpo", "--dpo.beta=inf", "dpo.beta must be a finite number"),  # NaN loss
    (DPORunConfig, "dpo", "--dpo.num_epochs=inf", "dpo.num_epochs must be a finite number"),
    (SFTRunConfig, "align-sft", "--run.seed=-1", r"run.seed must be in \[0, 2\*\*32\)"),
    (DPORunConfig, "dpo", "--run.seed=99999999999999999999999", r"run.seed must be in \[0, 2\*\*32\)"),
    # wrote config.toml and metrics.jsonl over those of the working directory
    (SFTRunConfig, "align-sft", "--run.out_dir=", "run.out_dir must name a folder"),
    (DPORunConfig, "dpo", "--run.out_dir= ", "run.out_dir must name a folder"),
    # the group's mean is its only reward: advantages all 0, or NaN divided by the group's std
    (GRPORunConfig, "align-grpo", "--grpo.group_size=1", "grpo.group_size must be >= 2"),
    (GRPORunConfig, "align-grpo", "--grpo.normalize_constant=-1", "grpo.normalize_constant must be >= 0"),  # flipped sign
    (GRPORunConfig, "align-grpo", "--grpo.cliprange=-0.2", "grpo.cliprange must be >= 0"),
    (GRPORunConfig, "align-grpo", "--grpo.advantage_eps=-1", "grpo.advantage_eps must be >= 0"),
    (GRPORunConfig, "align-grpo", "--grpo.max_seconds=-5", "grpo.max_seconds must be >= 0"),
    # rollouts of no tokens: nothing rewarded, nothing learnt (grpo's constant normalisation: a ValueError)
    (GRPORunConfig, "align-grpo", "--sampling.max_new_tokens=0", "sampling.max_new_tokens must be >= 1"),
    (ExpertIterationRunConfig, "align-ei", "--sampling.max_new_tokens=0", "sampling.max_new_tokens must be >= 1"),
    # AdamW's m / (sqrt(v) + 0) is 0 / 0 for a weight with no gradient yet: a NaN policy was saved
    (SFTRunConfig, "align-sft", "--optim.eps=0", "optim.eps must be positive"),
    (DPORunConfig, "dpo", "--optim.eps=0", "optim.eps must be positive"),
    # a group of equal rewards (std 0) gave advantages 0 / 0: NaN loss, NaN policy saved
    (GRPORunConfig, "align-grpo", "--grpo.advantage_eps=0",
     "grpo.advantage_eps must be > 0 with grpo.normalize_by_std"),
    # greedy rollouts: a group's responses all the same, every GRPO advantage 0 (loss 0, nothing learnt)
    (GRPORunConfig, "align-grpo", "--sampling.temperature=0",
     "sampling.temperature must be > 0 for rollouts of grpo.group_size=8 responses"),
    (ExpertIterationRunConfig, "align-ei", "--sampling.temperature=0",
     "sampling.temperature must be > 0 for rollouts of ei.group_size=4 responses"),
])
def test_out_of_range_settings_are_config_errors(cls, preset, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(cls, preset, [override])


def test_group_size_one_is_allowed_without_a_baseline():
    cfg = load_config(GRPORunConfig, "align-grpo", ["--grpo.group_size=1", "--grpo.loss_type=no_baseline"])
    assert cfg.grpo.group_size == 1


@pytest.mark.parametrize("cls, preset, overrides", [
    # Dr. GRPO divides by nothing
    (GRPORunConfig, "align-grpo", ["--grpo.advantage_eps=0", "--grpo.normalize_by_std=false"]),
    (GRPORunConfig, "align-grpo", ["--grpo.advantage_eps=0", "--grpo.loss_type=no_baseline"]),  # uses raw rewards
    (GRPORunConfig, "align-grpo", ["--sampling.temperature=0", "--grpo.group_size=1", "--grpo.loss_type=no_baseline"]),
    (ExpertIterationRunConfig, "align-ei", ["--sampling.temperature=0", "--ei.group_size=1"]),
    (SFTRunConfig, "align-sft", ["--sampling.temperature=0"]),  # sft samples nothing (evaluations are greedy)
])
def test_settings_that_are_only_wrong_with_others_are_allowed_alone(cls, preset, overrides):
    load_config(cls, preset, overrides)


def test_sft_command_writes_metrics_evals_and_policy(tiny_policy, tmp_path):
    tiny_policy.save(tmp_path / "base")
    out = tmp_path / "sft"
    code = main(["sft", "align-sft", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                 "--sft.max_steps=2", "--sft.micro_batch_size=2", "--sft.grad_accum_steps=1", *COMMON])
    assert code == 0
    rows = _metrics(out)
    assert rows[0]["step"] == 0 and "eval_accuracy" in rows[0] and "eval_accuracy" in rows[-1]
    assert any("loss" in r for r in rows)
    assert (out / "eval_step_0.jsonl").is_file() and (out / "config.toml").is_file()
    assert load_policy(out / "policy").model_config == tiny_policy.model_config


def test_sft_and_dpo_commands_report_the_pairs_that_do_not_fit_the_context(tiny_policy, tmp_path, capsys):
    # Pairs longer than the context were dropped (or cut short) without a word.
    tiny_policy.save(tmp_path / "base")
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(3)]
    rows.append({"question": "What is " + " + ".join(["1"] * 150) + "?", "answer": "1 + 1 = 2\n#### 150"})
    rows.append({"question": "What is 1 + 1?", "answer": " ".join(["1 + 1 = 2."] * 100) + "\n#### 2"})
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sft"
    code = main(["sft", "align-sft", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}", *COMMON,
                 f"--data.dataset={data}", "--data.eval_dataset=arith:1", "--sft.max_steps=2",
                 "--sft.micro_batch_size=2", "--sft.grad_accum_steps=1"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("sft: 2 of 5 pairs are longer than the model's context of 160 tokens: 1 left out (the prompt "
                        "fills it), 1 with the response cut short")
    assert not any(line.startswith("sft:") for line in lines[1:])
    metrics = _metrics(out)
    assert [r["step"] for r in metrics] == [0, 1, 2, 2] and "eval_accuracy" in metrics[0]
    assert (metrics[1]["pairs"], metrics[1]["pairs_left_out"], metrics[1]["pairs_cut"]) == (5, 1, 1)

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": "Start with 3.", "chosen": " 3", "rejected": " 4"},
        {"prompt": " 7" * 400, "chosen": " 7", "rejected": " 8"})))
    out = tmp_path / "dpo"
    code = main(["dpo", "dpo", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                 f"--data.train_path={pairs}", "--data.eval_path=", "--data.eval_fraction=0", "--dpo.max_steps=1",
                 "--dpo.micro_batch_size=1", "--dpo.grad_accum_steps=1", "--policy.device=cpu",
                 "--run.progress=false"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("dpo: 1 of 2 training pairs are longer than the model's context of 160 tokens: 1 left out "
                        "(the prompt fills it)")
    assert _metrics(out)[0]["pairs_left_out"] == 1

def test_grpo_and_expert_iteration_commands(tiny_policy, tmp_path):
    tiny_policy.save(tmp_path / "base")
    out = tmp_path / "grpo"
    code = main(["grpo", "align-grpo", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                 "--grpo.n_grpo_steps=1", "--grpo.rollout_batch_size=4", "--grpo.group_size=2",
                 "--grpo.train_batch_size=4", "--grpo.grad_accum_steps=2", *COMMON])
    assert code == 0
    assert [r["step"] for r in _metrics(out)] == [0, 1] and (out / "policy").is_dir()
    out = tmp_path / "ei"
    code = main(["expert-iteration", "align-ei", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                 "--ei.n_ei_steps=1", "--ei.questions_per_step=2", "--ei.group_size=2", *COMMON])
    assert code == 0
    assert [r["step"] for r in _metrics(out)] == [0, 1]


def test_command_errors_are_one_line(tmp_path, capsys):
    assert main(["grpo", "align-grpo", f"--run.out_dir={tmp_path}"]) == 2
    assert "--policy.path" in capsys.readouterr().err
    assert main(["sft", "align-sft", "--sft.bogus=1"]) == 2
    assert "unknown config key" in capsys.readouterr().err
    assert main(["sft", "no-such-preset"]) == 2


def test_training_commands_grade_with_the_configured_reward(tiny_policy, tmp_path, monkeypatch):
    from scratchlm.align import reward_registry

    monkeypatch.setattr(reward_registry, "REWARDS", dict(reward_registry.REWARDS))
    graded = []

    def counting(response, truth):
        graded.append(truth)
        return {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}

    reward_registry.register_reward("counting", counting)
    tiny_policy.save(tmp_path / "base")
    out = tmp_path / "grpo"
    code = main(["grpo", "align-grpo", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                 "--data.reward=counting", "--grpo.n_grpo_steps=1", "--grpo.rollout_batch_size=4",
                 "--grpo.group_size=2", "--grpo.train_batch_size=4", "--grpo.grad_accum_steps=2", *COMMON])
    assert code == 0
    assert len(graded) == 2 + 4 + 2  # the two evaluations (eval_limit=2) and one rollout batch
    rows = _metrics(out)
    assert rows[0]["eval_format_rate"] == 1.0 and rows[1]["format_reward_mean"] == 1.0
    assert 'reward = "counting"' in (out / "config.toml").read_text()


def test_out_dir_may_not_be_a_training_run_or_a_file(tiny_policy, tmp_path, capsys):
    tiny_policy.save(tmp_path / "base")
    base_files = {p.name: p.read_bytes() for p in (tmp_path / "base").iterdir() if p.is_file()}
    step = next((tmp_path / "base" / "checkpoints").glob("step_*"))
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "base", step):  # e.g. --run.out_dir set to the policy's own run
        code = main(["sft", "align-sft", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                     "--sft.max_steps=1", *COMMON])
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert "is a training run or checkpoint" in err and "\n" not in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "base").iterdir() if p.is_file()} == base_files
    assert main(["sft", "align-sft", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={tmp_path / 'file'}",
                 "--sft.max_steps=1", *COMMON]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    out = tmp_path / "sft"
    args = ["sft", "align-sft", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
            "--sft.max_steps=1", "--sft.micro_batch_size=2", "--sft.grad_accum_steps=1", *COMMON]
    assert main(args) == 0
    # An earlier result of the same command is refused (it was rewritten silently), unless --overwrite.
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"error: run.out_dir {out} already holds a run (policy, metrics.jsonl); pass --resume to "
                        "continue it or --overwrite to replace it, or choose another run.out_dir")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert main([*args, "--overwrite"]) == 0


@pytest.mark.parametrize("command, preset, options", [
    ("sft", "align-sft", COMMON), ("expert-iteration", "align-ei", [*COMMON, "--ei.questions_per_step=2"]),
    ("grpo", "align-grpo", [*COMMON, "--data.limit=64"]),
    ("dpo", "dpo", ["--policy.device=cpu", "--run.progress=false"]),
])
def test_out_dir_may_not_be_a_hugging_face_model_directory(tmp_path, capsys, monkeypatch, command, preset, options):
    # Wrote config.toml, metrics.jsonl and policy/ among the model's files.
    def no_loading(*args, **kwargs):
        raise AssertionError("the policy was loaded")

    monkeypatch.setattr("scratchlm.align.policy.load_policy", no_loading)
    hf = tmp_path / "hf-model"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}\n')
    (hf / "model.safetensors").write_bytes(b"weights")
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    code = main([command, preset, f"--policy.path={hf}", f"--run.out_dir={hf}", *options])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is a Hugging Face model directory" in err and "\n" not in err
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before


@pytest.mark.parametrize("command, preset, extra", [
    ("sft", "align-sft", ["--sft.max_steps=1"]),
    ("expert-iteration", "align-ei", ["--ei.n_ei_steps=1"]),
    ("grpo", "align-grpo", ["--grpo.n_grpo_steps=1"]),
])
def test_empty_datasets_are_refused_before_anything_is_written(tiny_policy, tmp_path, capsys, command, preset, extra):
    # An empty training set stopped EI with a ZeroDivisionError and GRPO with a RuntimeError;
    # an empty evaluation set was reported as accuracy 0.0.
    tiny_policy.save(tmp_path / "base")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    for flag in ("--data.dataset", "--data.eval_dataset"):
        out = tmp_path / f"out{flag}"
        code = main([command, preset, f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                     *COMMON, f"{flag}={tmp_path / 'empty.jsonl'}", *extra])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "empty.jsonl" in err and ("has no examples" in err or "no worked solutions" in err)
        assert "\n" not in err and not out.exists()


def test_a_failed_rerun_leaves_the_earlier_result_alone(tiny_policy, tmp_path, capsys):
    tiny_policy.save(tmp_path / "base")
    out = tmp_path / "sft"
    args = ["sft", "align-sft", f"--run.out_dir={out}", "--sft.max_steps=1", "--sft.micro_batch_size=2",
            "--sft.grad_accum_steps=1", *COMMON]
    assert main([*args, f"--policy.path={tmp_path / 'base'}"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert main([*args, f"--policy.path={tmp_path / 'typo'}", "--overwrite"]) == 2  # config.toml was rewritten first
    assert main([*args, f"--policy.path={tmp_path / 'base'}", "--data.eval_dataset=typo.jsonl", "--overwrite"]) == 2
    capsys.readouterr()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("command, preset, options", [
    ("sft", "align-sft", ["--sft.max_steps=1", *COMMON]),
    ("grpo", "align-grpo", ["--grpo.n_grpo_steps=1", "--grpo.rollout_batch_size=4", "--grpo.group_size=2",
                            "--grpo.train_batch_size=4", "--grpo.grad_accum_steps=2", *COMMON]),
    ("dpo", "dpo", ["--dpo.max_steps=1", "--data.limit=4", "--data.eval_limit=2", "--policy.device=cpu",
                    "--run.progress=false"]),
])
def test_the_starting_policy_may_not_be_the_one_the_run_saves(tiny_policy, tmp_path, capsys, command, preset, options):
    # A second run into the first one's run.out_dir, starting from its policy/, saved over the
    # starting checkpoint (or pruned it for a higher step number).
    out = tmp_path / "run"
    tiny_policy.save(out / "policy", step=3)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    step = out / "policy" / "checkpoints" / "step_000003"
    for start in (out / "policy", step):
        code = main([command, preset, f"--policy.path={start}", f"--run.out_dir={out}", *options, "--overwrite"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "where this run saves its policy over it" in err and "\n" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_grpo_refuses_a_training_set_smaller_than_a_rollout_batch(tiny_policy, tmp_path, capsys):
    tiny_policy.save(tmp_path / "base")
    out = tmp_path / "grpo"
    code = main(["grpo", "align-grpo", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}", *COMMON,
                 "--data.limit=1", "--grpo.rollout_batch_size=4", "--grpo.group_size=2", "--grpo.train_batch_size=4",
                 "--grpo.grad_accum_steps=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "GRPO draws 2 questions a step" in err and "\n" not in err and not out.exists()


def test_eval_math_out_may_not_be_its_dataset(tmp_path, capsys):
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    before = data.read_bytes()
    assert main(["eval-math", str(tmp_path / "run"), "--dataset", str(data), "--out", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert "would overwrite the --dataset file" in err and "\n" not in err
    assert data.read_bytes() == before


def test_eval_math_split_is_refused_with_a_dataset_file(tmp_path, capsys):
    # The file was read whole and --split quietly ignored (and written into the summary).
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    assert main(["eval-math", str(tmp_path / "no-run"), "--dataset", str(data), "--split", "train"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"scratchlm eval-math: error: --split train does not apply to the --dataset file {data}, "
                   "which is read whole; leave --split out")
    # Without --split the file is read as before (here the missing model is the first problem).
    assert main(["eval-math", str(tmp_path / "no-run"), "--dataset", str(data)]) == 2
    assert "no-run" in capsys.readouterr().err
    assert main(["eval-math", str(tmp_path / "no-run"), "--dataset", "arith", "--split", "train"]) == 2
    assert "no-run" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--temperature", "inf"], "--temperature must be a number >= 0"),
    (["--temperature", "nan"], "--temperature must be a number >= 0"),
    (["--out", "{file}/results.jsonl"], "is a file, not a directory"),
    (["--out", "{file}/deeper/results.jsonl"], "is a file, not a directory"),
    (["--seed", str(2**64)], "--seed must be in [0, 2**32)"),  # was a ValueError once generating
])
def test_eval_math_refuses_bad_options_before_loading_anything(tmp_path, capsys, args, message):
    # An infinite temperature sampled uniformly at random; an --out under a file failed with a
    # FileExistsError of mkdir.
    file = tmp_path / "notes.txt"
    file.write_text("keep\n")
    args = [a.format(file=file) for a in args]
    assert main(["eval-math", str(tmp_path / "no-run"), "--dataset", "arith", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert file.read_text() == "keep\n"


def test_eval_math_notes_a_seed_that_greedy_decoding_never_reads(tmp_path, capsys):
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    base = ["eval-math", str(tmp_path / "no-run")]  # refused next, after the options: no model there
    assert main([*base, "--dataset", str(data), "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("note: --seed has no effect here (--temperature 0 decodes greedily: the most likely token "
                          "every step)\n")
    # sampled answers read it, and so does arith, whose problems are drawn from it: no note
    for options in ([], ["--temperature", "0.7", "--seed", "3"], ["--dataset", "arith", "--seed", "3"]):
        assert main([*base, *(["--dataset", str(data)] if "--dataset" not in options else []), *options]) == 2
        assert "note:" not in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no file can be created")
@pytest.mark.parametrize("out", ["/proc/results.jsonl", "/proc/missing/results.jsonl"])
def test_eval_math_refuses_an_out_it_cannot_write_before_loading_anything(tmp_path, capsys, out):
    # Evaluated the whole dataset first, then failed to write the results.
    assert main(["eval-math", str(tmp_path / "no-run"), "--dataset", "arith", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--out {out}: cannot" in err and "write in /proc" in err and "\n" not in err


GRPO_EI_OPTIONS = {
    "grpo": ["align-grpo", "--grpo.n_grpo_steps=1", "--grpo.rollout_batch_size=4", "--grpo.group_size=2",
             "--grpo.train_batch_size=4", "--grpo.grad_accum_steps=2"],
    "expert-iteration": ["align-ei", "--ei.n_ei_steps=1", "--ei.questions_per_step=2", "--ei.group_size=2"],
    "sft": ["align-sft", "--sft.max_steps=1"],
}


def _earlier_run(out):
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"phase": "grpo", "step": 7}\n')
    (out / "config.toml").write_text("# an earlier run\n")
    return {p.name: p.read_bytes() for p in out.iterdir()}


@pytest.mark.parametrize("command, split", [("grpo", "training"), ("grpo", "evaluation"),
                                            ("expert-iteration", "training"), ("expert-iteration", "evaluation"),
                                            ("sft", "evaluation")])  # (sft leaves out long training pairs)
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
    preset, *options = GRPO_EI_OPTIONS[command]
    code = main([command, preset, f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}", *COMMON,
                 "--data.eval_limit=4", f"{flag}={data}", *options, "--overwrite"])
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
                 *COMMON, "--data.limit=3", "--ei.questions_per_step=4", "--overwrite"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "expert iteration draws 4 questions a step (ei.questions_per_step) but the training set has 3" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_symbolic_link_loops_are_one_line_errors(tmp_path, capsys):
    # Path.resolve() raised RuntimeError ("Symlink loop from ..."), reported as an unexpected error.
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    cases = [
        (["sft", "align-sft", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={loop}", *COMMON],
         f"run.out_dir {loop}:"),
        (["dpo", "dpo", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={loop / 'run'}", "--policy.device=cpu"],
         f"run.out_dir {loop / 'run'}:"),
        (["sft", "align-sft", f"--policy.path={loop}", f"--run.out_dir={tmp_path / 'run'}", *COMMON],
         f"policy.path {loop}:"),
        (["eval-math", str(tmp_path / "base"), "--dataset", "arith", "--out", str(loop)], f"--out {loop}:"),
        (["eval-math", str(tmp_path / "base"), "--dataset", "arith", "--out", str(loop / "r.jsonl")],
         f"--out {loop / 'r.jsonl'}:"),
        (["eval-math", str(tmp_path / "base"), "--dataset", str(loop), "--out", str(tmp_path / "r.jsonl")],
         f"--dataset {loop}:"),
    ]
    for argv, what in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert f"{what} a symbolic link on its path leads back to itself" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command, preset, options", [
    ("sft", "align-sft", ["--sft.max_steps=1"]),
    ("grpo", "align-grpo", GRPO_EI_OPTIONS["grpo"][1:]),
    ("expert-iteration", "align-ei", GRPO_EI_OPTIONS["expert-iteration"][1:]),
])
def test_evaluations_grade_with_the_evaluation_datasets_default_reward(tiny_policy, tmp_path, monkeypatch, command,
                                                                       preset, options):
    # Trained on arith, evaluated on a GSM8K file: graded with the integer-only arithmetic reward
    # ("$18" or "18.0" wrong), where eval-math grades that file with r1_zero.
    from scratchlm.align import evaluate
    from scratchlm.align.rewards import r1_zero_reward

    used = []
    real = evaluate.evaluate_policy
    monkeypatch.setattr(evaluate, "evaluate_policy", lambda *a, **kw: used.append(kw["reward_fn"]) or real(*a, **kw))
    tiny_policy.save(tmp_path / "base")
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
                            for i in range(2)))
    assert main([command, preset, f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={tmp_path / 'run'}", *COMMON,
                 f"--data.eval_dataset={data}", *options]) == 0
    assert used and all(fn is r1_zero_reward for fn in used)



def _no_loading(monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the policy was loaded")

    monkeypatch.setattr("scratchlm.align.policy.load_policy", no_loading)


@pytest.mark.parametrize("command, options, updates", [
    ("dpo", ["dpo", "--dpo.max_steps=1", "--optim.warmup_steps=5"],
     "the 1 optimizer update of this run (dpo.max_steps=1)"),
    ("dpo", ["dpo", "--data.limit=8", "--dpo.micro_batch_size=2", "--dpo.grad_accum_steps=2", "--optim.warmup_steps=2"],
     "the 2 optimizer updates of this run (1 epoch(s) of 8 pairs, 4 a step)"),
    ("sft", ["align-sft", *COMMON, "--sft.max_steps=2", "--optim.warmup_steps=3"],
     "the 2 optimizer updates of this run (sft.max_steps=2)"),
    ("grpo", [*GRPO_EI_OPTIONS["grpo"], *COMMON, "--optim.warmup_steps=1"],
     "the 1 optimizer update of this run (grpo.n_grpo_steps=1 x 1 a step)"),
    ("expert-iteration", [*GRPO_EI_OPTIONS["expert-iteration"], *COMMON, "--optim.warmup_steps=10"],
     "the 1 optimizer update that the SFT of an expert-iteration step takes at most"),
])
def test_a_chosen_warmup_as_long_as_the_run_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch,
                                                                                 command, options, updates):
    # The whole run was warm-up: a 1-step dpo run trained at learning rate 0 and saved the starting policy.
    _no_loading(monkeypatch)
    out = tmp_path / "run"
    before = _earlier_run(out)
    code = main([command, *options, f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                 "--policy.device=cpu", "--run.progress=false", "--overwrite"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    warmup = next(o for o in options if o.startswith("--optim.warmup_steps=")).split("=")[1]
    assert f"error: optim.warmup_steps={warmup} is not shorter than {updates}" in err
    assert "set optim.warmup_steps below" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_warmup_of_a_config_file_of_ones_own_is_a_choice(tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    mine = tmp_path / "mine.toml"
    mine.write_text("[optim]\nwarmup_steps = 5\n[dpo]\nmax_steps = 2\n")
    code = main(["dpo", str(mine), f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={tmp_path / 'run'}",
                 "--data.train_path=arith:1", "--data.limit=8"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "optim.warmup_steps=5 is not shorter than the 2 optimizer updates" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command, options, lr", [
    ("dpo", ["dpo", "--dpo.max_steps=1", "--data.limit=4", "--data.eval_limit=2", "--dpo.micro_batch_size=2",
             "--dpo.grad_accum_steps=2"], 1e-5),  # the preset warms up over 5 steps
    ("sft", ["align-sft", *COMMON, "--sft.max_steps=2", "--sft.micro_batch_size=2", "--sft.grad_accum_steps=1"],
     2e-5),  # over 20
])
def test_a_presets_warmup_as_long_as_the_run_is_shortened_with_a_warning(tiny_policy, tmp_path, caplog, command,
                                                                         options, lr):
    tiny_policy.save(tmp_path / "base")
    out = tmp_path / "run"
    with caplog.at_level("WARNING", logger="scratchlm.align"):
        assert main([command, *options, f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                     "--policy.device=cpu", "--run.progress=false"]) == 0
    (warning,) = [r.getMessage() for r in caplog.records if "warmup" in r.getMessage()]
    assert "the default optim.warmup_steps=" in warning and "warming up over 0 instead" in warning
    assert "\n" not in warning
    trained = [r for r in _metrics(out) if "lr" in r]
    assert trained and trained[0]["lr"] == lr  # (was 0.0 for the first update)
    assert "warmup_steps = 0" in (out / "config.toml").read_text()  # what the run used


def test_a_time_limited_grpo_run_is_not_refused_for_its_warmup(tiny_policy, tmp_path):
    # Its number of updates is not known in advance.
    tiny_policy.save(tmp_path / "base")
    out = tmp_path / "run"
    assert main(["grpo", *GRPO_EI_OPTIONS["grpo"], *COMMON, f"--policy.path={tmp_path / 'base'}",
                 f"--run.out_dir={out}", "--optim.warmup_steps=4", "--grpo.max_seconds=3600"]) == 0
    assert _metrics(out)[1]["lr"] == pytest.approx(1e-5 / 4)


def _hf_directory(path):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}\n')
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "tokenizer.json").write_text("{}\n")
    return path


@pytest.mark.parametrize("model, out", [
    ("base", "base/config.toml"),
    ("base", "base/checkpoints/step_000000/model.safetensors"),
    ("base", "base/tokenizer/vocab.json"),
    ("base/checkpoints/step_000000", "base/config.toml"),  # the step's run
    ("base/checkpoints/step_000000/model.safetensors", "base/checkpoints/step_000000/model.safetensors"),
    ("hf", "hf/config.json"),
    ("hf", "hf/tokenizer.json"),
    ("base", "other/metrics.jsonl"),  # another run's files
    ("base", "link.jsonl"),  # a link to the model's config
    ("base", "base/config.jsonl"),  # whose summary, config.summary.json, is the model's
])
def test_eval_math_out_may_not_overwrite_a_file_of_a_model(tiny_policy, tmp_path, capsys, monkeypatch, model, out):
    # --out base/config.toml replaced the evaluated model's config with per-example results.
    tiny_policy.save(tmp_path / "base")
    tiny_policy.save(tmp_path / "other")
    (tmp_path / "other" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "base" / "config.summary.json").write_text('{"note": "kept with the model"}\n')
    _hf_directory(tmp_path / "hf")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "base" / "config.toml")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    _no_loading(monkeypatch)
    assert main(["eval-math", str(tmp_path / model), "--dataset", "arith", "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--out {tmp_path / out} would overwrite" in err and "\n" not in err
    assert "a file of the model" in err and "give a file name outside the model's directory" in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_eval_math_out_may_replace_its_own_results_in_the_model_directory(tiny_policy, tmp_path, capsys):
    tiny_policy.save(tmp_path / "base")
    out = tmp_path / "base" / "eval.jsonl"
    args = ["eval-math", str(tmp_path / "base"), "--dataset", "arith", "--limit", "2", "--max-new-tokens", "2",
            "--device", "cpu"]
    assert main([*args, "--out", str(out)]) == 0
    assert main([*args, "--out", str(out)]) == 0  # an earlier eval-math output
    assert main([*args, "--out", str(out.with_suffix(".summary.json"))]) == 0  # its summary too
    assert json.loads(out.read_text().splitlines()[0])["index"] == 0
    capsys.readouterr()


def test_eval_math_refuses_an_out_whose_summary_is_a_directory(tmp_path, capsys, monkeypatch):
    # Evaluated everything, wrote the results, then failed with IsADirectoryError on the summary.
    _no_loading(monkeypatch)
    (tmp_path / "r.summary.json").mkdir()
    assert main(["eval-math", str(tmp_path / "base"), "--dataset", "arith", "--out", str(tmp_path / "r.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"its summary {tmp_path / 'r.summary.json'} is a directory" in err and "\n" not in err
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("command, option, note", [
    ("sft", "--sampling.top_p=0.9", "note: sampling.top_p=0.9 has no effect (scratchlm sft draws no rollouts"),
    ("expert-iteration", "--sft.max_steps=5", "note: sft.max_steps=5 has no effect (each expert-iteration step"),
    ("grpo", "--grpo.cliprange=0.1", "note: grpo.cliprange=0.1 has no effect (it clips grpo_clip's ratio"),
    ("dpo", "--data.eval_fraction=0.2", "note: data.eval_fraction=0.2 has no effect (data.eval_path is set"),
])
def test_options_a_command_never_reads_are_noted_before_it_starts(tmp_path, caplog, command, option, note):
    out = f"--run.out_dir={tmp_path / 'run'}"
    with caplog.at_level("WARNING", logger="scratchlm.align"):
        main([command, option, out])  # refused next: no policy.path
    notes = [m for m in caplog.messages if m.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith(note)
    caplog.clear()
    with caplog.at_level("WARNING", logger="scratchlm.align"):
        main([command, out])
    assert not [m for m in caplog.messages if m.startswith("note:")]
