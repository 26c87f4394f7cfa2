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
    RUN/checkpoints/latest                          text: name of the newest complete step directory

A step directory is written under a staging name and renamed into place only when every file
is on disk and synced; `latest` is replaced after that, and old step directories are pruned
last. An interrupted save therefore never leaves `latest` pointing at a partial checkpoint.

safetensors refuses tensors that share memory, which tied embeddings do. `save_weights` keeps
one copy per storage and records the other names in the file's metadata (``aliases``: JSON
``{"lm_head.weight": "token_embeddings.weight"}``); `load_weights` restores them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tomllib
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from scratchlm.errors import UserError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
STATE = "state.pt"
CONFIG = "config.toml"
_STAGING_PREFIX = ".staging-"


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
    too, so `load_trained_model` can rebuild the model from this file alone.
    """
    from scratchlm.config import config_to_dict

    model_config = model_config if model_config is not None else getattr(model, "config", None)
    payload = {
        "model": unwrapped_state_dict(model),
        "optimizer": optimizer.state_dict(),
        "iteration": int(iteration),
        "model_config": config_to_dict(model_config) if model_config is not None else None,
    }
    torch.save(payload, out)


def load_checkpoint(
    src: str | os.PathLike | IO[bytes],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> int:
    """Restore what `save_checkpoint` wrote into `model` (and `optimizer`); returns the iteration."""
    payload = torch.load(src, map_location="cpu", weights_only=True)
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

    state: dict[str, torch.Tensor] = {}
    with safe_open(os.fspath(path), framework="pt", device=str(device)) as f:
        for name in f.keys():
            state[name] = f.get_tensor(name)
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
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
    final = ckpt / step_dir_name(step)
    if final.exists():  # re-saving a step: move the old copy aside first (rename needs no target)
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
    steps = [p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[5:]))


def latest_step_dir(run_dir: str | os.PathLike) -> Path | None:
    """The step directory `latest` names, or None when the run has no checkpoint yet."""
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoints_dir(run_dir) / pointer.read_text(encoding="utf-8").strip()
    if not (path / WEIGHTS).is_file():
        raise UserError(f"{pointer} names {path.name}, which is missing or incomplete")
    return path


def prune_checkpoints(run_dir: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` step directories (never the one `latest` names)."""
    steps = list_steps(run_dir)
    pointer = checkpoints_dir(run_dir) / LATEST
    current = pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None
    for path in steps[: max(0, len(steps) - keep)]:
        if path.name != current:
            shutil.rmtree(path)
    for stale in checkpoints_dir(run_dir).glob(f"{_STAGING_PREFIX}*"):
        if stale.is_dir() and stale.name.startswith(f"{_STAGING_PREFIX}old-"):
            shutil.rmtree(stale, ignore_errors=True)


def read_torch(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------- loading a trained model


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run directory (-> its latest step), a step directory, or a checkpoint file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    if path.is_file():
        return path.parent if path.name == WEIGHTS else path
    if (path / WEIGHTS).is_file():
        return path
    if (path / CHECKPOINTS).is_dir():
        step = latest_step_dir(path)
        if step is None:
            raise UserError(f"run directory {path} has no checkpoint yet")
        return step
    raise UserError(f"{path} is neither a run directory, a step directory nor a checkpoint file")


def read_model_config(config_toml: Path):
    """The [model] section of a resolved TrainConfig file, as a ModelConfig."""
    from scratchlm.config import from_dict
    from scratchlm.model.config import ModelConfig

    data = tomllib.loads(config_toml.read_text(encoding="utf-8"))
    return from_dict(ModelConfig, data.get("model", {}), where="model")


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
        cfg = read_model_config(where / CONFIG)
        state = load_weights(where / WEIGHTS)
        run_dir = where.parent.parent if where.parent.name == CHECKPOINTS else where
        tokenizer_dir = run_dir / "tokenizer"
    else:
        payload = torch.load(where, map_location="cpu", weights_only=True)
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
    model.load_state_dict(state)
    model.eval()
    tokenizer = None
    if tokenizer_dir is not None and tokenizer_dir.is_dir():
        from scratchlm.tokenizer.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(tokenizer_dir)
    return model, cfg, tokenizer
