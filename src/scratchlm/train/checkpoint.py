"""Checkpoints: a single-file form, the run-directory form, and loading a trained model back.

Single file (`save_checkpoint` / `load_checkpoint`): one `torch.save` of
``{"model", "optimizer", "iteration", "model_config"}`` to a path or binary file object.

Run directory (what `scratchlm train` writes)::

    RUN/checkpoints/step_000500/model.safetensors   weights (tied tensors stored once, see below)
                                optimizer.pt        optimizer state dict (rank 0, or the full one)
                                optimizer.rank1.pt  per-rank optimizer state, when sharded
                                state.pt            step, RNG states, sampler state, loop state,
                                                    git revision, package versions
                                config.toml         resolved TrainConfig
                                checksums.json      sha256 of every other file of the directory
    RUN/checkpoints/latest                          text: name of the newest complete step directory

A step directory is written under a staging name and renamed into place only when every file
is on disk and synced; `latest` is replaced after that, and old step directories are pruned
last. An interrupted save therefore never leaves `latest` pointing at a partial checkpoint.

Damage after the save (a truncated copy, a bad disk) is caught at load: `checksums.json` is
written last into the staging folder, and `verify_step_dir` compares every file against it, so
a flipped byte is a one-line error naming the file rather than a NaN loss hours later. Step
directories written before checksums existed still load: their `.pt` files (zip archives) are
checked against the archive's own CRCs and their safetensors header against the file size,
with one warning that the weights cannot be fully checked.

Resuming (`find_resume_checkpoint`) takes the step `latest` names, or the newest step directory
when `latest` is missing, or a step given by name; a damaged one is refused with the name of
the newest intact older one. Nothing is deleted on the way: step directories newer than the one
resumed from are renamed aside (``step_000800.set-aside``), and pruning removes only step
directories older than the one just committed.

safetensors refuses tensors that share memory, which tied embeddings do. `save_weights` keeps
one copy per storage and records the other names in the file's metadata (``aliases``: JSON
``{"lm_head.weight": "token_embeddings.weight"}``); `load_weights` restores them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tomllib
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from scratchlm.errors import UserError
from scratchlm.fileio import atomic_open, exchange_paths

CHECKPOINTS = "checkpoints"
LATEST = "latest"
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
STATE = "state.pt"
CONFIG = "config.toml"
CHECKSUMS = "checksums.json"
SET_ASIDE_SUFFIX = ".set-aside"
_STAGING_PREFIX = ".staging-"
RESUME_FILES = (WEIGHTS, STATE)  # what every resumable step directory holds
log = logging.getLogger("scratchlm.train")
_warned_unchecked: set[Path] = set()


class DamagedCheckpoint(UserError):
    """A checkpoint file that is missing, truncated or altered since it was saved."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint file {path} is damaged ({reason})")
        self.path = path


# ---------------------------------------------------------------- single-file checkpoints


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    iteration: int,
    out: str | os.PathLike | IO[bytes],
    *,
    model_config: Any = None,
) -> None:
    """Save model weights, optimizer state and the iteration number to one file (or file object).

    `model_config` (a ModelConfig, default: `model.config` when the model has one) is stored
    too, so `load_trained_model` can rebuild the model from this file alone. A path is replaced
    in one step (`scratchlm.fileio.atomic_open`): a save cut off (Ctrl-C, a full disk, a killed
    process) leaves the checkpoint that was there before, never a truncated one.
    """
    from scratchlm.config import config_to_dict

    model_config = model_config if model_config is not None else getattr(model, "config", None)
    payload = {
        "model": unwrapped_state_dict(model),
        "optimizer": optimizer.state_dict(),
        "iteration": int(iteration),
        "model_config": config_to_dict(model_config) if model_config is not None else None,
    }
    if isinstance(out, (str, os.PathLike)):
        with atomic_open(out, "wb") as f:
            torch.save(payload, f)
    else:
        torch.save(payload, out)


def load_checkpoint(
    src: str | os.PathLike | IO[bytes],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> int:
    """Restore what `save_checkpoint` wrote into `model` (and `optimizer`); returns the iteration."""
    payload = _torch_load(src)
    _target(model).load_state_dict(_strip_prefixes(payload["model"]))
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])
    return int(payload["iteration"])


def _target(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under torch.compile / DDP-style wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def unwrapped_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`state_dict()` of the plain module, with keys as the unwrapped model names them."""
    return _target(model).state_dict()


def _strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for prefix in ("_orig_mod.", "module."):
            while key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out


# ---------------------------------------------------------------- weights as safetensors


def save_weights(state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write a state dict as safetensors, storing tensors that share memory once."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_view: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for name, tensor in state.items():
        tensor = tensor.detach()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        view = (*storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view in by_view:
            aliases[name] = by_view[view]
            continue
        by_view[view] = name
        # A different view of an already-stored storage (rare) gets its own copy.
        tensor = tensor.clone() if storage in storages else tensor
        storages.add(storage)
        tensors[name] = tensor.contiguous().cpu()
    save_file(tensors, os.fspath(path), metadata={"aliases": json.dumps(aliases), "format": "pt"})


def load_weights(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file written by `save_weights`, restoring aliased (tied) names."""
    from safetensors import safe_open

    from safetensors import SafetensorError

    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(os.fspath(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                state[name] = f.get_tensor(name)
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    except (SafetensorError, OSError, ValueError) as exc:
        if not Path(path).is_file():
            raise
        raise DamagedCheckpoint(Path(path), f"not a complete safetensors file: {_one_line(exc)}") from None
    for name, target in aliases.items():
        state[name] = state[target]
    return state


# ---------------------------------------------------------------- RNG state


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when initialised) CUDA generator states, torch-loadable."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    random.setstate(_as_tuple(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------- run-directory checkpoints


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _is_number(text: str) -> bool:
    """Whether `text` is a step number: ASCII digits only (``"²".isdigit()`` is True, ``int("²")`` fails)."""
    return text.isascii() and text.isdigit()


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def staging_dir(run_dir: str | os.PathLike, step: int, *, create: bool = True) -> Path:
    """The folder in which the files of step `step` are written before commit.

    With `create` (rank 0) it is made fresh and empty; other ranks only compute the path.
    """
    path = checkpoints_dir(run_dir) / f"{_STAGING_PREFIX}{step_dir_name(step)}"
    if create:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
    return path


def write_torch(obj: Any, path: Path) -> None:
    """`torch.save` followed by fsync, so a committed checkpoint survives a power cut."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_step_files(
    staging: Path,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
    state: dict[str, Any],
    config_text: str,
) -> None:
    """Write the rank-0 files of one checkpoint into `staging`."""
    save_weights(model_state, staging / WEIGHTS)
    if optimizer_state is not None:
        write_torch(optimizer_state, staging / OPTIMIZER)
    write_torch(state, staging / STATE)
    (staging / CONFIG).write_text(config_text, encoding="utf-8")


def commit_step(run_dir: str | os.PathLike, step: int, *, keep: int) -> Path:
    """Rename the staging folder of `step` into place, point `latest` at it, prune old steps."""
    ckpt = checkpoints_dir(run_dir)
    staging = staging_dir(run_dir, step, create=False)
    for path in staging.iterdir():
        _fsync(path)
    write_checksums(staging)
    final = ckpt / step_dir_name(step)
    if final.exists() and exchange_paths(staging, final):  # re-saving a step: swap in one step
        shutil.rmtree(staging)  # (now the old copy)
    elif final.exists():  # (no atomic swap here: move the old copy aside first, rename needs no target)
        old = ckpt / f"{_STAGING_PREFIX}old-{step_dir_name(step)}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        staging.rename(final)
        shutil.rmtree(old)
    else:
        staging.rename(final)
    tmp = ckpt / f"{LATEST}.tmp"
    tmp.write_text(final.name + "\n", encoding="utf-8")
    _fsync(tmp)
    os.replace(tmp, ckpt / LATEST)
    _fsync(ckpt)
    prune_checkpoints(run_dir, keep)
    return final


def save_run_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
    state: dict[str, Any],
    config_text: str,
    keep: int,
) -> Path:
    """Write and commit one step directory in a single process; returns its path."""
    staging = staging_dir(run_dir, step)
    write_step_files(staging, model_state=model_state, optimizer_state=optimizer_state,
                     state=state, config_text=config_text)
    return commit_step(run_dir, step, keep=keep)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync directories; the data files are synced
        pass
    finally:
        os.close(fd)


def list_steps(run_dir: str | os.PathLike) -> list[Path]:
    """Committed step directories, oldest first."""
    ckpt = checkpoints_dir(run_dir)
    if not ckpt.is_dir():
        return []
    steps = [p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("step_") and _is_number(p.name[5:])]
    return sorted(steps, key=lambda p: int(p.name[5:]))


def _read_pointer(pointer: Path) -> str:
    """The step directory name that the `latest` file `pointer` holds."""
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise UserError(f"{pointer} is not a step directory name (it is not UTF-8 text): the file is damaged; "
                        "write the name of a step directory (e.g. step_000100) into it") from None
    if not name:
        steps = list_steps(pointer.parent.parent)
        hint = (f"{steps[-1].name} is the newest step directory: write its name into it to use it" if steps
                else "the run has no step directory")
        raise UserError(f"{pointer} is empty: it should hold the name of a step directory; {hint}")
    return name


def latest_step_dir(run_dir: str | os.PathLike) -> Path | None:
    """The step directory `latest` names, or None when the run has no checkpoint yet."""
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoints_dir(run_dir) / _read_pointer(pointer)
    if not (path / WEIGHTS).is_file():
        raise UserError(f"{pointer} names {path.name}, which is missing or incomplete")
    return path


def prune_checkpoints(run_dir: str | os.PathLike, keep: int) -> None:
    """Keep the step `latest` names and the `keep - 1` newest older ones; delete older ones.

    Step directories newer than `latest` are never touched (they are not this run's), nor is
    anything when `latest` is missing.
    """
    pointer = checkpoints_dir(run_dir) / LATEST
    current = _read_pointer(pointer) if pointer.is_file() else ""
    if _is_number(current[5:]):
        older = [p for p in list_steps(run_dir) if int(p.name[5:]) < int(current[5:])]
        for path in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(path)
    for stale in checkpoints_dir(run_dir).glob(f"{_STAGING_PREFIX}*"):
        if stale.is_dir() and stale.name.startswith(f"{_STAGING_PREFIX}old-"):
            shutil.rmtree(stale, ignore_errors=True)


def read_torch(path: Path) -> Any:
    """`torch.load` of a checkpoint file (tensors and plain values only); damage names the file."""
    return _torch_load(path)


def _torch_load(src: str | os.PathLike | IO[bytes]) -> Any:
    import pickle

    try:
        return torch.load(src, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, IndexError, pickle.UnpicklingError) as exc:
        if not isinstance(src, (str, os.PathLike)) or not Path(src).is_file():
            raise
        raise DamagedCheckpoint(Path(src), f"cannot be read: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


# ---------------------------------------------------------------- checksums and verification


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read 8 MB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 23):
            h.update(block)
    return h.hexdigest()


def write_checksums(step_dir: Path) -> None:
    """Record the sha256 of every file of `step_dir` in its `checksums.json` (synced)."""
    files = {p.name: file_sha256(p) for p in sorted(step_dir.iterdir()) if p.is_file() and p.name != CHECKSUMS}
    path = step_dir / CHECKSUMS
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"algorithm": "sha256", "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_step_dir(step_dir: Path, required: tuple[str, ...] = RESUME_FILES, *,
                    only: tuple[str, ...] | None = None) -> None:
    """Raise `DamagedCheckpoint` for the first file of `step_dir` that is missing or altered.

    With a `checksums.json`, every file it lists (or those of them in `only`) is hashed;
    without one (checkpoints older than checksums), the same files get the structural checks
    of the module docstring, and the directory one warning.
    """
    for name in required:
        if not (step_dir / name).is_file():
            raise DamagedCheckpoint(step_dir / name, "missing")
    manifest = step_dir / CHECKSUMS
    if not manifest.is_file():
        _verify_structure(step_dir, only)
        return
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        files = {str(k): str(v) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise DamagedCheckpoint(manifest, "not the JSON that a save writes") from None
    for name, expected in files.items():
        if only is not None and name not in only:
            continue
        path = step_dir / name
        if not path.is_file():
            raise DamagedCheckpoint(path, "missing")
        if file_sha256(path) != expected:
            raise DamagedCheckpoint(path, "its sha256 differs from the one recorded at save")


def _verify_structure(step_dir: Path, only: tuple[str, ...] | None) -> None:
    import zipfile

    if step_dir not in _warned_unchecked:
        _warned_unchecked.add(step_dir)
        log.warning("%s has no %s (written by an older scratchlm): its files are checked for truncation "
                    "only, not against checksums", step_dir, CHECKSUMS)
    for path in sorted(step_dir.glob("*.pt")):
        if only is not None and path.name not in only:
            continue
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()  # reads every member against its CRC-32
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise DamagedCheckpoint(path, f"not a complete torch archive: {_one_line(exc)}") from None
        if bad is not None:
            raise DamagedCheckpoint(path, f"member {bad} fails its CRC check")
    weights = step_dir / WEIGHTS
    if weights.is_file() and (only is None or WEIGHTS in only):
        size = weights.stat().st_size
        try:
            with open(weights, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            header, end = None, 0
        if header is None or 8 + n + end != size:
            raise DamagedCheckpoint(weights, "truncated or not a safetensors file")


def _step_number(path: Path) -> int:
    return int(path.name[5:])


def _named_step(run_dir: str | os.PathLike, step: int | str | os.PathLike) -> Path:
    """The step directory that `step` names: 800, "800", "step_000800", or its path (one of this run's)."""
    text = os.fspath(step) if not isinstance(step, int) else str(step)
    name = Path(text).name
    digits = name[5:] if name.startswith("step_") else name
    path = checkpoints_dir(run_dir) / step_dir_name(int(digits)) if _is_number(digits) else None
    have = ", ".join(p.name for p in list_steps(run_dir)) or "none"
    if path is None or not path.is_dir():
        shown = step_dir_name(int(digits)) if _is_number(digits) else text
        raise UserError(f"there is no checkpoint {shown} in {checkpoints_dir(run_dir)} (there are: {have})")
    given = Path(text)
    if given.parent != Path(".") and given.exists() and given.resolve() != path.resolve():
        # (the path of another run's step: resuming this run's step of that name instead would be silent)
        raise UserError(f"{text} is not a checkpoint of the run {run_dir}: a run resumes only from its own "
                        f"checkpoints in {checkpoints_dir(run_dir)} (there are: {have})")
    return path


def _intact_hint(run_dir: str | os.PathLike, before: Path) -> str:
    """Where to resume from instead of the damaged `before`: the newest intact older step."""
    pointer = checkpoints_dir(run_dir) / LATEST
    for path in reversed([p for p in list_steps(run_dir) if _step_number(p) < _step_number(before)]):
        try:
            verify_step_dir(path)
        except DamagedCheckpoint:
            continue
        return (f"{path.name} is intact: to resume from it, run with --resume-from {path.name} "
                f"(or write {path.name} into {pointer} and run with --resume; newer step directories "
                "are set aside, not deleted)")
    return "no older checkpoint is intact; start the run over with --overwrite"


def find_resume_checkpoint(run_dir: str | os.PathLike, step: int | str | os.PathLike | None = None, *,
                           set_aside_newer: bool = False) -> Path | None:
    """The verified step directory to resume `run_dir` from, or None when it has none at all.

    `step` names one (see `_named_step`); otherwise `latest` decides, or, when `latest` is
    missing (a run killed between renaming its step directory and writing `latest`, or a copy
    that lost it), the newest step directory. A damaged or missing choice is a `UserError` that
    names the damaged file and the newest intact older step. With `set_aside_newer` (rank 0),
    step directories newer than the choice are renamed aside so that later saves and pruning
    cannot replace or delete them.
    """
    steps = list_steps(run_dir)
    pointer = checkpoints_dir(run_dir) / LATEST
    if step is not None:
        target = _named_step(run_dir, step)
    elif pointer.is_file():
        target = checkpoints_dir(run_dir) / _read_pointer(pointer)
        if not _is_number(target.name[5:]) or not target.is_dir():
            hint = (f"{steps[-1].name} is the newest step directory: write its name into {pointer} to resume "
                    f"from it" if steps else "the run has no step directory; start it over with --overwrite")
            raise UserError(f"{pointer} names {target.name!r}, which is not a step directory here; {hint}")
    elif steps:
        target = steps[-1]
        log.warning("%s is missing; resuming from %s, the newest step directory", pointer, target.name)
    else:
        return None
    try:
        verify_step_dir(target)
    except DamagedCheckpoint as exc:
        raise UserError(f"{exc}; {_intact_hint(run_dir, target)}") from None
    if set_aside_newer:
        for path in steps:
            if _step_number(path) > _step_number(target):
                aside = path.with_name(path.name + SET_ASIDE_SUFFIX)
                n = 1
                while aside.exists():
                    n += 1
                    aside = path.with_name(f"{path.name}{SET_ASIDE_SUFFIX}-{n}")
                path.rename(aside)
                log.warning("resuming from %s: set the newer %s aside as %s", target.name, path.name, aside.name)
    return target


# ---------------------------------------------------------------- loading a trained model


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run directory (-> its latest step), a step directory, or a checkpoint file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    if path.is_file():
        if path.name == LATEST and path.parent.name == CHECKPOINTS:
            return resolve_checkpoint(path.parent.parent)
        if path.name == WEIGHTS or ((path.parent / WEIGHTS).is_file() and (path.parent / CONFIG).is_file()):
            return path.parent  # the weights or another file (optimizer.pt, state.pt, ...) of a step directory
        return path
    if (path / "config.json").is_file() and not (path / CONFIG).is_file():
        raise UserError(f"{path} is a Hugging Face model directory (config.json), not a scratchlm run; this command "
                        "reads scratchlm runs, step directories or checkpoint files (eval-math, sft, "
                        "expert-iteration, grpo and dpo also take Hugging Face directories)")
    if (path / WEIGHTS).is_file():
        return path
    if (path / CHECKPOINTS).is_dir() or (path / "metrics.jsonl").is_file():  # (a run before its first save has none)
        step = latest_step_dir(path)
        if step is None:
            steps = list_steps(path)
            if not steps:
                raise UserError(f"run directory {path} has no checkpoint yet")
            step = steps[-1]
            log.warning("%s is missing; using %s, the newest step directory", checkpoints_dir(path) / LATEST, step.name)
        return step
    raise UserError(f"{path} is neither a run directory, a step directory nor a checkpoint file")


def read_model_config(config_toml: Path):
    """The [model] section of a resolved TrainConfig file, as a ModelConfig."""
    from scratchlm.config import from_dict
    from scratchlm.model.config import ModelConfig

    try:
        data = tomllib.loads(config_toml.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{config_toml} is not a valid TOML config ({_one_line(exc)}), so the model "
                        "cannot be rebuilt from it") from None
    model = data.get("model", {})
    if not isinstance(model, dict):
        raise UserError(f"{config_toml}: [model] must be a table, got {type(model).__name__}")
    return from_dict(ModelConfig, model, where="model")


def check_weights_fit(model: torch.nn.Module, state: Any, where: Path, *,
                      model_is: str = "the model its config describes",
                      hint: str = "the config or the weights come from another run") -> None:
    """Refuse weights that are not those of `model` (by default the model the checkpoint's config
    describes: a config edited or copied from another run), naming the first difference rather
    than torch's list of all."""
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{where} is not a model checkpoint (its weights are not a dict of tensors)")
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if not (missing or unexpected or wrong):
        return
    if wrong:
        k = wrong[0]
        first = (f"{k} has shape {tuple(state[k].shape)}, the config's model needs {tuple(expected[k].shape)}"
                 + (f" ({len(wrong) - 1} more differ)" if len(wrong) > 1 else ""))
    elif missing:
        first = f"{len(missing)} tensor(s) the config's model needs are missing, e.g. {missing[0]}"
    else:
        first = f"{len(unexpected)} tensor(s) are not in the config's model, e.g. {unexpected[0]}"
    raise UserError(f"the weights of {where} do not fit {model_is}: {first}; {hint}")


def load_trained_model(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """Rebuild a trained model in eval mode: returns ``(model, ModelConfig, Tokenizer | None)``.

    `path` is a run directory (its latest checkpoint), a step directory, or a single-file
    checkpoint from `save_checkpoint`. The tokenizer is the run's ``tokenizer/`` copy, if any.
    """
    from scratchlm.config import from_dict
    from scratchlm.model.config import ModelConfig
    from scratchlm.model.transformer import build_model

    where = resolve_checkpoint(path)
    tokenizer_dir = None
    if where.is_dir():
        verify_step_dir(where, (WEIGHTS, CONFIG), only=(WEIGHTS, CONFIG))
        cfg = read_model_config(where / CONFIG)
        state = load_weights(where / WEIGHTS)
        run_dir = where.parent.parent if where.parent.name == CHECKPOINTS else where
        tokenizer_dir = run_dir / "tokenizer"
    else:
        hint = "give a run directory, a step directory or a file written by save_checkpoint"
        with open(where, "rb") as f:
            magic = f.read(2)
        if magic != b"PK" and magic[:1] != b"\x80":  # neither torch's zip format nor its legacy pickle
            raise UserError(f"{where} is not a model checkpoint (not a file torch.save wrote); {hint}")
        payload = _torch_load(where)
        if not isinstance(payload, dict) or "model" not in payload:
            raise UserError(f"{where} is not a model checkpoint (it holds no model weights); {hint}")
        if payload.get("model_config") is not None:
            cfg = from_dict(ModelConfig, payload["model_config"], where="model")
        elif (where.parent / CONFIG).is_file():
            cfg = read_model_config(where.parent / CONFIG)
        else:
            raise UserError(f"{where} stores no model config (and there is no {CONFIG} beside it)")
        state = _strip_prefixes(payload["model"])
        if (where.parent / "tokenizer").is_dir():
            tokenizer_dir = where.parent / "tokenizer"
    model = build_model(cfg, device=device)
    check_weights_fit(model, state, where)
    model.load_state_dict(state)
    model.eval()
    tokenizer = None
    if tokenizer_dir is not None and tokenizer_dir.is_dir():
        from scratchlm.tokenizer.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(tokenizer_dir)
    return model, cfg, tokenizer
