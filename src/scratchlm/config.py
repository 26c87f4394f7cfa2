"""Typed dataclass configs, TOML presets and dotted command-line overrides.

A config is a dataclass whose fields are scalars (``int``, ``float``, ``bool``, ``str``),
``Optional`` scalars, lists/tuples of scalars, or nested dataclasses (the sections of a TOML
file). Each component owns its own small dataclass; the root config only composes them.

Loading is strict, because a typo in an ablation config silently running the default is the
worst kind of bug: unknown keys and values of the wrong type raise ``ConfigError`` with a
one-line message naming the key.

    cfg = load_config(TrainConfig, "tinystories-17m", ["--optim.lr=3e-4", "--model.use_rope=false"])
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from scratchlm.errors import UserError
from scratchlm.fileio import write_text_atomic

T = TypeVar("T")

_NONE_WORDS = {"none", "null"}
_TRUE_WORDS = {"true", "yes", "on", "1"}
_FALSE_WORDS = {"false", "no", "off", "0"}
# String fields that name a file or folder: ``path``, ``*_path``, ``*_dir``, and the align
# ``dataset``/``eval_dataset`` (a name or a .jsonl path). A leading ``~`` in their values is
# expanded to the home folder, from TOML and overrides alike (no shell does it after ``=``).
_PATH_FIELD_NAMES = {"path", "dataset", "eval_dataset"}
_PATH_FIELD_SUFFIXES = ("_path", "_dir")


class ConfigError(UserError, ValueError):
    """A config file or override that does not fit its dataclass."""


def preset_dirs() -> list[Path]:
    """Folders searched for preset names: ``./configs`` then the repository's ``configs/``."""
    dirs = [Path.cwd() / "configs", Path(__file__).resolve().parents[2] / "configs"]
    return list(dict.fromkeys(d for d in dirs))


def resolve_preset(preset: str | Path) -> Path:
    """A preset path, or a name such as ``gpt2-small`` looked up in the preset folders."""
    path = Path(preset).expanduser()
    if path.is_file():
        return path
    if path.suffix != ".toml" and len(path.parts) == 1:
        for folder in preset_dirs():
            candidate = folder / f"{path.name}.toml"
            if candidate.is_file():
                return candidate
    if path.is_dir():
        inside = path / "config.toml"
        hint = f"; its config is {inside}" if inside.is_file() else ""
        raise ConfigError(f"config {str(preset)!r} is a directory, not a TOML file{hint}")
    names = sorted({p.stem for d in preset_dirs() if d.is_dir() for p in d.glob("*.toml")})
    hint = f" (presets: {', '.join(names)})" if names else ""
    raise ConfigError(f"config {str(preset)!r} not found{hint}")


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate ``--section.key=value`` overrides (a dot before ``=``) from the other arguments.

    ``--a.b value`` (value as the next word) is accepted too.
    """
    positional: list[str] = []
    overrides: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else ""
        if "." in key:
            if "=" not in arg:
                if i + 1 >= len(args):
                    raise ConfigError(f"override {arg} has no value (use {arg}=VALUE)")
                arg = f"{arg}={args[i + 1]}"
                i += 1
            overrides.append(arg)
        else:
            positional.append(arg)
        i += 1
    return positional, overrides


def parse_override(text: str) -> tuple[list[str], str]:
    """``--optim.lr=3e-4`` -> (["optim", "lr"], "3e-4")."""
    body = text[2:] if text.startswith("--") else text
    if "=" not in body:
        raise ConfigError(f"override {text!r} must look like --section.key=value")
    key, value = body.split("=", 1)
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        body.encode("utf-8")
    except UnicodeEncodeError:  # bytes of another encoding on the command line; configs are saved as UTF-8
        raise ConfigError(f"override --{key}: not valid UTF-8 text ({ascii(value)})") from None
    return parts, value


def read_toml(path: Path) -> dict[str, Any]:
    """The table of a TOML file; a file that is not UTF-8 TOML is a `ConfigError` naming it."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a TOML config (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start} is not UTF-8 text)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def load_config(cls: type[T], preset: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build ``cls`` from its defaults, a TOML preset, then dotted overrides, in that order."""
    data: dict[str, Any] = {}
    if preset is not None:
        data = read_toml(resolve_preset(preset))
    for text in overrides:
        parts, raw = parse_override(text)
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = _OverrideText(raw)
    return from_dict(cls, data)


class _OverrideText(str):
    """A value typed on the command line: parsed according to the field's type."""


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and types."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'} must be a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"unknown config key {key!r} (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(value, hints[name], key)
        if isinstance(kwargs[name], str) and _is_path_field(name):
            kwargs[name] = os.path.expanduser(kwargs[name])
    # Sections absent from the file still get their own defaults (dataclasses handle that).
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None
    return obj


def _is_path_field(name: str) -> bool:
    """Whether config field `name` holds a path (its ``~`` is expanded when read)."""
    return name in _PATH_FIELD_NAMES or name.endswith(_PATH_FIELD_SUFFIXES)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where=key)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, _OverrideText) and value.lower() in _NONE_WORDS):
            if type(None) in args:
                return None
            raise ConfigError(f"{key} may not be none")
        errors = []
        for option in non_none:
            try:
                return _coerce(value, option, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} fits none of {tp}")
    if origin is typing.Literal:
        if isinstance(value, _OverrideText):
            for choice in args:
                if str(choice) == value:
                    return choice
        elif value in args:
            return value
        raise ConfigError(f"{key} must be one of {', '.join(map(repr, args))}, got {value!r}")
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if isinstance(value, _OverrideText):
            value = _parse_list(value, key)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        item_tp = args[0] if args else Any
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{key} must have {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, _OverrideText):
            if value.lower() in _TRUE_WORDS:
                return True
            if value.lower() in _FALSE_WORDS:
                return False
        elif isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, _OverrideText):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, _OverrideText):
            try:
                number = float(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # a TOML integer past float's range: infinite, as 1e400 reads
                number = math.inf if value > 0 else -math.inf
        if number is not None and number == number:  # NaN is no setting: it passes every `< 0` check
            return number
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {tp}")


def _parse_list(text: str, key: str) -> list[Any]:
    """``[1, 2]`` (TOML syntax) or ``a,b,c`` -> a list of override strings/values."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = tomllib.loads(f"v = {stripped}")["v"]
        except tomllib.TOMLDecodeError:
            raise ConfigError(f"{key}: cannot parse list {text!r}") from None
        return [_OverrideText(str(v)).lower() if isinstance(v, bool) else v for v in items]
    if not stripped:
        return []
    return [_OverrideText(part.strip()) for part in stripped.split(",")]


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict of a dataclass config (tuples become lists, as TOML has no tuples)."""

    def convert(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: convert(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        return value

    return convert(cfg)


def config_to_toml(cfg: Any) -> str:
    """Render a config as TOML that ``load_config`` reads back to an equal config.

    ``None`` values are left out (TOML has no null), so they read back as the default; fields
    whose default is not ``None`` are never ``None`` in a valid config.
    """
    data = config_to_dict(cfg)
    lines: list[str] = []

    def emit(table: dict[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) and v is not None}
        sections = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix and (scalars or not sections):
            lines.append(f"[{prefix}]")
        for k, v in scalars.items():
            lines.append(f"{k} = {_toml_value(v)}")
        if scalars:
            lines.append("")
        for k, v in sections.items():
            emit(v, f"{prefix}.{k}" if prefix else k)

    emit(data, "")
    return "\n".join(lines).rstrip() + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            return {True: "nan"}.get(v != v, "inf" if v > 0 else "-inf")
        return repr(v)
    if isinstance(v, str):
        escaped = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
        return f'"{escaped}"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v if x is not None) + "]"
    raise ConfigError(f"cannot write {v!r} to TOML")


def changed_fields(config: Any, names: Sequence[str] | None = None) -> list[str]:
    """Those of `names` (default: every field of the dataclass `config`, in order) whose value
    in `config` is not its class's default: what a user set, for the notes on options a run
    never reads."""
    defaults = type(config)()
    names = [f.name for f in dataclasses.fields(config)] if names is None else names
    return [name for name in names if getattr(config, name) != getattr(defaults, name)]


def settings_text(section: str, config: Any, names: Sequence[str]) -> str:
    """The fields `names` of `config` as a config sets them, for a message: with ``section="trainer"``,
    ``trainer.compile_mode="max-autotune", trainer.compile_eval=true`` ("none" for None); followed by
    "has" or "have" to suit their number."""
    values = [f"{section}.{name}={_toml_value(v) if (v := getattr(config, name)) is not None else 'none'}"
              for name in names]
    return f"{', '.join(values)} {'has' if len(values) == 1 else 'have'}"


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as TOML (the run directory's ``config.toml``)."""
    write_text_atomic(path, config_to_toml(cfg))
