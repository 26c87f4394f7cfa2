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


def _tokenizer_dir(path, vocab):
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(vocab)
    (path / "merges.txt").write_text(f"merges of {vocab}\n")
    return path


def _files(path):
    return {p.relative_to(path).as_posix(): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def test_copy_tokenizer_replaces_the_previous_copy_whole_and_skips_temporary_files(tmp_path):
    from scratchlm.train.run_dir import copy_tokenizer

    src = _tokenizer_dir(tmp_path / "tok", '{"new": 1}')
    (src / ".vocab.json.0123abcd.tmp").write_text('{"ne')  # left by a writer killed mid-write
    run = tmp_path / "run"
    _tokenizer_dir(run / "tokenizer", '{"old": 0}')
    (run / "tokenizer" / "special_tokens.json").write_text("[]")  # of the old tokenizer only
    assert copy_tokenizer(str(src), run) == run / "tokenizer"
    assert _files(run / "tokenizer") == {"merges.txt": 'merges of {"new": 1}\n', "vocab.json": '{"new": 1}'}
    assert sorted(p.name for p in run.iterdir()) == ["tokenizer"]
    assert copy_tokenizer(str(run / "tokenizer"), run) == run / "tokenizer"  # already in place
    assert copy_tokenizer("", run) is None


def test_a_copy_that_fails_midway_keeps_the_previous_copy(tmp_path, monkeypatch):
    from scratchlm import fileio
    from scratchlm.train.run_dir import copy_tokenizer

    src = _tokenizer_dir(tmp_path / "tok", '{"new": 1}')
    run = tmp_path / "run"
    _tokenizer_dir(run / "tokenizer", '{"old": 0}')
    before = _files(run / "tokenizer")
    copied = []

    def copy_then_fail(a, b, **kwargs):  # the first file is copied, then the disk is full
        if copied:
            raise OSError(28, "No space left on device")
        copied.append(b)
        return fileio.shutil.copy2(a, b)

    real = fileio.shutil.copytree
    monkeypatch.setattr(fileio.shutil, "copytree", lambda a, b, **k: real(a, b, copy_function=copy_then_fail, **k))
    with pytest.raises(OSError, match="No space left"):
        copy_tokenizer(str(src), run)
    assert copied and _files(run / "tokenizer") == before
    assert sorted(p.name for p in run.iterdir()) == ["tokenizer"]


def test_a_copy_killed_between_its_renames_is_cleaned_up_by_the_next(tmp_path):
    from scratchlm.train.run_dir import copy_tokenizer

    src = _tokenizer_dir(tmp_path / "tok", '{"new": 1}')
    run = tmp_path / "run"
    _tokenizer_dir(run / ".tokenizer.0123abcd.tmp", '{"old": 0}')  # the old copy, set aside
    _tokenizer_dir(run / ".tokenizer.4567cdef.tmp", '{"ne')  # a new copy, cut short
    copy_tokenizer(str(src), run)
    assert _files(run / "tokenizer") == {"merges.txt": 'merges of {"new": 1}\n', "vocab.json": '{"new": 1}'}
    assert sorted(p.name for p in run.iterdir()) == ["tokenizer"]


def test_a_replaced_run_is_set_aside_until_kept_or_put_back(tmp_path):
    from scratchlm.train.run_dir import begin_run_dir

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("old\n")
    pending = begin_run_dir(run, resume=False, overwrite=True)
    assert run.is_dir() and not any(run.iterdir()) and pending.created
    (run / "config.toml").write_text("new")  # what a new run writes before it fails
    pending.abandon()
    assert (run / "metrics.jsonl").read_text() == "old\n" and not (run / "config.toml").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    pending = begin_run_dir(run, resume=False, overwrite=True)
    assert pending.keep() == run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not any(run.iterdir())


def test_a_leftover_set_aside_run_is_replaced(tmp_path):
    # an invocation killed before its run started left the older run aside
    from scratchlm.train.run_dir import begin_run_dir

    run, aside = tmp_path / "run", tmp_path / ".run.replaced"
    for d, text in ((run, "newer"), (aside, "older")):
        d.mkdir()
        (d / "metrics.jsonl").write_text(text)
    pending = begin_run_dir(run, resume=False, overwrite=True)
    assert (aside / "metrics.jsonl").read_text() == "newer"
    pending.abandon()
    assert (run / "metrics.jsonl").read_text() == "newer" and not aside.exists()
