"""`scratchlm train` (with --resume) and `scratchlm eval` on a tiny model; the training itself
is tested through `run_training` in tests/train/test_trainer.py, whose fixtures this reuses."""

import json

import pytest

from scratchlm.cli.train import eval_command, train_command
from scratchlm.errors import UserError
from tests.train.test_trainer import _losses, cfg  # noqa: F401 (cfg is a fixture)


def test_train_and_eval_commands(cfg, tmp_path, capsys):
    from scratchlm.config import save_config

    save_config(cfg, tmp_path / "c.toml")
    out = tmp_path / "cli"
    assert train_command([str(tmp_path / "c.toml"), f"--trainer.out_dir={out}", "--trainer.max_steps=4"]) == 0
    assert [s for s, _ in _losses(out)] == [1, 2, 3, 4]
    with pytest.raises(UserError, match="--resume"):
        train_command([str(tmp_path / "c.toml"), f"--trainer.out_dir={out}"])
    assert train_command([str(tmp_path / "c.toml"), f"--trainer.out_dir={out}", "--resume"]) == 0
    assert [s for s, _ in _losses(out)][-1] == 12
    capsys.readouterr()
    assert eval_command([str(out), "--data", cfg.data.val_path, "--batches", "2", "--batch-size", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 2 * 4 * 16 and result["checkpoint"].endswith("step_000012")
    assert result["val_loss"] == pytest.approx(_losses(out, "eval", "val_loss")[-1][1], rel=1e-5)
