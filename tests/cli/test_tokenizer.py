from __future__ import annotations

import json
from pathlib import Path

import pytest

from scratchlm.cli import main
from scratchlm.errors import UserError
from scratchlm.cli.tokenizer import tokenizer_stats_command, train_bpe_command
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train import train_bpe


@pytest.fixture
def corpus(tmp_path, tinystories_text):
    path = tmp_path / "stories.txt"
    path.write_text(tinystories_text[:100_000].replace("\n\n", "<|endoftext|>"), encoding="utf-8")
    return path


def test_train_bpe_command_writes_tokenizer_and_summary(corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    assert train_bpe_command([str(corpus), "--vocab-size", "500", "--special-token", "<|endoftext|>",
                              "--out", str(out), "--quiet"]) == 0
    tok = Tokenizer.load(out)
    vocab, merges = train_bpe(corpus, 500, ["<|endoftext|>"])
    assert tok.vocab == vocab and tok.merges == merges and tok.eot_id == 499
    summary = json.loads((out / "train_bpe.json").read_text())
    assert summary["vocab_size"] == 500 and summary["tokenizer_hash"] == tok.hash
    assert summary["total_s"] >= summary["merge_s"] > 0 and summary["peak_rss_mb"] > 0
    printed = capsys.readouterr().out
    for word in ("pretokenize", "merges", "total", "peak RSS"):
        assert word in printed


def test_tokenizer_stats_command(corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    train_bpe_command([str(corpus), "--vocab-size", "400", "--special-token", "<|endoftext|>",
                       "--out", str(out), "--quiet"])
    capsys.readouterr()
    assert tokenizer_stats_command([str(out), str(corpus), "--json", "--top", "5"]) == 0
    stats = json.loads(capsys.readouterr().out)
    tok = Tokenizer.load(out)
    ids = tok.encode(corpus.read_text(encoding="utf-8"))
    assert stats["num_tokens"] == len(ids)
    assert stats["bytes_per_token"] == pytest.approx(corpus.stat().st_size / len(ids))
    assert stats["distinct_tokens_used"] == len(set(ids))
    assert 0 < stats["vocab_used_fraction"] <= 1
    assert len(stats["longest_tokens"]) == 5 and len(stats["most_frequent_tokens"]) == 5
    assert sum(stats["token_bytes_histogram_vocab"].values()) == 399  # all but the special token
    assert sum(stats["token_bytes_histogram_sample"].values()) == len(ids)
    assert tokenizer_stats_command([str(out), str(corpus), "--max-mb", "0.01"]) == 0
    report = capsys.readouterr().out
    assert "bytes/token" in report and "longest tokens" in report


def test_bad_input_is_one_line_error(tmp_path, corpus, capsys):
    assert main(["train-bpe", str(tmp_path / "missing.txt"), "--vocab-size", "300", "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["train-bpe", str(corpus), "--vocab-size", "100", "--out", str(tmp_path / "o")]) == 2
    assert "at least 256" in capsys.readouterr().err
    assert main(["tokenizer-stats", str(tmp_path), str(corpus)]) == 2
    assert "not a tokenizer directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_bpe_command([str(corpus), "--out", str(tmp_path / "o")])  # --vocab-size is required
    with pytest.raises(UserError):
        tokenizer_stats_command([str(tmp_path), str(corpus), "--max-mb", "0"])


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_tokenizer_stats_max_mb_must_be_a_positive_number(tmp_path, corpus, capsys, value):
    assert main(["tokenizer-stats", str(tmp_path), str(corpus), "--max-mb", value]) == 2
    err = capsys.readouterr().err.strip()
    assert "--max-mb must be a positive number" in err and "\n" not in err


def test_tokenizer_stats_max_mb_too_small_for_one_character(tmp_path, corpus, capsys):
    # Said "the sample is empty" of a file that is not.
    tok = tmp_path / "tok"
    assert main(["train-bpe", str(corpus), "--vocab-size", "300", "--out", str(tok), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["tokenizer-stats", str(tok), str(corpus), "--max-mb", "1e-7"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"scratchlm tokenizer-stats: error: {corpus}: --max-mb 1e-07 reads no whole character of it; "
                   "give a larger --max-mb")


def test_train_bpe_refuses_to_replace_a_tokenizer_before_training(corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "tok"
    assert main(["train-bpe", str(corpus), "--vocab-size", "400", "--out", str(out), "--quiet"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr("scratchlm.tokenizer.train.train_bpe", no_training)
    assert main(["train-bpe", str(corpus), "--vocab-size", "300", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"scratchlm train-bpe: error: {out} already holds a tokenizer: vocab.json, merges.txt, "
                   "special_tokens.json, tokenizer.json (pass --overwrite to replace it)")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # One tokenizer file is enough to refuse.
    (out / "vocab.json").unlink()
    (out / "special_tokens.json").unlink()
    (out / "tokenizer.json").unlink()
    assert main(["train-bpe", str(corpus), "--vocab-size", "300", "--out", str(out), "--quiet"]) == 2
    assert "already holds a tokenizer: merges.txt (pass --overwrite" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no file can be created")
@pytest.mark.parametrize("out", ["/proc", "/proc/tok"])
def test_train_bpe_refuses_an_out_it_cannot_write_before_training(corpus, capsys, monkeypatch, out):
    # Trained the whole tokenizer first, then failed to save it.
    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr("scratchlm.tokenizer.train.train_bpe", no_training)
    assert main(["train-bpe", str(corpus), "--vocab-size", "300", "--out", out, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--out {out}: cannot" in err and "write in /proc" in err and "\n" not in err


def test_train_bpe_overwrite_replaces_the_tokenizer(corpus, tmp_path):
    out = tmp_path / "tok"
    train_bpe_command([str(corpus), "--vocab-size", "400", "--out", str(out), "--quiet"])
    assert train_bpe_command([str(corpus), "--vocab-size", "300", "--special-token", "<|endoftext|>",
                              "--out", str(out), "--overwrite", "--quiet"]) == 0
    tok = Tokenizer.load(out)
    vocab, merges = train_bpe(corpus, 300, ["<|endoftext|>"])
    assert tok.vocab == vocab and tok.merges == merges and tok.eot_id == 299
    assert json.loads((out / "train_bpe.json").read_text())["vocab_size"] == 300


def test_train_bpe_writes_into_an_empty_folder_or_one_without_a_tokenizer(corpus, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train_bpe_command([str(corpus), "--vocab-size", "300", "--out", str(empty), "--quiet"]) == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("corpus notes\n")
    assert train_bpe_command([str(corpus), "--vocab-size", "300", "--out", str(other), "--quiet"]) == 0
    assert Tokenizer.load(empty).hash == Tokenizer.load(other).hash
    assert (other / "notes.txt").read_text() == "corpus notes\n"


@pytest.mark.parametrize("special", ["#", "\n"])
def test_train_bpe_with_a_one_byte_special_token_loads_back_what_was_trained(corpus, tmp_path, special):
    out = tmp_path / "tok"
    assert train_bpe_command([str(corpus), "--vocab-size", "400", "--special-token", "<|endoftext|>",
                              "--special-token", special, "--out", str(out), "--quiet"]) == 0
    vocab, merges = train_bpe(corpus, 400, ["<|endoftext|>", special])
    tok = Tokenizer.load(out)
    assert tok.vocab == vocab and tok.merges == merges
    assert tok.special_token_ids == {"<|endoftext|>": 398, special: 399}
    assert tok.encode(f"a{special}b") == tok.encode("a") + [399] + tok.encode("b")
    assert json.loads((out / "train_bpe.json").read_text())["tokenizer_hash"] == tok.hash


def test_tokenizer_stats_refuses_a_token_file_as_its_sample(corpus, tmp_path, capsys):
    # A token file read as text gave statistics of its bytes: 1.000 bytes/token, all single bytes.
    tok = tmp_path / "tok"
    assert main(["train-bpe", str(corpus), "--vocab-size", "300", "--out", str(tok), "--quiet"]) == 0
    tokens = tmp_path / "stories.bin"
    assert main(["encode", str(corpus), "--tokenizer", str(tok), "--out", str(tokens)]) == 0
    capsys.readouterr()
    assert main(["tokenizer-stats", str(tok), str(tokens)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a token file (written by `scratchlm encode`), not text" in err and "\n" not in err
    renamed = tmp_path / "stories.dat"  # without its sidecar: its NUL bytes give it away
    renamed.write_bytes(tokens.read_bytes())
    assert main(["tokenizer-stats", str(tok), str(renamed)]) == 2
    assert "binary data (NUL bytes), not a text sample" in capsys.readouterr().err
    (tmp_path / "stories.json").write_text(tokens.with_suffix(".json").read_text())
    assert main(["tokenizer-stats", str(tok), str(corpus)]) == 0  # a text file beside a sidecar of its name


def test_train_bpe_and_encode_refuse_a_token_file_as_their_text(corpus, tmp_path, capsys):
    # A token file read as text trained a tokenizer on its bytes (or encoded them) without a word.
    tok = tmp_path / "tok"
    assert main(["train-bpe", str(corpus), "--vocab-size", "300", "--out", str(tok), "--quiet"]) == 0
    tokens = tmp_path / "stories.bin"
    assert main(["encode", str(corpus), "--tokenizer", str(tok), "--out", str(tokens), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train-bpe", str(tokens), "--vocab-size", "300", "--out", str(tmp_path / "tok2"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "stories.bin is a token file (written by `scratchlm encode`), not text" in err and "\n" not in err
    assert not (tmp_path / "tok2").exists()
    assert main(["encode", str(tokens), "--tokenizer", str(tok), "--out", str(tmp_path / "again.bin")]) == 2
    assert "input is a token file" in capsys.readouterr().err
    assert not (tmp_path / "again.bin").exists()


def test_tokenizer_stats_reads_the_whole_sample_when_max_mb_is_huge(corpus, tmp_path, capsys):
    # An OverflowError of the read before.
    out = tmp_path / "tok"
    assert main(["train-bpe", str(corpus), "--vocab-size", "300", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["tokenizer-stats", str(out), str(corpus), "--max-mb", "1e300", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sample_bytes"] == corpus.stat().st_size


@pytest.mark.parametrize("name, extra", [("train_bpe.json", []), ("merges.txt", ["--overwrite"])])
def test_train_bpe_refuses_an_input_it_would_write_over(corpus, tmp_path, capsys, name, extra):
    # A corpus called train_bpe.json inside --out was replaced by the summary of its own training
    # (merges.txt, vocab.json ... by the tokenizer, once --overwrite was passed).
    out = tmp_path / "tok"
    out.mkdir()
    text = out / name
    text.write_bytes(corpus.read_bytes())
    assert main(["train-bpe", str(text), "--vocab-size", "300", "--out", str(out), "--quiet", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert f"is the {name} that train-bpe writes in --out" in err and "\n" not in err
    assert text.read_bytes() == corpus.read_bytes()
    assert sorted(p.name for p in out.iterdir()) == [name]
