"""The datasets ``scratchlm download`` knows by name.

Each entry names where the file is served (``base_url`` + ``remote_name``), what it is called
on disk, and how to unpack it. ``sha256`` is the checksum of the file *as served* (the ``.gz``
for gzipped entries); it is ``None`` while unknown, in which case a download computes it, prints
it and stores it beside the file so it can be pinned here later.

A mirror replaces ``base_url`` for every entry: ``{mirror}/{remote_name}``, so a flat folder of
the served files (or a local HTTP server in tests) stands in for the original hosts.
"""

from __future__ import annotations

from dataclasses import dataclass

from scratchlm.errors import UserError

MIRROR_ENV = "SCRATCHLM_DATASET_MIRROR"

_TINYSTORIES = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main"
_OWT_SAMPLE = "https://huggingface.co/datasets/stanford-cs336/owt-sample/resolve/main"


@dataclass(frozen=True)
class DatasetEntry:
    """One downloadable file."""

    name: str  # the name given to `scratchlm download`
    description: str
    base_url: str  # folder URL the file is served from (replaced by a mirror)
    remote_name: str  # file name under base_url
    local_name: str  # file name written under --out-dir, after unpacking
    compression: str | None = None  # "gzip": gunzip after download; None: keep as served
    sha256: str | None = None  # of the served file; None = not pinned yet

    def url(self, mirror: str | None = None) -> str:
        base = mirror if mirror else self.base_url
        return f"{base.rstrip('/')}/{self.remote_name}"


DATASETS: dict[str, DatasetEntry] = {
    entry.name: entry
    for entry in [
        DatasetEntry("tinystories-train", "TinyStories V2 (GPT-4 stories), training split",
                     _TINYSTORIES, "TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-train.txt"),
        DatasetEntry("tinystories-valid", "TinyStories V2 (GPT-4 stories), validation split",
                     _TINYSTORIES, "TinyStoriesV2-GPT4-valid.txt", "TinyStoriesV2-GPT4-valid.txt"),
        DatasetEntry("owt-train", "OpenWebText sample, training split (gunzipped after download)",
                     _OWT_SAMPLE, "owt_train.txt.gz", "owt_train.txt", compression="gzip"),
        DatasetEntry("owt-valid", "OpenWebText sample, validation split (gunzipped after download)",
                     _OWT_SAMPLE, "owt_valid.txt.gz", "owt_valid.txt", compression="gzip"),
    ]
}


def get_dataset(name: str) -> DatasetEntry:
    """The registry entry called ``name``; ``UserError`` listing the names otherwise."""
    try:
        return DATASETS[name]
    except KeyError:
        raise UserError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}") from None
