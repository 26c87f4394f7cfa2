"""The run directory: creating it safely, and what makes a run self-describing.

A run directory is never silently reused: starting a run where one already exists needs
`--resume` (continue it) or `--overwrite` (replace it), and `--overwrite` deletes only
directories that look like runs, never an arbitrary folder given by mistake, and only once the
new run has started (`begin_run_dir`): a run that fails before that leaves things as they were.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from scratchlm.errors import UserError
from scratchlm.fileio import copy_tree_atomic, move_aside

_RUN_MARKERS = ("config.toml", "metrics.jsonl", "checkpoints")
# What only a run that started writes: config.toml alone is too common a name to delete a folder for.
_STARTED_RUN_MARKERS = ("metrics.jsonl", "checkpoints")
_VERSIONED = ("scratchlm", "torch", "numpy", "safetensors", "tqdm", "regex", "triton")


def looks_like_run_dir(path: str | Path) -> bool:
    """True when `path` holds what a training run writes (its config, metrics or checkpoints)."""
    return any((Path(path) / m).exists() for m in _RUN_MARKERS)


def prepare_run_dir(path: str | Path, *, resume: bool, overwrite: bool) -> Path:
    """Create or reuse `path` as a run directory, following the rules above (a replaced run is
    deleted at once)."""
    return begin_run_dir(path, resume=resume, overwrite=overwrite).keep()


class PendingRunDir:
    """A run directory prepared by `begin_run_dir`, until the run is known to start.

    `keep()` once the run has started (the trainer is built: config, data and tokenizer are
    valid) deletes the run it replaces; `abandon()` after a failure before that removes the
    directory if this invocation created it and puts the replaced run back. So a typo in a
    path never costs the previous run (`--overwrite`), nor leaves an empty run directory."""

    def __init__(self, path: Path, created: bool, replaced: Path | None) -> None:
        self.path, self.created, self.replaced = path, created, replaced

    def keep(self) -> Path:
        if self.replaced is not None:
            shutil.rmtree(self.replaced, ignore_errors=True)
            self.replaced = None
        return self.path

    def abandon(self) -> None:
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
        if self.replaced is not None and not self.path.exists():
            self.replaced.rename(self.path)
            self.replaced = None


def begin_run_dir(path: str | Path, *, resume: bool, overwrite: bool) -> PendingRunDir:
    """Create or reuse `path` as a run directory, following the rules above; a run that
    `overwrite` replaces is moved aside (see `PendingRunDir`), not deleted yet."""
    path = Path(path)
    if resume and overwrite:
        raise UserError("--resume and --overwrite contradict each other; pass one")
    if path.exists() and not path.is_dir():
        raise UserError(f"run directory {path} exists and is not a directory")
    replaced = None
    if path.is_dir() and any(path.iterdir()):
        looks_like_run = looks_like_run_dir(path)
        if overwrite:
            if not any((path / m).exists() for m in _STARTED_RUN_MARKERS):
                raise UserError(f"--overwrite refuses to delete {path}: it does not look like a run directory "
                                f"(it has no {' or '.join(_STARTED_RUN_MARKERS)})")
            if Path.cwd().resolve().is_relative_to(path.resolve()):
                raise UserError(f"--overwrite refuses to delete {path}: it holds the current directory")
            replaced = move_aside(path, "replaced")  # until the new run starts
        elif not resume:
            raise UserError(
                f"run directory {path} already exists; pass --resume to continue it "
                "or --overwrite to replace it"
            )
        elif not looks_like_run:
            raise UserError(f"--resume: {path} is not empty and does not look like a run directory")
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    return PendingRunDir(path, created, replaced)


def git_revision() -> str | None:
    """The commit of the source tree scratchlm runs from, with ``-dirty`` for local changes."""
    src = Path(__file__).resolve().parents[3]
    try:
        rev = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{rev}-dirty" if dirty else rev


def package_versions() -> dict[str, str]:
    """Python and the versions of the packages a run depends on (those installed)."""
    versions = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def environment_info() -> dict[str, Any]:
    """What to record about where a run ran: git revision, package versions, host."""
    return {"git_revision": git_revision(), "versions": package_versions(), "host": platform.node()}


def copy_tokenizer(tokenizer_dir: str, run_dir: Path) -> Path | None:
    """Copy the configured tokenizer directory into ``RUN/tokenizer`` (for sampling/export).

    In one step (`scratchlm.fileio.copy_tree_atomic`): a run killed while copying leaves the
    previous copy, never half of the new one, and a previous copy is replaced whole. Temporary
    files a killed writer left in the source (``.*.tmp``) are not copied."""
    if not tokenizer_dir:
        return None
    src = Path(tokenizer_dir)
    if not src.is_dir():
        raise UserError(f"data.tokenizer_dir {src} is not a directory")
    dst = run_dir / "tokenizer"
    if src.resolve() != dst.resolve():
        copy_tree_atomic(src, dst)
    return dst
