"""The trainer refuses bad training or validation data before it does any work or writes a file."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from scratchlm.errors import UserError
from scratchlm.cli.train import run_training
from tests.train.small_runs import VOCAB, make_cfg, write_tokens
from tests.train.test_resume import train_steps


@pytest.fixture
def cfg(tmp_path):
    return make_cfg(tmp_path, max_steps=4)


def _with_data(cfg, **data):
    return replace(cfg, data=replace(cfg.data, **data))


def _fails_before_any_file(cfg, tmp_path, match):
    run = tmp_path / "run"
    with pytest.raises(UserError, match=match) as err:
        run_training(cfg)
    assert "\n" not in str(err.value)
    assert not run.exists() or not any(run.iterdir())  # nothing that would need --overwrite


def test_ids_beyond_the_vocabulary_fail_before_evaluation_and_leave_no_files(cfg, tmp_path):
    path = tmp_path / "bad.bin"
    write_tokens(path, 4000, 0)
    ids = np.fromfile(path, dtype=np.uint16)
    ids[3999] = VOCAB + 3  # the sidecar says VOCAB; one id is beyond it
    ids.tofile(path)
    bad = _with_data(cfg, train_path=str(path))
    _fails_before_any_file(bad, tmp_path, rf"{path}.*{VOCAB + 3}")
    run_training(cfg)  # with the data fixed, the same run directory needs no --overwrite
    assert train_steps(tmp_path / "run") == [1, 2, 3, 4]


def test_bad_validation_data_is_refused_too(cfg, tmp_path):
    path = tmp_path / "badval.bin"
    write_tokens(path, 1000, 1)
    ids = np.fromfile(path, dtype=np.uint16)
    ids[10] = 60000
    ids.tofile(path)
    _fails_before_any_file(_with_data(cfg, val_path=str(path)), tmp_path, rf"data.val_path {path}.*60000")


def test_a_token_file_without_sidecar_is_refused(cfg, tmp_path):
    path = tmp_path / "raw.bin"
    np.arange(4000, dtype=np.uint16).__mod__(VOCAB).astype(np.uint16).tofile(path)
    _fails_before_any_file(_with_data(cfg, train_path=str(path)), tmp_path, r"raw\.json")


def test_a_text_file_as_train_path_is_refused(cfg, tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("hello world\n" * 1000)
    _fails_before_any_file(_with_data(cfg, train_path=str(path)), tmp_path, r"train\.txt.*text file.*scratchlm encode")


def test_data_from_another_tokenizer_is_refused_when_the_run_names_its_tokenizer(cfg, tmp_path):
    from scratchlm.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tok.save(tmp_path / "tok")
    write_tokens(tmp_path / "train.bin", 4000, 0, tokenizer_hash="0" * 64)
    write_tokens(tmp_path / "val.bin", 1000, 1, tokenizer_hash=tok.hash)
    named = _with_data(cfg, tokenizer_dir=str(tmp_path / "tok"))
    _fails_before_any_file(named, tmp_path, rf"train\.bin.*another tokenizer.*{tmp_path / 'tok'}")
    write_tokens(tmp_path / "train.bin", 4000, 0, tokenizer_hash=tok.hash)
    run_training(named)
    assert train_steps(tmp_path / "run") == [1, 2, 3, 4]


def test_the_sidecar_vocabulary_check_names_the_fix(cfg, tmp_path):
    path = tmp_path / "train.bin"
    meta = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**meta, "vocab_size": 1000}))
    _fails_before_any_file(cfg, tmp_path, r"1000.*model.vocab_size=48")


def test_the_training_file_as_validation_data_is_refused(cfg, tmp_path, monkeypatch):
    # The "validation" loss scored the tokens the model trained on, without a word.
    _fails_before_any_file(_with_data(cfg, val_path=cfg.data.train_path), tmp_path,
                           r"data.val_path .*train\.bin is the training file data.train_path")
    monkeypatch.chdir(tmp_path)  # the same file spelled another way
    _fails_before_any_file(_with_data(cfg, val_path="./train.bin"), tmp_path, "is the training file")
