"""encode_corpus: chunked parallel encoding equals encoding the whole text; sidecar; errors; resume."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from scratchlm.errors import UserError
from scratchlm.tokenizer import encode_corpus as ec
from scratchlm.data.token_file import token_dtype
from scratchlm.tokenizer.encode_corpus import encode_corpus
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train import train_bpe

EOT = "<|endoftext|>"
# Whitespace runs of every kind around newlines are where a careless cut changes pretokens.
PIECES = ["the", " cat", " sat", "Once", " upon", "'s", "'ll", "123", "!", "?!", "\n", "\n\n", "\n\n\n",
          " \n", "  \n", "\n ", "\t", "\r\n", "\xa0", "\u3000", "é", "naïve", "日本語", "🙂", " ", "  "]


def random_text(seed: int, n: int, *, eot_every: int | None = None) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(rng.choice(PIECES))
        if eot_every and rng.random() < 1 / eot_every:
            out.append(EOT)
    return "".join(out)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """A 400-entry byte-level BPE trained on random text that contains every piece."""
    path = tmp_path_factory.mktemp("train") / "train.txt"
    path.write_text(random_text(0, 20_000, eot_every=50), encoding="utf-8")
    vocab, merges = train_bpe(path, 400, [EOT], workers=1)
    return Tokenizer(vocab, merges, [EOT])


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    tokenizer.save(directory)
    return directory


def read_bin(path, dtype="<u2") -> np.ndarray:
    return np.fromfile(path, dtype=dtype)


@pytest.mark.parametrize("eot_every", [30, None], ids=["documents", "no-separator"])
def test_parallel_chunks_equal_whole_text_encoding(tokenizer, tokenizer_dir, tmp_path, eot_every):
    text = random_text(1, 30_000, eot_every=eot_every)
    src = tmp_path / "corpus.txt"
    src.write_text(text, encoding="utf-8")
    expected = np.array(tokenizer.encode(text), dtype=np.uint16)
    bounds = ec._find_bounds(src, src.stat().st_size, 3000, EOT if eot_every else None, [EOT])
    assert len(bounds) > 10  # the cuts really happen

    one = encode_corpus(src, tokenizer, tmp_path / "one.bin", num_workers=1, chunk_bytes=3000, progress=False)
    two = encode_corpus(src, tokenizer_dir, tmp_path / "two.bin", num_workers=2, chunk_bytes=3000,
                        progress=False)
    np.testing.assert_array_equal(read_bin(tmp_path / "one.bin"), expected)
    assert (tmp_path / "two.bin").read_bytes() == (tmp_path / "one.bin").read_bytes()
    assert one["num_tokens"] == two["num_tokens"] == len(expected)
    assert one["num_documents"] == two["num_documents"]


def test_sidecar_fields(tokenizer, tmp_path):
    docs = ["One story.\nIt ends.", "", "Two\n\nstories", "three"]
    text = EOT.join(docs) + EOT
    src = tmp_path / "c.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "sub" / "c.bin"  # the parent folder is created
    returned = encode_corpus(src, tokenizer, out, num_workers=1, chunk_bytes=8, progress=False)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert {k: returned[k] for k in meta} == meta
    assert meta == {
        "dtype": "uint16", "vocab_size": tokenizer.vocab_size, "tokenizer_hash": tokenizer.hash,
        "num_documents": 3,  # the empty document between two separators does not count
        "num_tokens": len(tokenizer.encode(text)), "source": str(src.resolve()),
        "source_bytes": len(text.encode("utf-8")),
    }
    assert out.stat().st_size == 2 * meta["num_tokens"]
    assert not (tmp_path / "sub" / "c.bin.partial").exists()
    assert not (tmp_path / "sub" / "c.bin.parts").exists()


def test_large_vocab_uses_uint32(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)}
    vocab[70_000] = EOT.encode()
    tok = Tokenizer(vocab, [], [EOT])
    src = tmp_path / "c.txt"
    src.write_text(f"ab{EOT}c", encoding="utf-8")
    meta = encode_corpus(src, tok, tmp_path / "c.bin", num_workers=1, progress=False)
    assert token_dtype(65_536) == np.dtype("<u2") and token_dtype(65_537) == np.dtype("<u4")
    assert meta["dtype"] == "uint32"
    np.testing.assert_array_equal(read_bin(tmp_path / "c.bin", "<u4"), [97, 98, 70_000, 99])


def test_clear_errors(tokenizer, tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("hello", encoding="utf-8")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(UserError, match="not found"):
        encode_corpus(tmp_path / "missing.txt", tokenizer, tmp_path / "o.bin", progress=False)
    with pytest.raises(UserError, match="is a directory"):
        encode_corpus(tmp_path, tokenizer, tmp_path / "o.bin", progress=False)
    with pytest.raises(UserError, match="output path is a directory"):
        encode_corpus(src, tokenizer, tmp_path, progress=False)
    with pytest.raises(UserError, match="sidecar"):
        encode_corpus(src, tokenizer, tmp_path / "o.json", progress=False)
    with pytest.raises(UserError, match="tokenizer directory not found"):
        encode_corpus(src, tmp_path / "no-tokenizer", tmp_path / "o.bin", progress=False)
    with pytest.raises(UserError, match="tokenizer is not a directory"):  # (it exists: not "not found")
        encode_corpus(src, src, tmp_path / "o.bin", progress=False)
    with pytest.raises(UserError, match="workers"):
        encode_corpus(src, tokenizer, tmp_path / "o.bin", num_workers=0, progress=False)
    # A refused call leaves no output folder behind; a good one makes it.
    with pytest.raises(UserError, match="tokenizer directory not found"):
        encode_corpus(src, tmp_path / "no-tokenizer", tmp_path / "new" / "o.bin", progress=False)
    with pytest.raises(UserError, match="input file is empty"):
        encode_corpus(tmp_path / "empty.txt", tokenizer, tmp_path / "new" / "o.bin", progress=False)
    assert not (tmp_path / "new").exists()
    with pytest.raises(UserError, match="c.txt is a file, not a directory"):
        encode_corpus(src, tokenizer, src / "deeper" / "o.bin", progress=False)
    (tmp_path / "loop").symlink_to("loop")  # a link to itself: resolving it raised RuntimeError
    for out in (tmp_path / "loop", tmp_path / "loop" / "o.bin"):
        with pytest.raises(UserError, match="symbolic link on its path leads back to itself"):
            encode_corpus(src, tokenizer, out, progress=False)
    encode_corpus(src, tokenizer, tmp_path / "new" / "deeper" / "o.bin", progress=False)
    assert (tmp_path / "new" / "deeper" / "o.json").is_file()


def test_invalid_utf8_strict_names_offset_and_replace_encodes(tokenizer, tmp_path):
    src = tmp_path / "bad.txt"
    src.write_bytes(b"good text\nmore\xff\xfe text")
    with pytest.raises(UserError, match=r"not valid UTF-8: byte 0xff at offset 14"):
        encode_corpus(src, tokenizer, tmp_path / "bad.bin", num_workers=1, progress=False)
    assert not (tmp_path / "bad.bin").exists() and not (tmp_path / "bad.json").exists()
    encode_corpus(src, tokenizer, tmp_path / "bad.bin", num_workers=1, errors="replace", progress=False)
    expected = tokenizer.encode(src.read_bytes().decode("utf-8", errors="replace"))
    np.testing.assert_array_equal(read_bin(tmp_path / "bad.bin"), expected)


def test_crash_leaves_no_complete_looking_output_and_rerun_resumes(tokenizer, tmp_path, monkeypatch):
    text = random_text(2, 8_000, eot_every=20)
    src = tmp_path / "c.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "c.bin"
    # a complete earlier output whose sidecar must not survive into the interrupted run
    encode_corpus(src, tokenizer, out, num_workers=1, chunk_bytes=1000, progress=False)
    previous = out.read_bytes()

    real_append, encoded = ec._append_part, []

    def crash_after_three(sink, parts_dir, state):
        if state["appended"] == 3:
            raise KeyboardInterrupt
        real_append(sink, parts_dir, state)

    real_encode = ec._encode_chunk

    def counting_encode(job, *args, **kwargs):
        encoded.append(job[0])
        return real_encode(job, *args, **kwargs)

    monkeypatch.setattr(ec, "_append_part", crash_after_three)
    monkeypatch.setattr(ec, "_encode_chunk", counting_encode)
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(src, tokenizer, out, num_workers=1, chunk_bytes=1000, progress=False)
    assert not out.with_suffix(".json").exists()  # nothing claims completeness
    assert (tmp_path / "c.bin.partial").stat().st_size > 0
    assert out.read_bytes() == previous  # the old file is only replaced by a finished one

    monkeypatch.setattr(ec, "_append_part", real_append)
    encoded.clear()
    meta = encode_corpus(src, tokenizer, out, num_workers=1, chunk_bytes=1000, progress=False)
    assert encoded and min(encoded) >= 4  # parts 0-2 were appended, part 3 was on disk: not redone
    assert meta["encoded_bytes"] < meta["source_bytes"]
    np.testing.assert_array_equal(read_bin(out), tokenizer.encode(text))
    assert json.loads(out.with_suffix(".json").read_text())["num_tokens"] == len(tokenizer.encode(text))


def test_changed_input_discards_resume_state(tokenizer, tmp_path, monkeypatch):
    src = tmp_path / "c.txt"
    src.write_text(random_text(3, 4_000, eot_every=20), encoding="utf-8")
    out = tmp_path / "c.bin"

    def crash(sink, parts_dir, state):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ec, "_append_part", crash)
        with pytest.raises(KeyboardInterrupt):
            encode_corpus(src, tokenizer, out, num_workers=1, chunk_bytes=500, progress=False)
    new_text = random_text(4, 5_000, eot_every=20)
    src.write_text(new_text, encoding="utf-8")
    meta = encode_corpus(src, tokenizer, out, num_workers=1, chunk_bytes=500, progress=False)
    assert meta["encoded_bytes"] == meta["source_bytes"]
    np.testing.assert_array_equal(read_bin(out), tokenizer.encode(new_text))


def test_empty_input_is_a_user_error(tokenizer, tmp_path):
    src = tmp_path / "empty.txt"
    src.write_bytes(b"")
    with pytest.raises(UserError, match="input file is empty"):
        encode_corpus(src, tokenizer, tmp_path / "e.bin", progress=False)
    assert not list(tmp_path.glob("e.*"))


def test_invalid_utf8_leaves_no_resume_state_and_names_the_cli_flag(tokenizer, tmp_path):
    src = tmp_path / "bad.txt"
    src.write_bytes(random_text(6, 4_000).encode("utf-8") + b"\xff tail")
    with pytest.raises(UserError, match="--errors replace") as info:
        encode_corpus(src, tokenizer, tmp_path / "bad.bin", num_workers=1, chunk_bytes=1000, progress=False)
    assert "errors='replace'" in str(info.value)  # the library spelling too
    assert not (tmp_path / "bad.bin.partial").exists() and not (tmp_path / "bad.bin.parts").exists()


_real_encode_chunk = ec._encode_chunk


def _die_on_chunk_5(job, *args, **kwargs):
    """A worker's task (pickled by name, so defined here) that kills its worker on chunk 5."""
    if job[0] == 5:
        os._exit(1)
    return _real_encode_chunk(job, *args, **kwargs)


def test_a_dead_worker_keeps_the_parts_and_a_rerun_resumes(tokenizer, tmp_path, monkeypatch):
    import multiprocessing

    text = random_text(7, 8_000, eot_every=20)
    src = tmp_path / "c.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "c.bin"
    monkeypatch.setattr(ec, "pool_context", lambda: multiprocessing.get_context("fork"))
    with monkeypatch.context() as m:
        m.setattr(ec, "_encode_chunk", _die_on_chunk_5)
        with pytest.raises(UserError, match="worker died.*running the same command again resumes"):
            encode_corpus(src, tokenizer, out, num_workers=2, chunk_bytes=1000, progress=False)
    assert (tmp_path / "c.bin.parts" / "state.json").is_file() and not out.exists()
    encode_corpus(src, tokenizer, out, num_workers=2, chunk_bytes=1000, progress=False)
    np.testing.assert_array_equal(read_bin(out), tokenizer.encode(text))
    assert not (tmp_path / "c.bin.parts").exists() and not (tmp_path / "c.bin.partial").exists()


def test_spawned_workers_reload_the_tokenizer_from_its_directory(tokenizer, tokenizer_dir, tmp_path,
                                                                 monkeypatch):
    # the start method used when the caller runs threads; fork is taken otherwise on Linux
    import multiprocessing

    monkeypatch.setattr(ec, "pool_context", lambda: multiprocessing.get_context("spawn"))
    text = random_text(5, 6_000, eot_every=25)
    src = tmp_path / "c.txt"
    src.write_text(text, encoding="utf-8")
    encode_corpus(src, tokenizer_dir, tmp_path / "c.bin", num_workers=2, chunk_bytes=2000, progress=False)
    np.testing.assert_array_equal(read_bin(tmp_path / "c.bin"), tokenizer.encode(text))


def test_refuses_to_replace_a_file_that_is_not_a_token_file(tokenizer, tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("hello world", encoding="utf-8")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes", encoding="utf-8")
    with pytest.raises(UserError, match="notes.txt exists and is not a token file"):
        encode_corpus(src, tokenizer, notes, progress=False)
    assert notes.read_text(encoding="utf-8") == "my notes" and not (tmp_path / "notes.json").exists()
    config = tmp_path / "settings.json"
    config.write_text('{"lr": 3}', encoding="utf-8")
    with pytest.raises(UserError, match="settings.json exists and is not a token file or its sidecar"):
        encode_corpus(src, tokenizer, tmp_path / "settings.bin", progress=False)
    assert config.read_text(encoding="utf-8") == '{"lr": 3}' and not (tmp_path / "settings.bin").exists()
    # A token file is replaced, as is one whose rerun failed on bad input (its sidecar is put back).
    out = tmp_path / "c.bin"
    encode_corpus(src, tokenizer, out, progress=False)
    src.write_bytes(b"hello \xff")
    with pytest.raises(UserError, match="not valid UTF-8"):
        encode_corpus(src, tokenizer, out, progress=False)
    np.testing.assert_array_equal(read_bin(out), tokenizer.encode("hello world"))
    assert json.loads(out.with_suffix(".json").read_text())["num_tokens"] == len(tokenizer.encode("hello world"))
    encode_corpus(src, tokenizer, out, errors="replace", progress=False)
    np.testing.assert_array_equal(read_bin(out), tokenizer.encode("hello \ufffd"))


def test_an_output_path_ending_in_a_slash_is_refused(tokenizer, tmp_path):
    # "out/" was written as the token file "out" beside the sidecar "out.json".
    src = tmp_path / "c.txt"
    src.write_text("hello", encoding="utf-8")
    with pytest.raises(UserError, match=r"output path .*out/ names a directory \(give a file name such as .*out/train.bin"):
        encode_corpus(src, tokenizer, f"{tmp_path}/out/", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]
