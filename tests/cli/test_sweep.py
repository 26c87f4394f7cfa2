"""`scratchlm sweep` on tiny CPU runs; the sweep itself is tested in tests/train/test_sweep.py."""

import json

import pytest

from scratchlm import cli
from scratchlm.config import save_config
from tests.train.small_runs import make_cfg

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def preset(tmp_path):
    path = tmp_path / "tiny.toml"
    save_config(make_cfg(tmp_path, max_steps=2, eval_interval=2, checkpoint_interval=2), path)
    return path


def test_sweep_command_runs_the_grid_with_the_overrides_then_skips_it(preset, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", str(preset), "--grid", "optim.lr=1e-2,3e-3", "--grid=model.num_layers=1,2",
            "--trainer.max_steps=3", "--out", str(out)]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if line.startswith("point ")]
    assert progress[0].startswith("point 1/4 optim.lr=1e-2 model.num_layers=1: val ")
    assert len(progress) == 4 and lines[0] == f"sweep of 4 points into {out}"
    rows = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["optim.lr=1e-2__model.num_layers=1", "optim.lr=1e-2__model.num_layers=2",
                                         "optim.lr=3e-3__model.num_layers=1", "optim.lr=3e-3__model.num_layers=2"]
    assert all(r["steps"] == 3 and r["finished"] for r in rows)  # the override reaches every point

    assert cli.main(argv) == 0
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("point ")]
    assert len(progress) == 4 and all("finished already" in line for line in progress)


@pytest.mark.parametrize("grid", ["optim.lr", "optim.lr=1e-3,abc", "optim.nope=1,2"])
def test_a_bad_grid_is_one_line_and_writes_nothing(preset, tmp_path, capsys, grid):
    out = tmp_path / "sweep"
    assert cli.main(["sweep", str(preset), "--grid", grid, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scratchlm sweep: error: ") and err.count("\n") == 1
    assert not out.exists() and not (tmp_path / "run").exists()


def test_the_sweep_folder_defaults_to_the_config_out_dir(preset, tmp_path, capsys):
    assert cli.main(["sweep", str(preset), "--grid", "optim.lr=1e-2", f"--trainer.out_dir={tmp_path / 'lr'}"]) == 0
    assert (tmp_path / "lr" / "optim.lr=1e-2" / "metrics.jsonl").is_file()
    assert (tmp_path / "lr" / "summary.md").is_file()


@pytest.mark.parametrize("option", ["--out=", "--trainer.out_dir="])
def test_an_empty_sweep_folder_is_refused(preset, tmp_path, monkeypatch, capsys, option):
    # --out $OUT with OUT unset put the points, the summary and the plot in the current directory.
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cli.main(["sweep", str(preset), "--grid", "optim.lr=1e-2", option]) == 2
    assert "is empty" in capsys.readouterr().err
    assert not any(work.iterdir())
