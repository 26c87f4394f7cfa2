"""download_dataset against a local HTTP server (127.0.0.1, free port): resume, checksums, errors."""

from __future__ import annotations

import gzip
import hashlib
import os

import pytest

from scratchlm.data import download as dl
from scratchlm.data.download import DownloadError, download_dataset
from scratchlm.data.registry import DATASETS, MIRROR_ENV
from scratchlm.errors import UserError

TEXT = b"".join(b"Once upon a time story %d.\n<|endoftext|>" % i for i in range(40_000))  # ~1.6 MB
OWT = b"Web text line %d\n" % 7 * 50_000


@pytest.fixture
def server(http_server):
    http_server.files["TinyStoriesV2-GPT4-valid.txt"] = TEXT
    http_server.files["owt_valid.txt.gz"] = gzip.compress(OWT)
    return http_server


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(server, tmp_path, name="tinystories-valid", **kwargs):
    kwargs.setdefault("progress", False)
    kwargs.setdefault("retry_wait", 0.01)
    kwargs.setdefault("timeout", 5)
    return download_dataset(name, tmp_path, mirror=server.url, **kwargs)


def test_download_via_env_mirror_writes_file_and_checksum(server, tmp_path, monkeypatch):
    monkeypatch.setenv(MIRROR_ENV, server.url)
    result = download_dataset("tinystories-valid", tmp_path / "data", progress=False)
    final = tmp_path / "data" / "TinyStoriesV2-GPT4-valid.txt"
    assert result.path == final and final.read_bytes() == TEXT
    assert result.sha256 == sha(TEXT) and not result.verified and result.fetched
    assert (tmp_path / "data" / "TinyStoriesV2-GPT4-valid.txt.sha256").read_text() == \
        f"{sha(TEXT)}  TinyStoriesV2-GPT4-valid.txt\n"
    assert sorted(os.listdir(tmp_path / "data")) == ["TinyStoriesV2-GPT4-valid.txt",
                                                     "TinyStoriesV2-GPT4-valid.txt.sha256"]
    # a second call finds the file and does not ask the server again
    again = download_dataset("tinystories-valid", tmp_path / "data", progress=False, sha256=sha(TEXT))
    assert not again.fetched and again.verified and len(server.requests) == 1


def test_gzip_entry_is_unpacked_and_checksummed_as_served(server, tmp_path):
    result = fetch(server, tmp_path, "owt-valid", sha256=sha(server.files["owt_valid.txt.gz"]))
    assert result.verified and result.path == tmp_path / "owt_valid.txt"
    assert result.path.read_bytes() == OWT
    assert sorted(os.listdir(tmp_path)) == ["owt_valid.txt", "owt_valid.txt.sha256"]
    assert fetch(server, tmp_path, "owt-valid", sha256=result.sha256).verified  # via the .sha256 file


def test_checksum_mismatch_keeps_the_file_as_corrupt(server, tmp_path):
    wrong = "0" * 64
    with pytest.raises(DownloadError, match="sha256 mismatch.*expected 0{64}, got " + sha(TEXT)):
        fetch(server, tmp_path, sha256=wrong)
    assert (tmp_path / "TinyStoriesV2-GPT4-valid.txt.corrupt").read_bytes() == TEXT
    assert not (tmp_path / "TinyStoriesV2-GPT4-valid.txt").exists()
    # an existing final file that fails verification is set aside the same way
    fetch(server, tmp_path)
    with pytest.raises(DownloadError, match="mismatch"):
        fetch(server, tmp_path, sha256=wrong)
    assert not (tmp_path / "TinyStoriesV2-GPT4-valid.txt").exists()
    with pytest.raises(UserError, match="64 hexadecimal"):
        fetch(server, tmp_path, sha256="abc")


def test_dropped_connection_is_resumed_with_range_across_calls(server, tmp_path):
    server.mode = "drop"
    with pytest.raises(DownloadError, match=r"failed: .*run again to resume"):
        fetch(server, tmp_path, retries=0)
    partial = tmp_path / "TinyStoriesV2-GPT4-valid.txt.partial"
    kept = partial.stat().st_size
    assert 0 < kept < len(TEXT) and not (tmp_path / "TinyStoriesV2-GPT4-valid.txt").exists()
    result = fetch(server, tmp_path, sha256=sha(TEXT))
    assert server.requests[-1] == ("TinyStoriesV2-GPT4-valid.txt", f"bytes={kept}-")
    assert result.path.read_bytes() == TEXT and not partial.exists()


def test_dropped_connection_is_retried_within_one_call(server, tmp_path):
    server.mode = "drop"
    result = fetch(server, tmp_path, retries=2, sha256=sha(TEXT))
    assert result.path.read_bytes() == TEXT
    assert [r for _, r in server.requests][0] is None and server.requests[1][1].startswith("bytes=")


def test_server_ignoring_range_restarts_cleanly(server, tmp_path):
    server.mode = "ignore_range"
    (tmp_path / "TinyStoriesV2-GPT4-valid.txt.partial").write_bytes(b"garbage that is not a prefix")
    result = fetch(server, tmp_path, sha256=sha(TEXT))
    assert server.requests[0][1] == "bytes=28-"  # asked to resume, got the whole file
    assert result.path.read_bytes() == TEXT


def test_partial_longer_than_file_restarts(server, tmp_path):
    (tmp_path / "TinyStoriesV2-GPT4-valid.txt.partial").write_bytes(b"x" * (len(TEXT) + 5))
    assert fetch(server, tmp_path).path.read_bytes() == TEXT  # 416, then a fresh download


def test_http_404_is_one_clear_line(server, tmp_path):
    del server.files["TinyStoriesV2-GPT4-valid.txt"]
    with pytest.raises(DownloadError) as info:
        fetch(server, tmp_path)
    message = str(info.value)
    assert "HTTP 404" in message and server.url in message and "\n" not in message
    assert len(server.requests) == 1  # a client error is not retried


def test_connection_refused_and_timeout(server, tmp_path):
    port = server.httpd.server_address[1]
    server.close()
    with pytest.raises(DownloadError, match=f"127.0.0.1:{port}"):
        download_dataset("tinystories-valid", tmp_path, mirror=f"http://127.0.0.1:{port}", retries=0,
                         progress=False, timeout=2)

    stalling = type(server)()
    try:
        stalling.files["TinyStoriesV2-GPT4-valid.txt"] = TEXT
        stalling.mode = "stall"
        with pytest.raises(DownloadError, match="timed out"):
            fetch(stalling, tmp_path, retries=0, timeout=0.3)
    finally:
        stalling.close()


def test_waits_between_retries_stop_doubling_at_a_minute(tmp_path, monkeypatch):
    waits = []
    monkeypatch.setattr(dl.time, "sleep", waits.append)

    def unreachable(url, partial, **kwargs):
        raise dl._Retryable("Connection refused")

    monkeypatch.setattr(dl, "_fetch_once", unreachable)
    with pytest.raises(DownloadError, match="Connection refused"):
        dl._fetch("http://127.0.0.1:9/f", tmp_path / "f.partial", timeout=1, retries=40, retry_wait=1.0,
                  progress=False)
    assert waits[:7] == [1, 2, 4, 8, 16, 32, 60] and len(waits) == 40 and max(waits) == dl.MAX_RETRY_WAIT


def test_unknown_dataset_and_bad_out_dir(tmp_path):
    with pytest.raises(UserError, match="unknown dataset 'nope'; known: tinystories-train"):
        download_dataset("nope", tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        download_dataset("tinystories-valid", tmp_path / "file")
    with pytest.raises(UserError, match="file is a file, not a directory"):  # (was a NotADirectoryError)
        download_dataset("tinystories-valid", tmp_path / "file" / "sub")


def test_registry_entries():
    assert set(DATASETS) == {"tinystories-train", "tinystories-valid", "owt-train", "owt-valid"}
    assert DATASETS["tinystories-train"].url() == \
        "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-train.txt"
    assert DATASETS["owt-valid"].url() == \
        "https://huggingface.co/datasets/stanford-cs336/owt-sample/resolve/main/owt_valid.txt.gz"
    assert DATASETS["owt-train"].url("http://m/") == "http://m/owt_train.txt.gz"
    assert DATASETS["owt-train"].local_name == "owt_train.txt" and DATASETS["owt-train"].compression == "gzip"


def test_parse_content_range():
    assert dl._parse_content_range("bytes 100-199/200") == (100, 200)
    assert dl._parse_content_range("bytes 5-9/*") == (5, None)
    assert dl._parse_content_range("nonsense")[0] == -1


@pytest.mark.parametrize("mirror", ["mirror-folder", "http://[bad"])
def test_mirror_that_is_not_a_url_is_one_clear_line(tmp_path, mirror):
    # A folder path or a malformed URL stopped with a ValueError.
    with pytest.raises(DownloadError, match="a mirror is a base URL such as"):
        download_dataset("tinystories-valid", tmp_path, mirror=mirror, progress=False, retries=0)
    assert not list(tmp_path.iterdir())


def test_file_url_mirror(tmp_path):
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / "TinyStoriesV2-GPT4-valid.txt").write_bytes(TEXT)
    result = download_dataset("tinystories-valid", tmp_path / "out", mirror=(tmp_path / "mirror").as_uri(),
                              progress=False)
    assert result.path.read_bytes() == TEXT


def test_a_checksum_write_that_fails_keeps_the_old_checksum_file(server, tmp_path, cut_writes):
    stale = tmp_path / "TinyStoriesV2-GPT4-valid.txt.sha256"
    stale.write_text(f"{'0' * 64}  TinyStoriesV2-GPT4-valid.txt\n")  # the data file was deleted, not this
    cut_writes()
    with pytest.raises(OSError, match="No space left"):
        fetch(server, tmp_path)
    assert stale.read_text() == f"{'0' * 64}  TinyStoriesV2-GPT4-valid.txt\n"  # old, not cut
    assert sorted(os.listdir(tmp_path)) == ["TinyStoriesV2-GPT4-valid.txt", "TinyStoriesV2-GPT4-valid.txt.sha256"]


@pytest.mark.parametrize("name", ["tinystories-valid", "owt-valid"])
def test_a_file_is_on_disk_before_it_takes_its_final_name(server, tmp_path, monkeypatch, name):
    # Renamed unsynced, a power cut could leave a short file under the final name beside its
    # checksum file, which a later call trusts without hashing the file again.
    synced, renamed = set(), []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        return real_fsync(fd)

    def replace(src, dst):
        renamed.append((os.path.basename(dst), os.stat(src).st_ino in synced))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    fetch(server, tmp_path, name)
    data = [(dst, was_synced) for dst, was_synced in renamed if not dst.endswith(".sha256")]
    expected = {"tinystories-valid": ["TinyStoriesV2-GPT4-valid.txt"],
                "owt-valid": ["owt_valid.txt.gz", "owt_valid.txt"]}[name]
    assert data == [(dst, True) for dst in expected]
