import pytest

from scratchlm.errors import UserError
from scratchlm.train.run_dir import prepare_run_dir


def test_overwrite_deletes_a_run_directory(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("")
    assert prepare_run_dir(run, resume=False, overwrite=True) == run
    assert run.is_dir() and not any(run.iterdir())


def test_overwrite_refuses_a_folder_that_only_holds_a_config(tmp_path):
    # A project folder with its config.toml (and data) given as trainer.out_dir was deleted whole.
    (tmp_path / "config.toml").write_text("[trainer]\n")
    (tmp_path / "data.txt").write_text("precious")
    with pytest.raises(UserError, match="does not look like a run directory"):
        prepare_run_dir(tmp_path, resume=False, overwrite=True)
    assert (tmp_path / "data.txt").read_text() == "precious"


def test_overwrite_refuses_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    for path in ("..", tmp_path):
        with pytest.raises(UserError, match="holds the current directory"):
            prepare_run_dir(path, resume=False, overwrite=True)
    assert (tmp_path / "metrics.jsonl").is_file()
