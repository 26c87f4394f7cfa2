"""Hyperparameter sweeps: the cartesian product of a grid of config values, one training run each.

A grid is a list of axes, each a dotted config key and the values to try
(``optim.lr=1e-3,3e-3``). Every point of the product is an ordinary training run in its own
run directory, ``OUT/<name>``, where the name spells the point's values
(``optim.lr=1e-3__model.d_model=256``), so a sweep directory reads without a summary and
`scratchlm eval` / `generate` work on each point as on any run.

Points run one after another in this process through the `Trainer` API, on the token files the
base config names (nothing is re-encoded). Every point's config is built and validated before
the first one starts, so a typo in the grid costs nothing. A sweep is resumable: a point whose
run finished (its metrics.jsonl holds an "end" record) is skipped, an unfinished one resumes
from its newest checkpoint, so a killed sweep re-run with the same command continues where it
stopped. A point that fails with a user-facing error (typically a learning rate that makes the
loss diverge) or runs out of memory is reported in the summary and the sweep goes on. Ctrl-C or
SIGTERM stops the whole sweep, not just the point: the point checkpoints the step it was on (see
`scratchlm.train.interrupt`) and stays unfinished, so the re-run resumes it.

The summary (``summary.jsonl``, ``summary.md``) is read back from each run's metrics.jsonl, so
it is the same whether the points ran now or in an earlier call; ``sweep.png`` plots the final
validation loss against the first swept key, one line per value of the others.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import math
import re
import statistics
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scratchlm.config import config_to_toml, load_config, parse_override
from scratchlm.errors import UserError
from scratchlm.fileio import write_text_atomic
from scratchlm.train.config import TrainConfig
from scratchlm.train.interrupt import TrainingInterrupted, signal_name

log = logging.getLogger("scratchlm.train")

__all__ = ["GridAxis", "SweepPoint", "parse_grid", "grid_points", "point_name", "plan_sweep", "point_status",
           "run_sweep", "summarize_run", "write_summary", "plot_sweep"]

# Keys a grid may not set: the sweep chooses each point's run directory itself.
_RESERVED = ("trainer.out_dir",)
# Characters kept in a run directory's name; anything else in a value becomes "_".
_UNSAFE = re.compile(r"[^A-Za-z0-9._+\-]")


@dataclass(frozen=True)
class GridAxis:
    """One swept key and the values to try, as typed on the command line."""

    key: str
    values: tuple[str, ...]


@dataclass
class SweepPoint:
    """One point of the grid: its values (as typed), its run directory name and its full config."""

    name: str
    values: dict[str, str]
    cfg: TrainConfig
    run_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.cfg.trainer.out_dir)


def parse_grid(specs: Sequence[str]) -> list[GridAxis]:
    """``["optim.lr=1e-3,3e-3", "model.d_model=256,512"]`` -> one `GridAxis` per spec.

    Checks only the syntax (a dotted key, ``=``, comma-separated values, no key twice, no value
    twice); whether the keys and values fit the config is `plan_sweep`'s business.
    """
    if not specs:
        raise UserError("a sweep needs at least one --grid KEY=V1,V2,... (e.g. --grid optim.lr=1e-3,3e-3)")
    axes: list[GridAxis] = []
    for spec in specs:
        text = spec[2:] if spec.startswith("--") else spec
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--grid {spec!r} must look like section.key=v1,v2 (e.g. optim.lr=1e-3,3e-3)")
        if "." not in key or not all(key.split(".")):
            raise UserError(f"--grid {spec!r}: {key!r} is not a dotted config key such as optim.lr")
        if key in _RESERVED:
            raise UserError(f"--grid {spec!r}: {key} cannot be swept (the sweep names each point's run "
                            "directory; use --out for the sweep's folder)")
        values = tuple(v.strip() for v in raw.split(","))
        if not raw.strip() or not all(values):
            raise UserError(f"--grid {spec!r} has an empty value; list the values as {key}=v1,v2")
        if len(set(values)) != len(values):
            raise UserError(f"--grid {spec!r} lists a value twice")
        if any(axis.key == key for axis in axes):
            raise UserError(f"--grid names {key} twice; give all its values in one --grid {key}=v1,v2")
        axes.append(GridAxis(key, values))
    return axes


def grid_points(axes: Sequence[GridAxis]) -> list[dict[str, str]]:
    """The cartesian product, first axis slowest: [{key: value, ...}, ...].

    >>> grid_points([GridAxis("a.x", ("1", "2")), GridAxis("b.y", ("u", "v"))])[1]
    {'a.x': '1', 'b.y': 'v'}
    """
    combos = itertools.product(*(axis.values for axis in axes))
    return [dict(zip((axis.key for axis in axes), combo)) for combo in combos]


def point_name(values: dict[str, str]) -> str:
    """The run directory name of a point: ``key=value`` pairs joined by ``__``, in grid order.

    >>> point_name({"optim.lr": "1e-3", "model.d_model": "256"})
    'optim.lr=1e-3__model.d_model=256'
    """
    return "__".join(f"{key}={_UNSAFE.sub('_', value)}" for key, value in values.items())


def _check_one_process(cfg: TrainConfig) -> None:
    """The sweep runs its points one after another in this one process: no parallel strategy."""
    if cfg.parallel.strategy != "none":
        raise UserError("scratchlm sweep runs its points one after another in one process; "
                        f"parallel.strategy must be none, not {cfg.parallel.strategy!r}")


def plan_sweep(preset: str | Path | None, overrides: Sequence[str], axes: Sequence[GridAxis],
               out: str | Path | None = None) -> list[SweepPoint]:
    """Every point's config (base preset, then `overrides`, then the point's values), validated.

    `out` is the sweep's folder (default: the base config's ``trainer.out_dir``). Raises a
    one-line `UserError` for an unknown key or a value the config refuses, before anything runs.
    """
    from scratchlm.train.run_dir import looks_like_run_dir
    from scratchlm.train.trainer import check_combinations

    base = load_config(TrainConfig, preset, overrides)
    for text in overrides:  # the point's value would silently replace the override's
        key = ".".join(parse_override(text)[0])
        if any(axis.key == key for axis in axes):
            raise UserError(f"--{key} is both an override and a --grid key; give its values in --grid {key}=... only")
    _check_one_process(base)
    if not base.data.val_path:
        raise UserError("a sweep compares validation losses: set data.val_path (a token file from `scratchlm encode`)")
    for what, path in (("data.train_path", base.data.train_path), ("data.val_path", base.data.val_path)):
        if not path:
            raise UserError(f"{what} is not set (a .bin token file from `scratchlm encode`)")
        if not Path(path).is_file():
            raise UserError(f"{what} {path} does not exist; encode it first with `scratchlm encode`")
    root = Path(out) if out is not None else Path(base.trainer.out_dir)
    if root.exists() and not root.is_dir():
        raise UserError(f"the sweep's folder {root} exists and is not a directory; choose another with --out")
    if looks_like_run_dir(root):
        raise UserError(f"the sweep's folder {root} is the directory of a training run; choose another with --out")
    points, seen, same_values = [], {}, {}
    for values in grid_points(axes):
        name = point_name(values)
        if name in seen:
            raise UserError(f"--grid points {values} and {seen[name]} get the same run directory name {name}; "
                            "use values that differ in letters, digits, '.', '+' or '-'")
        seen[name] = values
        point_overrides = [f"--{key}={value}" for key, value in values.items()]
        try:
            cfg = load_config(TrainConfig, preset, [*overrides, *point_overrides,
                                                    f"--trainer.out_dir={root / name}"])
            _check_one_process(cfg)  # (a --grid over parallel.strategy)
            _check_data(cfg)
            check_combinations(cfg)  # what the trainer would refuse only when the point starts
        except UserError as exc:
            raise UserError(f"--grid point {name}: {exc}") from None
        point = SweepPoint(name, dict(values), cfg)
        typed = repr(swept_values(point))  # 1e-3 and 0.001 are one value: one run, not two
        if typed in same_values:
            raise UserError(f"--grid points {same_values[typed]} and {name} are the same config values "
                            f"({typed[1:-1]}); list each value once")
        same_values[typed] = name
        points.append(point)
    return points


def _check_data(cfg: TrainConfig) -> None:
    """The token files fit the point's model (vocabulary, context length), so a grid over
    model.vocab_size or model.context_length fails here rather than after the points before it."""
    from scratchlm.data.token_file import open_checked
    from scratchlm.train.data_feed import check_held_out

    for what in ("train_path", "val_path"):
        open_checked(getattr(cfg.data, what), vocab_size=cfg.model.vocab_size,
                     context_length=cfg.model.context_length, what=f"data.{what}")
    check_held_out(cfg.data)


def point_status(point: SweepPoint) -> str:
    """"new" (nothing written yet), "finished" (its run logged its end) or "unfinished".

    A run directory that holds a different config (the sweep's command changed since it ran)
    is refused: resuming or skipping it would mix two experiments under one name. The configs
    are compared as parsed TOML, so key order and number spelling do not matter, and a key the
    saved config does not name (written before the key existed) compares as its default.
    ``trainer.out_dir`` is not compared: the sweep sets it to ``run_dir`` itself, which the saved
    config may spell otherwise (``--out`` given as an absolute path, or the sweep's folder moved).
    """
    run_dir = point.run_dir
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return "new"
    saved = run_dir / "config.toml"
    if saved.is_file():
        try:
            old = _flat_toml(saved.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{saved} is not valid TOML ({exc}); move the run aside or use another --out") from None
        old = {**_flat_toml(config_to_toml(type(point.cfg)())), **old}
        new = _flat_toml(config_to_toml(point.cfg))
        changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and k not in _RESERVED)
        if changed:
            raise UserError(f"{run_dir} holds a run of a different config than this sweep's point {point.name} "
                            f"(it differs in {', '.join(changed)}); rerun with the same config and overrides, "
                            "or use another --out")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and any(r.get("event") == "end" for r in _read_records(metrics)):
        return "finished"
    return "unfinished"


def _flat_toml(text: str) -> dict[str, Any]:
    """A TOML document's values by dotted key (``optim.lr``)."""
    flat: dict[str, Any] = {}

    def walk(table: dict[str, Any], prefix: str) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = value

    walk(tomllib.loads(text), "")
    return flat


def run_sweep(points: Sequence[SweepPoint], out: str | Path, *,
              echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run (or skip, or resume) every point in order, then write the summary and plot.

    Returns the summary rows (see `summarize_run`). `echo` receives one line per point.
    """
    out = Path(out)
    statuses = [point_status(p) for p in points]  # refuses a changed config before anything runs
    out.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    for i, (point, status) in enumerate(zip(points, statuses), 1):
        label = f"point {i}/{len(points)} {' '.join(f'{k}={v}' for k, v in point.values.items())}"
        if status == "finished":
            row = summarize_run(point.run_dir)
            echo(f"{label}: finished already, val {_fmt(row['final_val_loss'], '.3f')}")
            continue
        start = time.perf_counter()
        try:
            _train_point(point, resume=status == "unfinished")
        except TrainingInterrupted as exc:
            # Not a failure, and the sweep stops here: the point's run has no "end" record, so
            # rerunning the sweep resumes it from the checkpoint written when it stopped.
            saved = f"at step {exc.step} (checkpoint saved)" if exc.checkpoint else "before its checkpoint was written"
            raise TrainingInterrupted(f"interrupted by {signal_name(exc.signum)} in {label} {saved}; rerun the "
                                      "same command to continue the sweep", signum=exc.signum, step=exc.step,
                                      checkpoint=exc.checkpoint) from None
        except UserError as exc:
            errors[point.name] = str(exc)
        except Exception as exc:  # out of memory: the next (smaller) point may still fit
            if not _is_out_of_memory(exc):
                raise
            errors[point.name] = f"out of memory: {str(exc).splitlines()[0]}"
        finally:
            _release_memory(compiled=point.cfg.trainer.compile)
        seconds = time.perf_counter() - start
        if point.name in errors:
            echo(f"{label}: failed ({seconds:.0f} s): {errors[point.name]}")
        else:
            row = summarize_run(point.run_dir)
            echo(f"{label}: val {_fmt(row['final_val_loss'], '.3f')} ({seconds:.0f} s)")
    rows = []
    for point in points:
        row = {"name": point.name, "values": swept_values(point), **summarize_run(point.run_dir)}
        if point.name in errors:
            row["error"] = errors[point.name]
        rows.append(row)
    write_summary(rows, out)
    try:
        plot_sweep(rows, out / "sweep.png")
    except Exception as exc:  # a plotting problem must not hide the summary just written
        log.warning("could not write sweep.png: %s", exc)
    return rows


def _train_point(point: SweepPoint, *, resume: bool) -> None:
    """One ordinary training run of `point` in its run directory (resumed when it has begun)."""
    from scratchlm.parallel.strategy import init_strategy
    from scratchlm.train.run_dir import prepare_run_dir
    from scratchlm.train.trainer import Trainer

    cfg = point.cfg
    prepare_run_dir(point.run_dir, resume=resume, overwrite=False)
    strategy = init_strategy(cfg.parallel, device=cfg.trainer.device)
    try:
        trainer = Trainer(cfg, point.run_dir, resume=resume, strategy=strategy)
        try:
            trainer.fit()
        finally:
            trainer.logger.close()
    finally:
        strategy.close()


def _is_out_of_memory(exc: Exception) -> bool:
    """A device or host allocation that failed: CUDA's OutOfMemoryError, numpy's MemoryError, or
    the plain RuntimeError of torch's CPU allocator ("can't allocate memory")."""
    import torch

    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and any(words in str(exc) for words in ("out of memory", "can't allocate memory")))


def _release_memory(*, compiled: bool) -> None:
    """Free what the finished point held, so the next one starts from a clean device and, after a
    compiled run, a fresh torch.compile cache (other shapes would count against its recompile limit)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if compiled:
        torch._dynamo.reset()


def swept_values(point: SweepPoint) -> dict[str, Any]:
    """The point's swept values as the config holds them (typed: 0.001, 256, "cosine", True)."""
    values = {}
    for key in point.values:
        node: Any = point.cfg
        for part in key.split("."):
            node = getattr(node, part)
        values[key] = node
    return values


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """One summary row from a run's metrics.jsonl (None where the run has not logged it yet).

    ``final_val_loss`` is the last evaluation, ``best_val_loss`` the lowest; ``steps`` the last
    logged training step; ``tokens`` = steps x trainer.batch_size x model.context_length (from
    the run's config.toml); ``wall_s`` the training loop's seconds: the newest ``elapsed_s``
    where the trainer logs one, else the sum over the log windows of their tokens / tokens_per_s
    (evaluations and compilation inside a window included); ``tokens_per_s`` = tokens / wall_s;
    ``steady_tokens_per_s`` the median of the logged rates after the first log window (the one
    that holds compilation), the speed of the step itself.
    """
    import tomllib

    run_dir = Path(run_dir)
    row: dict[str, Any] = {"run_dir": str(run_dir), "final_val_loss": None, "best_val_loss": None,
                           "steps": 0, "tokens": 0, "wall_s": None, "tokens_per_s": None,
                           "steady_tokens_per_s": None, "finished": False}
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.toml"
    if not metrics.is_file() or not config.is_file():
        return row
    cfg = tomllib.loads(config.read_text(encoding="utf-8"))
    tokens_per_step = cfg["trainer"]["batch_size"] * cfg["model"]["context_length"]
    records = _read_records(metrics)
    evals = [r["val_loss"] for r in records if r.get("event") == "eval"]
    seconds, prev_step = 0.0, 0
    for r in records:
        if r.get("event") == "train" and r["step"] > prev_step and r.get("tokens_per_s"):
            seconds += (r["step"] - prev_step) * tokens_per_step / r["tokens_per_s"]
            prev_step = r["step"]
    elapsed = [r["elapsed_s"] for r in records if isinstance(r.get("elapsed_s"), (int, float))]
    if elapsed:
        seconds = max(elapsed)
    steps = max((r["step"] for r in records if r.get("event") == "train"), default=0)
    rates = [r["tokens_per_s"] for r in records if r.get("event") == "train" and r.get("tokens_per_s")]
    row.update(steady_tokens_per_s=statistics.median(rates[1:] or rates) if rates else None)
    row.update(final_val_loss=evals[-1] if evals else None, best_val_loss=min(evals) if evals else None,
               steps=steps, tokens=steps * tokens_per_step, wall_s=seconds if seconds else None,
               tokens_per_s=steps * tokens_per_step / seconds if seconds else None,
               finished=any(r.get("event") == "end" for r in records))
    return row


def _read_records(path: Path) -> list[dict[str, Any]]:
    from scratchlm.train.metrics import read_metrics

    return read_metrics(path)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def write_summary(rows: Sequence[dict[str, Any]], out: str | Path) -> tuple[Path, Path]:
    """``summary.jsonl`` (one row a line) and ``summary.md`` (a table, best final loss in bold)."""
    out = Path(out)
    jsonl = out / "summary.jsonl"
    write_text_atomic(jsonl, "".join(json.dumps(row) + "\n" for row in rows))
    keys = list(rows[0]["values"]) if rows else []
    done = [r for r in rows if r["final_val_loss"] is not None and "error" not in r]  # a failed point is no best
    best = min(done, key=lambda r: r["final_val_loss"]) if done else None
    lines = ["| " + " | ".join([*keys, "final val loss", "best val loss", "steps", "tokens", "wall s", "tokens/s",
                                 "steady tokens/s"]) + " |", "|" + "---|" * len(keys) + "---:|" * 7]
    for r in rows:
        final = _fmt(r["final_val_loss"], ".4f")
        if r is best:
            final = f"**{final}**"
        if "error" in r:
            final += f" (failed: {r['error']})"
        cells = [*(str(r["values"][k]) for k in keys), final, _fmt(r["best_val_loss"], ".4f"), f"{r['steps']:,}",
                 f"{r['tokens']:,}", _fmt(r["wall_s"], ".1f"), _fmt(r["tokens_per_s"], ",.0f"),
                 _fmt(r.get("steady_tokens_per_s"), ",.0f")]
        lines.append("| " + " | ".join(cells) + " |")
    if best is not None:
        lines += ["", f"Lowest final validation loss: {best['name']} ({best['final_val_loss']:.4f})."]
    md = out / "summary.md"
    write_text_atomic(md, "\n".join(lines) + "\n")
    return jsonl, md


def _is_lr_like(key: str, xs: Sequence[Any]) -> bool:
    """Log-x for learning rates, and for any positive numeric axis spanning 100x or more."""
    leaf = key.rsplit(".", 1)[-1]
    numeric = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    if len(numeric) != len(xs) or not numeric or min(numeric) <= 0:
        return False
    return leaf.endswith("lr") or leaf in ("weight_decay", "eps") or max(numeric) / min(numeric) >= 100


def _hashable(value: Any) -> Any:
    """`value` with its lists (and dicts) as tuples, to group by: list-valued settings such as
    trainer.sample_prompts can be swept too."""
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def plot_sweep(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Final validation loss against the first swept key; one line per combination of the other
    keys' values. Non-numeric values sit at evenly spaced positions."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from scratchlm.train.plots import save_figure

    path = Path(path)
    keys = list(rows[0]["values"]) if rows else []
    x_key, other = (keys[0], keys[1:]) if keys else ("", [])
    x_values = {_hashable(r["values"][x_key]): r["values"][x_key] for r in rows} if keys else {}
    xs = list(x_values.values())
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
    position = {key: (x if numeric else i) for i, (key, x) in enumerate(x_values.items())}
    groups: dict[tuple, tuple[tuple, list[dict[str, Any]]]] = {}
    for r in rows:
        combo = tuple(r["values"][k] for k in other)
        groups.setdefault(_hashable(combo), (combo, []))[1].append(r)

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for combo, members in groups.values():
        pts = sorted((position[_hashable(r["values"][x_key])], r["final_val_loss"]) for r in members
                     if r["final_val_loss"] is not None and math.isfinite(r["final_val_loss"]))
        label = ", ".join(f"{k}={v}" for k, v in zip(other, combo)) or None
        if pts:
            ax.plot([p for p, _ in pts], [v for _, v in pts], "o-", label=label, markersize=5)
    if _is_lr_like(x_key, xs):
        ax.set_xscale("log")
    if not numeric:
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_xlabel(x_key)
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("sweep")
    ax.grid(alpha=0.3)
    if other:
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
