"""`scratchlm encode` and `scratchlm download` through the CLI entry point."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from scratchlm.cli import main
from scratchlm.data.batch import open_tokens
from scratchlm.data.registry import MIRROR_ENV
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train import train_bpe

EOT = "<|endoftext|>"
STORY = "Once upon a time there was a little cat. It liked to sit in the sun.\n"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cmd")
    corpus = folder / "train.txt"
    corpus.write_text(EOT.join(STORY * (i % 3 + 1) for i in range(200)), encoding="utf-8")
    vocab, merges = train_bpe(corpus, 300, [EOT], workers=1)
    Tokenizer(vocab, merges, [EOT]).save(folder / "tok")
    return folder / "tok"


def test_encode_command_writes_tokens_and_reports(tokenizer_dir, tmp_path, capsys):
    text = EOT.join(f"{STORY}Story number {i}.\n" for i in range(300))
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "in.bin"
    assert main(["encode", str(tmp_path / "in.txt"), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                 "--workers", "2", "--chunk-mb", "0.005", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    tokens = open_tokens(out)
    expected = Tokenizer.load(tokenizer_dir).encode(text)
    np.testing.assert_array_equal(tokens, expected)
    assert f"{len(expected):,} tokens (uint16)" in printed and "300 documents" in printed
    assert "MB/s" in printed and f"{len(text.encode()) / len(expected):.2f} bytes/token" in printed
    assert json.loads(out.with_suffix(".json").read_text())["num_documents"] == 300


def test_encode_command_errors_are_one_line(tokenizer_dir, tmp_path, capsys):
    assert main(["encode", str(tmp_path / "missing.txt"), "--tokenizer", str(tokenizer_dir),
                 "--out", str(tmp_path / "o.bin")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("scratchlm encode: error: input file not found") and "\n" not in err
    (tmp_path / "bad.txt").write_bytes(b"ok\xc3(")
    assert main(["encode", str(tmp_path / "bad.txt"), "--tokenizer", str(tokenizer_dir),
                 "--out", str(tmp_path / "o.bin"), "--no-progress"]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


def test_encode_command_refuses_to_replace_a_token_file_without_overwrite(tokenizer_dir, tmp_path, capsys):
    # A second encode into the same --out (a typo'd input, say) replaced the token file silently.
    (tmp_path / "train.txt").write_text(EOT.join(STORY * 3 for _ in range(50)), encoding="utf-8")
    (tmp_path / "valid.txt").write_text(STORY, encoding="utf-8")
    out = tmp_path / "train.bin"
    args = ["--tokenizer", str(tokenizer_dir), "--out", str(out), "--no-progress"]
    assert main(["encode", str(tmp_path / "train.txt"), *args]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["encode", str(tmp_path / "valid.txt"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"scratchlm encode: error: {out} already holds a token file (with its sidecar train.json); "
                   "pass --overwrite to replace it, or choose another --out")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
    assert main(["encode", str(tmp_path / "valid.txt"), *args, "--overwrite"]) == 0
    np.testing.assert_array_equal(open_tokens(out), Tokenizer.load(tokenizer_dir).encode(STORY))


def test_download_command_with_mirror_flag_and_env(http_server, tmp_path, capsys, monkeypatch):
    data = b"tiny valid split\n" * 1000
    http_server.files["TinyStoriesV2-GPT4-valid.txt"] = data
    digest = hashlib.sha256(data).hexdigest()
    assert main(["download", "tinystories-valid", "--out-dir", str(tmp_path / "d"), "--mirror",
                 http_server.url, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"sha256 {digest} (not verified" in printed
    assert (tmp_path / "d" / "TinyStoriesV2-GPT4-valid.txt").read_bytes() == data

    monkeypatch.setenv(MIRROR_ENV, http_server.url)
    assert main(["download", "tinystories-valid", "--out-dir", str(tmp_path / "e"), "--sha256", digest,
                 "--no-progress"]) == 0
    assert f"sha256 {digest} (verified)" in capsys.readouterr().out

    assert main(["download", "owt-valid", "--out-dir", str(tmp_path / "e"), "--retries", "0",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("scratchlm download: error: HTTP 404") and "\n" not in err


def test_download_list(capsys):
    assert main(["download", "--list"]) == 0
    printed = capsys.readouterr().out
    for name in ("tinystories-train", "tinystories-valid", "owt-train", "owt-valid"):
        assert name in printed
    assert "owt_train.txt.gz" in printed


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_encode_chunk_mb_must_be_positive(tokenizer_dir, tmp_path, capsys, value):
    # 0 and -1 were quietly taken as 1-byte units of work, nan stopped with a ValueError.
    (tmp_path / "in.txt").write_text(STORY, encoding="utf-8")
    out = tmp_path / "in.bin"
    assert main(["encode", str(tmp_path / "in.txt"), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                 "--chunk-mb", value, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--chunk-mb must be a positive number of MB" in err and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize("extra, message", [
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds"),
    (["--timeout", "1e308"], "--timeout must be a positive number of seconds, at most 1e+09"),  # (OverflowError)
    (["--retries", "-1"], "--retries must be >= 0"),
])
def test_download_checks_timeout_and_retries(tmp_path, capsys, extra, message):
    assert main(["download", "tinystories-valid", "--out-dir", str(tmp_path), "--mirror", "http://127.0.0.1:9",
                 "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
