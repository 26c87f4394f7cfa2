"""Token files checked against the model that will read them: sidecar, vocabulary, ids, tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scratchlm.data import token_file
from scratchlm.errors import UserError


def write(path, ids, *, dtype="uint16", vocab_size=100, tokenizer_hash="", sidecar=True):
    arr = np.asarray(ids, dtype=np.dtype(dtype).newbyteorder("<"))
    arr.tofile(path)
    if sidecar:
        path.with_suffix(".json").write_text(json.dumps(
            {"dtype": dtype, "vocab_size": vocab_size, "tokenizer_hash": tokenizer_hash, "num_tokens": int(arr.size)}))
    return path


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_max_token_id_matches_numpy_whatever_the_chunking(tmp_path, dtype, chunk):
    ids = np.random.default_rng(0).integers(0, 1000, 1000)
    ids[-1] = 4242  # at the very end: the last partial chunk is read too
    tokens = np.memmap(write(tmp_path / "t.bin", ids, dtype=dtype), dtype=np.dtype(dtype), mode="r")
    assert token_file.max_token_id(tokens, chunk_tokens=chunk) == int(ids.max()) == 4242


def test_a_valid_file_opens(tmp_path):
    path = write(tmp_path / "ok.bin", np.arange(100) % 50, vocab_size=50, tokenizer_hash="abc")
    tokens = token_file.open_checked(path, vocab_size=50, context_length=8, tokenizer_hash="abc",
                                     what="data.train_path")
    np.testing.assert_array_equal(tokens, np.arange(100) % 50)
    # a sidecar that records no tokenizer (hand-made files) is not refused for it
    path = write(tmp_path / "nohash.bin", np.arange(100) % 50, vocab_size=50)
    token_file.open_checked(path, vocab_size=50, context_length=8, tokenizer_hash="abc", what="data.train_path")


def test_ids_beyond_the_model_vocabulary_are_refused_with_the_file_and_the_fix(tmp_path):
    ids = np.arange(1000) % 40
    ids[777] = 64  # one stray id; the sidecar claims a vocabulary the model has
    path = write(tmp_path / "bad.bin", ids, vocab_size=64)
    with pytest.raises(UserError) as err:
        token_file.open_checked(path, vocab_size=64, context_length=8, what="data.train_path")
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "64" in message and "encode" in message


def test_a_sidecar_vocabulary_larger_than_the_model_is_refused(tmp_path):
    path = write(tmp_path / "big.bin", np.arange(100) % 40, vocab_size=500)
    with pytest.raises(UserError, match=r"500.*model.vocab_size=64"):
        token_file.open_checked(path, vocab_size=64, context_length=8, what="data.train_path")


def test_a_file_without_sidecar_is_refused(tmp_path):
    path = write(tmp_path / "raw.bin", np.arange(100) % 40, sidecar=False)
    with pytest.raises(UserError, match=r"raw\.json.*scratchlm encode"):
        token_file.open_checked(path, vocab_size=64, context_length=8, what="data.train_path")


def test_a_text_file_is_refused_as_text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("once upon a time " * 50)
    with pytest.raises(UserError, match=r"corpus\.txt.*text.*scratchlm encode"):
        token_file.open_checked(path, vocab_size=64, context_length=8, what="data.train_path")


def test_data_encoded_with_another_tokenizer_is_refused(tmp_path):
    path = write(tmp_path / "other.bin", np.arange(100) % 40, vocab_size=64, tokenizer_hash="aaaa" * 16)
    with pytest.raises(UserError, match=r"other\.bin.*another tokenizer"):
        token_file.open_checked(path, vocab_size=64, context_length=8, tokenizer_hash="bbbb" * 16,
                                what="data.train_path")


def test_read_sidecar_errors(tmp_path):
    write(tmp_path / "t.bin", [1, 2, 3])
    (tmp_path / "t.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="not a JSON object"):
        token_file.read_sidecar(tmp_path / "t.bin")
    (tmp_path / "t.json").write_text("{")
    with pytest.raises(UserError, match="not a JSON object"):
        token_file.read_sidecar(tmp_path / "t.bin")
    (tmp_path / "t.json").write_text(json.dumps({"dtype": "int8"}))
    with pytest.raises(UserError, match="dtype"):
        token_file.read_sidecar(tmp_path / "t.bin")
    assert token_file.read_sidecar(tmp_path / "none.bin") is None


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", "abc", "vocab_size must be an integer >= 1, got 'abc'"),
    ("vocab_size", -1, "vocab_size must be an integer >= 1, got -1"),
    ("vocab_size", 1.5, "vocab_size must be an integer"),
    ("vocab_size", True, "vocab_size must be an integer"),
    ("num_tokens", "x", "num_tokens must be an integer >= 0, got 'x'"),
    ("num_tokens", -3, "num_tokens must be an integer >= 0"),
    ("tokenizer_hash", 5, "tokenizer_hash must be a string, got 5"),
    ("dtype", ["uint16"], "names dtype"),
])
def test_a_sidecar_field_of_the_wrong_type_is_named(tmp_path, field, value, message):
    # These failed inside the readers (int('abc'), 5[:12], a list looked up in a dict).
    path = write(tmp_path / "t.bin", [1, 2, 3])
    meta = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**meta, field: value}))
    with pytest.raises(UserError, match=f"t.json: {message}" if field != "dtype" else message):
        token_file.open_checked(path, vocab_size=100, tokenizer_hash="a" * 64)


def test_is_token_file_needs_a_sidecar_that_counts_its_tokens(tmp_path):
    tokens = write(tmp_path / "t.bin", np.arange(10), tokenizer_hash="abc")
    assert token_file.is_token_file(tokens)
    text = tmp_path / "t.txt"  # a text file beside a sidecar of its name
    text.write_text("once upon a time", encoding="utf-8")
    assert not token_file.is_token_file(text)
    assert not token_file.is_token_file(write(tmp_path / "raw.bin", np.arange(10), sidecar=False))
    (tmp_path / "settings.json").write_text('{"lr": 3}')
    (tmp_path / "settings.bin").write_bytes(b"\0" * 20)
    assert not token_file.is_token_file(tmp_path / "settings.bin")
    assert not token_file.is_token_file(tmp_path / "missing.bin")


@pytest.mark.parametrize("folder", [".", "/"])
def test_is_token_file_of_a_folder_without_a_name_is_false(folder):
    # Path(".").with_suffix(".json") raised a ValueError, so `train-bpe .` failed with it.
    assert not token_file.is_token_file(folder)


def test_a_uint32_file_whose_sidecar_says_uint16_is_refused(tmp_path):
    # Read as uint16, ids of a 70,000-token vocabulary come out small, every other one 0: the file
    # was accepted and trained on as if it were text.
    ids = np.arange(1000) % 70_000
    path = write(tmp_path / "wide.bin", ids, dtype="uint32", vocab_size=70_000)
    meta = json.loads(path.with_suffix(".json").read_text())
    for sidecar in ({**meta, "dtype": "uint16", "num_tokens": 2000}, {"vocab_size": 70_000}):  # (no dtype: uint16)
        path.with_suffix(".json").write_text(json.dumps(sidecar))
        with pytest.raises(UserError, match=r"dtype uint16 cannot hold the ids of a vocab_size of 70000"):
            token_file.open_checked(path, vocab_size=70_000, context_length=8, what="--data")


def test_ids_beyond_the_sidecar_vocabulary_are_refused(tmp_path):
    # A uint16 file whose sidecar says uint32 (and a vocabulary of 500): its ids, read in pairs,
    # fit a model of 10**8 and were accepted.
    path = write(tmp_path / "narrow.bin", np.arange(1, 1001) % 500, vocab_size=500)
    path.with_suffix(".json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 500, "num_tokens": 500}))
    with pytest.raises(UserError, match=r"narrow.bin holds token id \d+, but its sidecar gives vocab_size=500"):
        token_file.open_checked(path, vocab_size=10**8, context_length=8, what="--data")
