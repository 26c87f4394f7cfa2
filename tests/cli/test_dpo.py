"""`scratchlm dpo` end to end on a tiny run directory, and its one-line errors on bad pair files."""

from __future__ import annotations

import json

import pytest

from scratchlm.align.config import DPORunConfig
from scratchlm.align.policy import load_policy
from scratchlm.cli import main
from scratchlm.config import ConfigError, load_config

FAST = ["--policy.device=cpu", "--run.progress=false", "--dpo.micro_batch_size=2", "--dpo.grad_accum_steps=1"]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_preset_loads_with_overrides():
    cfg = load_config(DPORunConfig, "dpo", ["--dpo.beta=0.5", "--optim.lr=3e-6"])
    assert cfg.dpo.beta == 0.5 and cfg.optim.lr == 3e-6 and cfg.data.train_path == "arith:1"
    with pytest.raises(ConfigError):
        load_config(DPORunConfig, "dpo", ["--dpo.beta=0"])
    with pytest.raises(ConfigError):
        load_config(DPORunConfig, "dpo", ["--dpo.nope=1"])


@pytest.mark.parametrize("override, message", [
    ("--data.limit=-1", "data.limit must be >= 0"),  # quietly dropped the last pair
    ("--data.eval_limit=-2", "data.eval_limit must be >= 0"),
    ("--dpo.num_epochs=0", "dpo.num_epochs must be positive"),
    ("--dpo.log_every=0", "dpo.log_every must be >= 1"),
    ("--optim.lr=-1", "optim.lr must be >= 0"),
])
def test_out_of_range_settings_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DPORunConfig, "dpo", [override])


def test_dpo_command_on_the_preset_writes_metrics_and_policy(tiny_policy, tmp_path):
    tiny_policy.save(tmp_path / "base")
    out = tmp_path / "dpo"
    code = main(["dpo", "dpo", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}", "--data.limit=8",
                 "--data.eval_limit=4", "--dpo.max_steps=3", "--dpo.eval_every=2", "--dpo.save_every=2",
                 "--optim.lr=1e-3", *FAST])
    assert code == 0
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval_reward_accuracy"] == 0.0 and "eval_loss" in rows[2] and "eval_loss" in rows[3]
    assert all({"loss", "reward_accuracy", "reward_margin", "grad_norm"} <= set(r) for r in rows[1:])
    assert 'train_path = "arith:1"' in (out / "config.toml").read_text()
    policy = load_policy(out / "policy")
    assert policy.model_config == tiny_policy.model_config
    assert [p.name for p in (out / "policy" / "checkpoints").glob("step_*")] == ["step_000003"]


def test_dpo_command_on_a_jsonl_file_holds_out_pairs(tiny_policy, tmp_path):
    tiny_policy.save(tmp_path / "base")
    rows = [{"prompt": f"Start with {i}. Add 1.", "chosen": f" {i + 1}", "rejected": f" {i + 2}"} for i in range(10)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "dpo"
    code = main(["dpo", "dpo", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                 f"--data.train_path={path}", "--data.eval_path=", "--data.eval_fraction=0.2", "--dpo.max_steps=2",
                 *FAST])
    assert code == 0
    assert [r["step"] for r in _metrics(out)] == [0, 1, 2]


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{"prompt": "a", "chosen": '], "pairs.jsonl:2: not valid JSON"),
    (['{"prompt": "a", "chosen": "b"}'], "pairs.jsonl:1: missing key rejected"),
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{"prompt": "a", "chosen": " b", "rejected": " b"}'],
     "pairs.jsonl:2: chosen and rejected are the same response"),
    (["", ""], "holds no preference pairs"),
])
def test_bad_pair_files_are_one_line_errors(tiny_policy, tmp_path, capsys, lines, message):
    tiny_policy.save(tmp_path / "base")
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "dpo"
    code = main(["dpo", "dpo", f"--policy.path={tmp_path / 'base'}", f"--run.out_dir={out}",
                 f"--data.train_path={path}", *FAST])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()  # the data is checked before anything is written


def test_missing_inputs_are_one_line_errors(tmp_path, capsys):
    assert main(["dpo", "dpo", f"--run.out_dir={tmp_path / 'x'}"]) == 2
    assert "--policy.path" in capsys.readouterr().err
    code = main(["dpo", "dpo", f"--policy.path={tmp_path}", f"--data.train_path={tmp_path / 'none.jsonl'}"])
    err = capsys.readouterr().err
    assert code == 2 and "none.jsonl not found" in err and len(err.strip().splitlines()) == 1
    code = main(["dpo", "dpo", f"--policy.path={tmp_path}", f"--data.eval_path={tmp_path}"])
    err = capsys.readouterr().err  # (a directory was reported as not found)
    assert code == 2 and f"{tmp_path} is a directory, not a file" in err and len(err.strip().splitlines()) == 1
