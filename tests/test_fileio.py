from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scratchlm import fileio
from scratchlm.errors import UserError
from scratchlm.fileio import atomic_open, write_text_atomic

SRC = Path(__file__).resolve().parents[1] / "src"


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_writes_a_new_file_and_replaces_an_old_one(tmp_path):
    path = tmp_path / "config.toml"
    assert write_text_atomic(path, "a = 1\n") == path
    assert path.read_text(encoding="utf-8") == "a = 1\n"
    write_text_atomic(str(path), "naïve = \"café\"\n")
    assert path.read_text(encoding="utf-8") == "naïve = \"café\"\n"
    assert _names(tmp_path) == ["config.toml"]


def test_the_new_file_has_the_permissions_write_text_gives(tmp_path):
    (tmp_path / "plain.txt").write_text("x", encoding="utf-8")
    write_text_atomic(tmp_path / "atomic.txt", "x")
    assert (tmp_path / "atomic.txt").stat().st_mode == (tmp_path / "plain.txt").stat().st_mode


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary_file(tmp_path, cut_writes):
    path = tmp_path / "vocab.json"
    path.write_text('{"old": 0}\n', encoding="utf-8")
    cut_writes()
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(path, json.dumps({f"token{i}": i for i in range(1000)}))
    assert path.read_text(encoding="utf-8") == '{"old": 0}\n'
    assert _names(tmp_path) == ["vocab.json"]


def test_a_failed_fsync_replaces_nothing(tmp_path, monkeypatch):
    path = tmp_path / "samples.txt"
    path.write_text("old\n", encoding="utf-8")

    def fail(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fileio.os, "fsync", fail)
    with pytest.raises(OSError, match="Input/output error"):
        write_text_atomic(path, "new\n")
    assert path.read_text(encoding="utf-8") == "old\n" and _names(tmp_path) == ["samples.txt"]



def test_atomic_open_streams_text_or_bytes_into_place(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("old\n", encoding="utf-8")
    with atomic_open(path) as f:
        for i in range(3):
            f.write(json.dumps({"i": i, "s": "é"}) + "\n")
        assert path.read_text(encoding="utf-8") == "old\n"  # nothing visible before the block ends
    assert path.read_text(encoding="utf-8").splitlines() == [json.dumps({"i": i, "s": "é"}) for i in range(3)]
    with atomic_open(str(tmp_path / "blob.bin"), "wb") as f:
        f.write(b"\x00\xff")
    assert (tmp_path / "blob.bin").read_bytes() == b"\x00\xff"
    assert _names(tmp_path) == ["blob.bin", "records.jsonl"]
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(path, "a"):
            pass


def test_atomic_open_keeps_the_old_file_when_the_block_raises(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("old\n", encoding="utf-8")
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(path) as f:
            f.write("half of the new\n")
            f.flush()
            raise KeyboardInterrupt
    assert path.read_text(encoding="utf-8") == "old\n" and _names(tmp_path) == ["records.jsonl"]


def test_atomic_open_keeps_the_old_file_when_a_streamed_write_fails(tmp_path, cut_writes):
    path = tmp_path / "records.jsonl"
    path.write_text("old\n", encoding="utf-8")
    cut_writes()
    with pytest.raises(OSError, match="No space left"):
        with atomic_open(path) as f:
            f.write("x" * 1000)
    assert path.read_text(encoding="utf-8") == "old\n" and _names(tmp_path) == ["records.jsonl"]

# Each snippet writes something big into DIR through one of the callers, in a process whose
# file size limit (RLIMIT_FSIZE) makes every write past LIMIT bytes fail with EFBIG: the way a
# full disk, or a process killed mid-write, cuts a file short.
LIMIT = 512
CALLERS = {
    "save_tokenizer": """
        from scratchlm.tokenizer.tokenizer import Tokenizer
        vocab = {i: bytes([i]) for i in range(256)}
        merges = [(b"a", b"b"), (b"ab", b"c"), (b"abc", b"d")]
        vocab.update({256 + k: a + b for k, (a, b) in enumerate(merges)})
        Tokenizer(vocab, merges, ["<|endoftext|>", "<|pad|>"]).save(DIR)
    """,
    "save_config": """
        from scratchlm.config import save_config
        from scratchlm.train.config import TrainConfig
        save_config(TrainConfig(), DIR / "config.toml")
    """,
    "bench_write_json": """
        from scratchlm.bench.results import write_json
        write_json(DIR / "results.json", [{"row": i, "tokens_per_s": 1e6} for i in range(100)])
    """,
    "eval_write_jsonl": """
        from scratchlm.align.evaluate import write_jsonl
        write_jsonl([{"prompt": "q" * 40, "response": "a" * 40, "reward": 1.0}] * 100, DIR / "results.jsonl")
    """,
}


def _old_files(directory: Path) -> None:
    """Small versions of the files the callers write (the content a failed write must keep)."""
    from scratchlm.tokenizer.tokenizer import Tokenizer

    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(directory)
    (directory / "config.toml").write_text("[model]\nd_model = 64\n", encoding="utf-8")
    (directory / "results.json").write_text("[]", encoding="utf-8")
    (directory / "results.jsonl").write_text('{"prompt": "q", "response": "a", "reward": 0.0}\n', encoding="utf-8")


@pytest.mark.skipif(sys.platform == "win32", reason="needs RLIMIT_FSIZE")
@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_a_caller_cut_short_by_a_file_size_limit_keeps_its_old_files(tmp_path, caller):
    _old_files(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    script = textwrap.dedent("""
        import resource, signal, sys
        from pathlib import Path
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        DIR = Path(sys.argv[1])
        try:
        {body}
        except OSError as exc:
            print("failed:", exc.strerror)
        else:
            print("written")
    """).format(limit=LIMIT, body=textwrap.indent(textwrap.dedent(CALLERS[caller]).strip(), "    "))
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "failed: File too large"
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing cut, nothing left over


def test_exchange_paths_swaps_two_directories_or_says_it_cannot(tmp_path):
    from scratchlm.fileio import exchange_paths

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "name").write_text(d.name)
    if not exchange_paths(a, b):  # another system: nothing changed
        assert (a / "name").read_text() == "a" and (b / "name").read_text() == "b"
        return
    assert (a / "name").read_text() == "b" and (b / "name").read_text() == "a"
    with pytest.raises(OSError):
        exchange_paths(a, tmp_path / "missing")


def test_copy_tree_atomic_replaces_a_copy_with_no_moment_without_one(tmp_path, monkeypatch):
    import scratchlm.fileio as fileio

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "vocab.json").write_text("new")
    dst.mkdir()
    (dst / "vocab.json").write_text("old")
    (dst / "stale.txt").write_text("only in the old copy")
    renames = []
    real_rename = os.rename
    monkeypatch.setattr(fileio.os, "rename", lambda a, b: (renames.append((a, b)), real_rename(a, b)))
    swapped = []
    real_exchange = fileio.exchange_paths
    monkeypatch.setattr(fileio, "exchange_paths", lambda a, b: swapped.append(real_exchange(a, b)) or swapped[-1])
    fileio.copy_tree_atomic(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["vocab.json"] and (dst / "vocab.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # the old copy is gone
    if swapped == [True]:
        assert renames == []  # one atomic exchange: dst never missing
    else:  # the two renames elsewhere
        assert len(renames) == 2


def test_copy_tree_atomic_without_the_exchange_renames_twice(tmp_path, monkeypatch):
    import scratchlm.fileio as fileio

    monkeypatch.setattr(fileio, "exchange_paths", lambda a, b: False)
    src, dst = tmp_path / "src", tmp_path / "dst"
    for d, text in ((src, "new"), (dst, "old")):
        d.mkdir()
        (d / "f").write_text(text)
    fileio.copy_tree_atomic(src, dst)
    assert (dst / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_check_writable_dir_takes_a_directory_that_is_there_or_can_be_made_and_leaves_nothing(tmp_path):
    (tmp_path / "runs").mkdir()
    fileio.check_writable_dir(tmp_path / "runs", "--out runs")
    fileio.check_writable_dir(tmp_path / "new" / "deeper", "--out new/deeper")
    assert _names(tmp_path) == ["runs"] and _names(tmp_path / "runs") == []
    (tmp_path / "notes.txt").write_text("keep\n")
    with pytest.raises(UserError, match=r"^--out x: .*notes.txt is a file, not a directory$"):
        fileio.check_writable_dir(tmp_path / "notes.txt" / "deeper", "--out x")


def test_check_writable_dir_refuses_a_symbolic_link_loop(tmp_path):
    # Passed (the loop "does not exist", its folder takes files): train-bpe --out LOOP trained,
    # then stopped with "RuntimeError: Symlink loop" when saving.
    (tmp_path / "loop").symlink_to("loop")
    for directory in (tmp_path / "loop", tmp_path / "loop" / "deeper"):
        with pytest.raises(UserError, match=r"^--out x: Too many levels of symbolic links: .*loop"):
            fileio.check_writable_dir(directory, "--out x")
    (tmp_path / "dangling").symlink_to("missing")  # a link to a folder yet to be made is fine
    fileio.check_writable_dir(tmp_path / "dangling", "--out x")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no file can be created")
def test_check_writable_dir_refuses_a_directory_where_no_file_can_be_created():
    with pytest.raises(UserError, match=r"^--out x: cannot write in /proc \("):
        fileio.check_writable_dir("/proc", "--out x")
    with pytest.raises(UserError, match=r"^--out x: cannot create /proc/missing: cannot write in /proc \("):
        fileio.check_writable_dir("/proc/missing", "--out x")


def test_replacing_tree_leaves_dst_as_it_was_when_the_block_raises(tmp_path):
    dst = tmp_path / "tok"
    dst.mkdir()
    (dst / "vocab.json").write_text("old")
    with pytest.raises(OSError, match="cut"), fileio.replacing_tree(dst) as staging:
        (staging / "vocab.json").write_text("new")
        raise OSError("cut")
    assert _names(tmp_path) == ["tok"] and (dst / "vocab.json").read_text() == "old"
    with fileio.replacing_tree(dst) as staging:
        (staging / "merges.txt").write_text("new")
    assert _names(tmp_path) == ["tok"] and _names(dst) == ["merges.txt"]
