"""The small-run corpus: the standard library sources, a user's text file, a downloaded dataset."""

import pytest

from scratchlm.data import corpus
from scratchlm.errors import UserError


def test_stdlib_corpus_is_deterministic_and_split_by_name():
    docs = list(corpus.stdlib_documents())
    assert len(docs) > 100 and [name for name, _ in docs] == [name for name, _ in corpus.stdlib_documents()]
    train, valid = corpus.split_documents(docs, 200_000)
    assert 180_000 < len(train.encode()) <= 200_000 and 0 < len(valid.encode()) <= 20_000
    held_out = {name for name, _ in docs if corpus._hash(name) % 10 == 0}
    texts = {text for name, text in docs if name in held_out}
    assert not any(d in texts for d in train.split(corpus.EOT))


def test_user_text_file_and_dataset_names(tmp_path):
    lines = "".join(f"line {i} of a small user corpus\n" for i in range(2000))
    (tmp_path / "mine.txt").write_text(lines)
    what, train, valid = corpus.build_corpus(str(tmp_path / "mine.txt"), tmp_path, 30_000)
    assert what.endswith("mine.txt") and train + valid == lines[: len(train) + len(valid)]
    assert len(valid) > 0 and train.endswith("\n")
    with pytest.raises(UserError, match="scratchlm download tinystories-train"):
        corpus.build_corpus("tinystories", tmp_path, 30_000)
    (tmp_path / "TinyStoriesV2-GPT4-train.txt").write_text(corpus.EOT.join(f"Story {i}." for i in range(500)))
    (tmp_path / "TinyStoriesV2-GPT4-valid.txt").write_text(corpus.EOT.join(f"Tale {i}." for i in range(500)))
    what, train, valid = corpus.build_corpus("tinystories", tmp_path, 2000)
    assert train.startswith("Story 0.") and valid.startswith("Tale 0.") and len(train) <= 2000
    with pytest.raises(UserError, match="neither a text file nor a dataset"):
        corpus.build_corpus("no-such-thing", tmp_path, 1000)


def test_building_a_corpus_imports_no_torch(tmp_path):
    import subprocess
    import sys

    (tmp_path / "mine.txt").write_text("a line of text\n" * 500)
    code = (f"import sys; from scratchlm.data.corpus import build_corpus; build_corpus({str(tmp_path / 'mine.txt')!r}, "
            "None, 2000); assert 'torch' not in sys.modules and 'numpy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_file_that_is_not_utf8_is_refused(tmp_path):
    # Bytes that are not UTF-8 were dropped silently ("café" trained as "caf").
    (tmp_path / "latin1.txt").write_bytes("un café crème\n".encode("latin-1") * 500)
    with pytest.raises(UserError, match=r"latin1.txt: not valid UTF-8 \(byte 0xe9 at offset 6\)"):
        corpus.build_corpus(str(tmp_path / "latin1.txt"), tmp_path, 30_000)


def test_a_character_cut_at_the_size_limit_is_dropped(tmp_path):
    (tmp_path / "utf8.txt").write_text("é" * 100, encoding="utf-8")
    assert corpus.read_head(tmp_path / "utf8.txt", 11) == "é" * 5


def test_a_size_limit_past_any_file_reads_the_whole_file(tmp_path):
    # quickstart --corpus-mb 1e300 ended in an OverflowError (a read of more bytes than an index holds).
    lines = "".join(f"line {i} of a small user corpus\n" for i in range(2000))
    (tmp_path / "mine.txt").write_text(lines)
    assert corpus.read_head(tmp_path / "mine.txt", int(1e300 * 1e6)) == lines
    _, train, valid = corpus.build_corpus(str(tmp_path / "mine.txt"), tmp_path, int(1e300 * 1e6))
    assert train + valid == lines


@pytest.mark.parametrize("content", ["", " \n\n\t", "<|endoftext|>\n<|endoftext|>"], ids=["empty", "blank", "separators"])
def test_a_file_without_text_is_named(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(UserError, match=rf"^{path}: no text to train on"):
        corpus.build_corpus(str(path), tmp_path, 10_000)
