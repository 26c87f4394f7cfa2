"""Speedrun: the validation loss `scratchlm train` and the torch.nn reference trainer reach in the
same wall-clock budgets, on the same token files, at the same model shape.

For each budget (``--budgets 60 180 600``, seconds of training including compilation), both
trainers run once, one after the other, each in a fresh process:

- **reference**: ``benchmarks/reference_trainer.py --time-budget-s N`` (torch.nn model, fused
  ``torch.optim.AdamW``, compiled on CUDA), at its own best learning rate: a short sweep over
  ``--ref-lrs`` at the ``--ref-lr-budget`` budget picks it first (its min_lr keeps the preset's
  min_lr / lr ratio);
- **scratchlm**: ``scratchlm train PRESET --trainer.time_budget_s=N`` with the speed settings and
  ``--recipe`` overrides of `scratchlm_train_command`, the one place that builds its command line.

Both keep the same training clock (from the first step, compilation included, stopped during
evaluations) and schedule (warm-up in steps scaling a cosine decay over elapsed / budget), both
evaluate the first ``eval_batches`` x ``batch_size`` validation windows every
``--eval-interval`` steps, and the loss compared is each model's on the
whole validation file: the reference's own final evaluation, and ``scratchlm eval RUN --batches 0``
for scratchlm, which reads the same sequential windows. "Time to the reference's loss" is when a
run's validation curve first reaches the reference's final loss of that budget, interpolated
linearly between evaluations; curve and target are losses on the periodic evaluations' windows
(the last point of each curve is the final model on them), since only those were measured
during the runs.

Data: ``--train-bin/--val-bin/--tokenizer`` (files from ``scratchlm encode``), or else Project
Gutenberg books from ``--data-dir`` (``train_00.txt.zst`` and ``valid.txt.zst`` of
``../shared/data/gutenberg``), decompressed, tokenized with a ``--vocab-size`` byte-level BPE
trained by ``scratchlm train-bpe`` on the training text and encoded once into ``WORK/data``
(reused by later calls), as for docs/benchmarks/training.md.

    python benchmarks/speedrun.py --shape 17m --budgets 60 180 600 --ref-lrs 1e-3 2e-3 4e-3 \\
        --recipe optim.name=muon model.qk_norm=true --out docs/benchmarks/speedrun.json
    python benchmarks/speedrun.py --shape 17m --budgets 60 180 600 --sides scratchlm \\
        --reference-json docs/benchmarks/speedrun.json --recipe optim.schedule=wsd --out wsd.json

``--ref-tokens N`` also trains the reference for N tokens (its schedule over those steps, at its
best lr) and reports how long each scratchlm run takes to reach that run's final loss, as a
fraction of that run's time.

``--compile-cache`` sets the state of torch.compile's on-disk caches for every timed run, both
sides alike: ``cold`` (the default: an empty cache of its own for each run, so each pays for all
of its compilation, as a first run on a machine does), ``warm`` (each run's cache filled first
by the same command with a one-second budget) or ``machine`` (torch's default cache, as the
earlier runs on the machine left it: what the first figures used, where the order of the runs
decided which side compiled from scratch).

``--reference-json`` reads the reference side of each budget from an earlier call's JSON instead of
running it (a sweep of recipes pays for the reference once).

``--seed N`` seeds both sides (model initialisation and batch order) with N instead of the
preset's seed: a second seed of a comparison is the same command with another ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from scratchlm.bench.results import environment, read_jsonl, write_json

REPO = Path(__file__).resolve().parents[1]
REFERENCE_TRAINER = Path(__file__).resolve().parent / "reference_trainer.py"
MAX_STEPS = 100_000_000  # the budget stops the runs; the step cap only has to be out of reach


@dataclass(frozen=True)
class Shape:
    """A preset and the overrides that make it fit one GPU without gradient accumulation (the
    reference trainer has none); the model, batch and optimizer settings of both sides come
    from the resolved config."""

    preset: str
    overrides: tuple[str, ...] = ()
    eval_interval: int = 1000  # steps between the periodic evaluations


SHAPES = {
    "17m": Shape("tinystories-17m", eval_interval=1000),
    # GPT-2 small at 32 x 1024 tokens a step; the preset's 700 warm-up steps would outlast a
    # one-minute budget.
    "124m": Shape("gpt2-small", ("--trainer.batch_size=32", "--trainer.grad_accum_steps=1",
                                 "--optim.warmup_steps=100"), eval_interval=200),
    # A CPU check of the plumbing, seconds per run.
    "tiny": Shape("tiny-cpu", ("--model.context_length=16", "--model.d_model=32", "--model.num_layers=1",
                               "--model.num_heads=4", "--model.d_ff=48", "--trainer.batch_size=4",
                               "--trainer.eval_batches=2", "--optim.warmup_steps=10", "--trainer.device=auto"),
                  eval_interval=100),
}


def recipe_overrides(recipe: list[str]) -> list[str]:
    """``["optim.name=muon", "--model.qk_norm=true"]`` -> ``["--optim.name=muon", "--model.qk_norm=true"]``."""
    out = []
    for item in recipe:
        body = item[2:] if item.startswith("--") else item
        key, sep, _ = body.partition("=")
        if not sep or "." not in key:
            raise SystemExit(f"speedrun: --recipe {item!r} must look like section.key=value")
        out.append(f"--{body}")
    return out


def log_interval(eval_interval: int) -> int:
    """A tenth of the evaluation interval where that divides it, else the interval itself: every
    evaluation then has a train record at its step (and its seconds), and both sides log alike."""
    return eval_interval // 10 if eval_interval % 10 == 0 else eval_interval


def seeded(shape: Shape, seed: int | None) -> Shape:
    """`shape` with `seed` for both sides (`--trainer.seed`, which the reference's command reads
    from the resolved config too), or unchanged for None (the preset's seed)."""
    return shape if seed is None else replace(shape, overrides=(*shape.overrides, f"--trainer.seed={seed}"))


def scratchlm_train_command(shape: Shape, *, budget_s: float, out: Path, data: dict[str, Any], eval_interval: int,
                            recipe: list[str], cuda: bool) -> list[str]:
    """The `scratchlm train` command line of one budget: the scratchlm side of the comparison.

    The speed settings (CUDA graphs, the Triton attention) apply on CUDA; the recipe's overrides
    come last, so they win over everything before them.
    """
    speed = ["--trainer.compile=true", "--trainer.compile_mode=reduce-overhead",
             "--model.attention_backend=flash_triton"] if cuda else []
    return [sys.executable, "-m", "scratchlm", "train", shape.preset, *shape.overrides,
            f"--model.vocab_size={data['vocab_size']}", f"--data.train_path={data['train_bin']}",
            f"--data.val_path={data['val_bin']}", f"--data.tokenizer_dir={data['tokenizer']}",
            f"--trainer.out_dir={out}", f"--trainer.time_budget_s={budget_s:g}", f"--trainer.max_steps={MAX_STEPS}",
            "--trainer.eval_at_start=false", f"--trainer.eval_interval={eval_interval}",
            f"--trainer.log_interval={log_interval(eval_interval)}", "--trainer.checkpoint_interval=0",
            "--trainer.sample_tokens=0", "--trainer.progress=false", *speed, *recipe_overrides(recipe),
            "--overwrite"]


def reference_command(cfg, *, budget_s: float, lr: float, out: Path, data: dict[str, Any], eval_interval: int,
                      cuda: bool) -> list[str]:
    """The reference trainer's command line: `cfg`'s model, batch and optimizer at learning rate `lr`."""
    m, o, t = cfg.model, cfg.optim, cfg.trainer
    min_lr = lr * o.min_lr / o.lr if o.lr else o.min_lr
    return [sys.executable, str(REFERENCE_TRAINER), "--train-bin", str(data["train_bin"]),
            "--val-bin", str(data["val_bin"]), "--out", str(out), "--vocab-size", str(data["vocab_size"]),
            "--context-length", str(m.context_length), "--d-model", str(m.d_model), "--num-layers", str(m.num_layers),
            "--num-heads", str(m.num_heads), "--d-ff", str(m.d_ff), "--rope-theta", str(m.rope_theta),
            "--batch-size", str(t.batch_size), "--steps", str(MAX_STEPS), "--lr", f"{lr:g}", "--min-lr", f"{min_lr:g}",
            "--warmup", str(o.warmup_steps), "--weight-decay", str(o.weight_decay), "--beta1", str(o.beta1),
            "--beta2", str(o.beta2), "--grad-clip", str(o.grad_clip), "--eval-interval", str(eval_interval),
            "--eval-batches", str(t.eval_batches), "--log-interval", str(log_interval(eval_interval)),
            "--seed", str(t.seed), "--time-budget-s", f"{budget_s:g}", *(["--compile"] if cuda else [])]


def reference_steps_command(cfg, *, steps: int, lr: float, out: Path, data: dict[str, Any], eval_interval: int,
                            cuda: bool) -> list[str]:
    """The reference trainer for a fixed number of steps (its schedule over those steps), no time budget."""
    cmd = reference_command(cfg, budget_s=0, lr=lr, out=out, data=data, eval_interval=eval_interval, cuda=cuda)
    cmd[cmd.index("--steps") + 1] = str(steps)
    cut = cmd.index("--time-budget-s")
    return cmd[:cut] + cmd[cut + 2:]


def run_logged(cmd: list[str], log_path: Path, env_extra: dict[str, str] | None = None) -> None:
    """Run `cmd` with its output in `log_path` (and the scratchlm this script imports on its path),
    with `env_extra` added to its environment."""
    import scratchlm

    env = {**os.environ, **(env_extra or {})}
    src = str(Path(scratchlm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print("$ " + " ".join(cmd[1:]), flush=True)
    with open(log_path, "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-5:])
        raise RuntimeError(f"{cmd[1]} {cmd[2] if len(cmd) > 2 else ''} failed ({done.returncode}); "
                           f"see {log_path}:\n{tail}")


CACHE_MODES = ("cold", "warm", "machine")


def cache_env(directory: Path) -> dict[str, str]:
    """The environment that puts torch.compile's on-disk caches (Inductor's, Triton's) in `directory`."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(directory), "TRITON_CACHE_DIR": str(directory / "triton")}


def timed_run(cmd: list[str], log_path: Path, *, mode: str, cache: Path, warm_cmd: list[str] | None = None) -> None:
    """Run one timed training command with its compile cache in the state `mode` names:

    - ``cold``: an empty cache of its own (`cache`, emptied first): the run pays for all of its
      compilation, as a first run on a machine does; both sides alike.
    - ``warm``: `cache` as left by `warm_cmd` (the same training for a budget of one second,
      run first into it), so the run finds every graph it compiles already built; both sides alike.
    - ``machine``: torch's default cache, in whatever state earlier runs on the machine left it
      (the figures then depend on the order of the runs).
    """
    if mode == "machine":
        run_logged(cmd, log_path)
        return
    if mode == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    if mode == "warm" and warm_cmd is not None:
        run_logged(warm_cmd, log_path.with_name(log_path.stem + "-warmup.log"), cache_env(cache))
    run_logged(cmd, log_path, cache_env(cache))


def with_budget(cmd: list[str], budget_s: float, out: Path) -> list[str]:
    """`cmd` (either side's) with another time budget and output folder: its cache warm-up."""
    swapped = list(cmd)
    for i, arg in enumerate(cmd):
        if arg.startswith("--trainer.time_budget_s="):
            swapped[i] = f"--trainer.time_budget_s={budget_s:g}"
        elif arg.startswith("--trainer.out_dir="):
            swapped[i] = f"--trainer.out_dir={out}"
        elif arg == "--time-budget-s" and i + 1 < len(cmd):
            swapped[i + 1] = f"{budget_s:g}"
        elif arg == "--out" and i + 1 < len(cmd):
            swapped[i + 1] = str(out)
    return swapped


# ---------------------------------------------------------------------------------- reading runs

def reference_result(run: Path) -> dict[str, Any]:
    """Steps, tokens, seconds, final validation loss (whole file) and validation curve (seconds,
    loss on the periodic evaluations' windows; its last point is the final model) of a reference run."""
    summary = json.loads((run / "summary.json").read_text())
    curve = [(r["elapsed_s"], r["val_loss"]) for r in read_jsonl(run / "metrics.jsonl")
             if r["event"] == "eval" and not r.get("full_validation")]
    return {"steps": summary["steps"], "tokens": summary["tokens"], "seconds": summary["train_seconds"],
            "val_loss": summary["final_val_loss"], "window_val_loss": summary["final_window_val_loss"],
            "curve": curve}


def reference_tokens_result(run: Path) -> dict[str, Any]:
    """Tokens, steps, seconds (compilation included, evaluations not), final loss on the evaluation
    windows and validation curve of a fixed-steps reference run."""
    summary = json.loads((run / "summary.json").read_text())
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "eval"]
    return {"tokens": summary["tokens"], "steps": evals[-1]["step"], "seconds": summary["train_seconds"],
            "window_val_loss": summary["final_val_loss"],
            "curve": [(r["train_seconds"], r["val_loss"]) for r in evals if r["step"] > 0]}


def scratchlm_result(run: Path) -> dict[str, Any]:
    """Steps, tokens, seconds and validation curve of a `scratchlm train` run, from its metrics.jsonl.

    Seconds are the records' ``elapsed_s`` where the trainer logs it; otherwise they are rebuilt
    from the train records, each window's tokens over its ``tokens_per_s``. The curve holds the
    periodic evaluations before the last step (the one at the last step may cover the whole
    file; the comparison adds the final model's point itself). ``val_loss`` is the trainer's own
    last evaluation (the comparison replaces it with `scratchlm eval`'s of the whole file).
    """
    cfg = tomllib.loads((run / "config.toml").read_text())
    tokens_per_step = cfg["trainer"]["batch_size"] * cfg["model"]["context_length"]
    records = read_jsonl(run / "metrics.jsonl")
    at_step, seconds, prev = {0: 0.0}, 0.0, 0
    for r in records:
        if r["event"] == "train" and r["step"] > prev:
            if "elapsed_s" in r:
                seconds = r["elapsed_s"]
            else:
                seconds += (r["step"] - prev) * tokens_per_step / r["tokens_per_s"]
            at_step[r["step"]] = seconds
            prev = r["step"]
    steps = max((r["step"] for r in records if r["event"] in ("train", "end")), default=0)
    evals = [r for r in records if r["event"] == "eval"]
    curve = [(r.get("elapsed_s", at_step.get(r["step"])), r["val_loss"]) for r in evals if 0 < r["step"] < steps]
    total = max([seconds, *(r["elapsed_s"] for r in records if "elapsed_s" in r)])
    return {"steps": steps, "tokens": steps * tokens_per_step, "seconds": total,
            "val_loss": evals[-1]["val_loss"] if evals else None,
            "curve": [(when, loss) for when, loss in curve if when is not None]}


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """Seconds at which the validation curve [(seconds, loss), ...] first reaches `target`,
    interpolated linearly between evaluations; None when it never does.

    >>> time_to_reach([(10.0, 4.0), (20.0, 3.0), (30.0, 2.5)], 3.5)
    15.0
    """
    prev = None
    for seconds, loss in sorted(curve):
        if loss <= target:
            if prev is None or prev[1] == loss:
                return seconds
            return prev[0] + (prev[1] - target) / (prev[1] - loss) * (seconds - prev[0])
        prev = (seconds, loss)
    return None


# ---------------------------------------------------------------------------------- data

def prepare_data(args) -> dict[str, Any]:
    """The token files and tokenizer: given, or built once from the Gutenberg books in WORK/data."""
    if args.train_bin or args.val_bin or args.tokenizer is not None:
        if not (args.train_bin and args.val_bin and args.tokenizer is not None):
            raise SystemExit("speedrun: give --train-bin, --val-bin and --tokenizer together")
        train_bin, val_bin, tokenizer = Path(args.train_bin), Path(args.val_bin), args.tokenizer
    else:
        data = args.work / "data"
        data.mkdir(parents=True, exist_ok=True)
        texts = {}
        for name in ("train_00", "valid"):
            texts[name] = data / f"{name}.txt"
            if not texts[name].is_file():
                decompress(args.data_dir / f"{name}.txt.zst", texts[name])
        tokenizer = data / "tokenizer"
        if not (tokenizer / "vocab.json").is_file():
            run_logged([sys.executable, "-m", "scratchlm", "train-bpe", str(texts["train_00"]), "--vocab-size",
                        str(args.vocab_size), "--special-token", "<|endoftext|>", "--out", str(tokenizer), "--quiet"],
                       data / "train-bpe.log")
        train_bin, val_bin = data / "train.bin", data / "valid.bin"
        for text, out in ((texts["train_00"], train_bin), (texts["valid"], val_bin)):
            if not out.with_suffix(".json").is_file():
                run_logged([sys.executable, "-m", "scratchlm", "encode", str(text), "--tokenizer", str(tokenizer),
                            "--out", str(out), "--no-progress"], data / f"encode-{out.stem}.log")
    sidecar = json.loads(Path(val_bin).with_suffix(".json").read_text())
    if sidecar.get("dtype", "uint16") != "uint16":
        raise SystemExit("speedrun: the reference trainer reads uint16 token files; use a vocabulary under 65,536")
    return {"train_bin": str(train_bin), "val_bin": str(val_bin), "tokenizer": str(tokenizer),
            "vocab_size": int(sidecar["vocab_size"])}


def decompress(src: Path, dst: Path) -> None:
    """``zstd -d src -o dst``, atomically (a partial file never looks finished)."""
    tmp = dst.with_suffix(dst.suffix + ".part")
    try:
        import zstandard

        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            zstandard.ZstdDecompressor().copy_stream(fin, fout)
    except ImportError:
        if shutil.which("zstd") is None:
            raise SystemExit("speedrun: decompressing .zst needs the zstandard package or the zstd command") from None
        subprocess.run(["zstd", "-q", "-f", "-d", str(src), "-o", str(tmp)], check=True)
    os.replace(tmp, dst)


# ---------------------------------------------------------------------------------- the table

def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    """The printed table: one line per budget."""
    header = ("budget s", "ref lr", "ref val", "scratchlm val", "diff nats", "ref steps", "scratchlm steps",
              "ref tokens", "scratchlm tokens", "ref s to ref loss", "scratchlm s to ref loss")
    tokens_run = any("ref_tokens_time_ratio" in r for r in rows)
    if tokens_run:  # the reference's fixed-tokens run (--ref-tokens): scratchlm's time to its loss, / its time
        header += ("scratchlm s to ref-tokens loss", "x ref-tokens time")
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for r in rows:
        ref, ours = r.get("reference") or {}, r.get("scratchlm") or {}
        cells = [
            fmt(r["budget_s"], "g"), fmt(r.get("ref_lr"), "g"), fmt(ref.get("val_loss"), ".4f"),
            fmt(ours.get("val_loss"), ".4f"), fmt(r.get("diff_nats"), "+.4f"), fmt(ref.get("steps"), ","),
            fmt(ours.get("steps"), ","), fmt(ref.get("tokens"), ","), fmt(ours.get("tokens"), ","),
            fmt(ref.get("seconds_to_ref_loss"), ".1f"), fmt(ours.get("seconds_to_ref_loss"), ".1f")]
        if tokens_run:
            cells += [fmt(ours.get("seconds_to_ref_tokens_loss"), ".1f"), fmt(r.get("ref_tokens_time_ratio"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare(reference: dict[str, Any] | None, ours: dict[str, Any] | None) -> dict[str, Any]:
    """The row's derived figures: the loss difference on the whole file (scratchlm - reference,
    nats) and each side's time to the reference's final loss on the evaluation windows."""
    row: dict[str, Any] = {"diff_nats": None}
    if reference is not None:
        target = reference["window_val_loss"]
        reference["seconds_to_ref_loss"] = time_to_reach(reference["curve"], target)
        if ours is not None:
            ours["seconds_to_ref_loss"] = time_to_reach(ours["curve"], target)
            if ours.get("val_loss") is not None:
                row["diff_nats"] = ours["val_loss"] - reference["val_loss"]
    return row


# ---------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="17m")
    p.add_argument("--budgets", type=float, nargs="+", default=[60.0, 180.0, 600.0],
                   help="wall-clock budgets in seconds (compilation included)")
    p.add_argument("--ref-lrs", type=float, nargs="+",
                   help="learning rates the reference tries at --ref-lr-budget (default: the preset's)")
    p.add_argument("--ref-lr-budget", type=float, help="budget of the reference's lr sweep (default: the shortest)")
    p.add_argument("--recipe", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides of the scratchlm side, e.g. optim.name=muon model.qk_norm=true")
    p.add_argument("--sides", nargs="+", choices=("reference", "scratchlm"), default=["reference", "scratchlm"])
    p.add_argument("--reference-json", type=Path, metavar="JSON",
                   help="take the reference side of every budget from this earlier speedrun JSON (same data and "
                        "shape) instead of running it: a recipe sweep then runs scratchlm alone")
    p.add_argument("--eval-interval", type=int, help="steps between periodic evaluations (default: per shape)")
    p.add_argument("--seed", type=int, help="seed of both sides' runs (default: the preset's), for a second seed of a comparison")
    p.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data" / "gutenberg")
    p.add_argument("--vocab-size", type=int, default=10_000, help="BPE vocabulary built from --data-dir")
    p.add_argument("--train-bin", help="an encoded training file (skips building the data)")
    p.add_argument("--val-bin", help="an encoded validation file")
    p.add_argument("--tokenizer", help="the tokenizer directory of those files ('' for none)")
    p.add_argument("--ref-tokens", type=float, metavar="N",
                   help="also train the reference for N tokens (e.g. 40.96e6) at its best lr, schedule over those "
                        "steps: the time scratchlm's runs take to reach its final loss is compared with its own")
    p.add_argument("--compile-cache", choices=CACHE_MODES, default="cold",
                   help="the state of torch.compile's caches for every timed run, both sides alike: cold (an empty "
                        "cache each: compilation counts in full), warm (each filled first by a 1-second run of the "
                        "same command), machine (torch's default cache as earlier runs left it)")
    p.add_argument("--work", type=Path, default=Path("runs/speedrun"), help="runs, logs and the built data")
    p.add_argument("--out", type=Path, help="JSON results (default: WORK/speedrun.json)")
    return p


def main(argv=None) -> int:
    import torch

    from scratchlm.config import load_config
    from scratchlm.train.config import TrainConfig

    args = build_parser().parse_args(argv)
    out_json = args.out or args.work / "speedrun.json"
    shape = seeded(SHAPES[args.shape], args.seed)
    recipe_overrides(args.recipe)  # refuse a malformed recipe before anything runs
    cuda = torch.cuda.is_available()
    data = prepare_data(args)
    cfg = load_config(TrainConfig, shape.preset, [*shape.overrides, f"--model.vocab_size={data['vocab_size']}"])
    eval_interval = args.eval_interval or shape.eval_interval
    budgets = sorted(args.budgets)
    results: dict[str, Any] = {
        "environment": environment(), "shape": args.shape, "preset": shape.preset,
        "shape_overrides": list(shape.overrides),
        "model": {k: getattr(cfg.model, k) for k in ("vocab_size", "context_length", "d_model", "num_layers",
                                                      "num_heads", "d_ff")},
        "batch_size": cfg.trainer.batch_size, "eval_interval": eval_interval, "recipe": list(args.recipe),
        "compile_cache": args.compile_cache, "data": data, "ref_lr_sweep": None, "rows": []}

    def run_timed(cmd: list[str], out: Path, log_path: Path) -> None:
        timed_run(cmd, log_path, mode=args.compile_cache, cache=out.parent / f"{out.name}.compile-cache",
                  warm_cmd=with_budget(cmd, 1.0, out.parent / f"{out.name}.warmup"))

    earlier = read_reference_json(args.reference_json) if args.reference_json else None
    stored = (stored_references(earlier, args.reference_json, budgets, shape=args.shape,
                                vocab_size=data["vocab_size"]) if earlier is not None else None)
    if stored is not None:
        results["reference_from"] = str(args.reference_json)
        args.sides = [side for side in args.sides if side != "reference"]
        theirs = earlier.get("compile_cache", "machine")
        if theirs != args.compile_cache:
            print(f"note: the stored reference ran with --compile-cache {theirs}, this scratchlm side with "
                  f"{args.compile_cache}: their compilation times are not alike", flush=True)
    ref_lrs = args.ref_lrs or [cfg.optim.lr]
    sweep_budget = args.ref_lr_budget or budgets[0]
    ref_runs: dict[tuple[float, float], Path] = {}
    best_lr = ref_lrs[0]
    if "reference" in args.sides:
        if len(ref_lrs) > 1:
            sweep = []
            for lr in ref_lrs:
                run = args.work / f"ref_lr_{lr:g}_{sweep_budget:g}s"
                run_timed(reference_command(cfg, budget_s=sweep_budget, lr=lr, out=run, data=data,
                                            eval_interval=eval_interval, cuda=cuda), run, run / "log.txt")
                ref_runs[(lr, sweep_budget)] = run
                sweep.append({"lr": lr, "val_loss": reference_result(run)["val_loss"]})
                print(f"reference lr {lr:g}: val {sweep[-1]['val_loss']:.4f} after {sweep_budget:g} s")
            best_lr = min(sweep, key=lambda s: s["val_loss"])["lr"]
            results["ref_lr_sweep"] = {"budget_s": sweep_budget, "runs": sweep, "best_lr": best_lr}
            write_json(out_json, results)

    ref_tokens = earlier.get("ref_tokens_run") if earlier is not None else None
    if args.ref_tokens and "reference" in args.sides:
        steps = max(1, round(args.ref_tokens / (cfg.trainer.batch_size * cfg.model.context_length)))
        run = args.work / f"ref_tokens_{args.ref_tokens:g}"
        run_timed(reference_steps_command(cfg, steps=steps, lr=best_lr, out=run, data=data,
                                          eval_interval=eval_interval, cuda=cuda), run, run / "log.txt")
        ref_tokens = {"lr": best_lr, **reference_tokens_result(run)}
    if ref_tokens is not None:
        results["ref_tokens_run"] = ref_tokens
        print(f"reference, {ref_tokens['tokens']:,} tokens: loss {ref_tokens['window_val_loss']:.4f} on the "
              f"evaluation windows after {ref_tokens['seconds']:.1f} s", flush=True)

    for budget in budgets:
        folder = args.work / f"{budget:g}s"
        reference = ours = None
        if stored is not None:
            best_lr, reference = stored[budget]
        if "reference" in args.sides:
            run = ref_runs.get((best_lr, budget))
            if run is None:
                run = folder / "reference"
                run_timed(reference_command(cfg, budget_s=budget, lr=best_lr, out=run, data=data,
                                            eval_interval=eval_interval, cuda=cuda), run, run / "log.txt")
            reference = reference_result(run)
        if "scratchlm" in args.sides:
            run = folder / "scratchlm"
            run_timed(scratchlm_train_command(shape, budget_s=budget, out=run, data=data, eval_interval=eval_interval,
                                              recipe=args.recipe, cuda=cuda), run, folder / "scratchlm.log")
            ours = scratchlm_result(run)
            ours["trainer_val_loss"] = ours["val_loss"]
            B = cfg.trainer.batch_size
            ours["val_loss"] = evaluate_run(run, data, batches=0, batch_size=B, log_path=folder / "eval-full.log")
            window_loss = evaluate_run(run, data, batches=cfg.trainer.eval_batches, batch_size=B,
                                       log_path=folder / "eval-windows.log")
            ours["curve"].append((ours["seconds"], window_loss))
        row = {"budget_s": budget, "ref_lr": best_lr if reference else None, "reference": reference,
               "scratchlm": ours}
        row.update(compare(reference, ours))
        if ref_tokens is not None and ours is not None:
            reached = time_to_reach(ours["curve"], ref_tokens["window_val_loss"])
            ours["seconds_to_ref_tokens_loss"] = reached
            row["ref_tokens_time_ratio"] = None if reached is None else reached / ref_tokens["seconds"]
        results["rows"].append(row)
        write_json(out_json, results)
        print(table(results["rows"]), flush=True)
    print(f"\nresults: {out_json}")
    return 0


def read_reference_json(path: Path) -> dict[str, Any]:
    """An earlier speedrun JSON (`--reference-json`); SystemExit when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"speedrun: --reference-json {path}: {exc}") from None


def stored_references(earlier: dict[str, Any], path: Path, budgets: list[float], *, shape: str,
                      vocab_size: int) -> dict[float, tuple[float, dict[str, Any]]]:
    """{budget: (lr, reference result)} from `earlier`, the speedrun JSON at `path`, for every
    budget asked; SystemExit when it was made at another shape or vocabulary, or lacks a budget.
    (That it was made on the same token files is the caller's word: paths differ between machines.)"""
    theirs = (earlier.get("shape"), earlier.get("data", {}).get("vocab_size"))
    if theirs != (shape, vocab_size):
        raise SystemExit(f"speedrun: --reference-json {path} is of shape {theirs[0]!r}, vocabulary {theirs[1]}; "
                         f"this run is of shape {shape!r}, vocabulary {vocab_size}")
    found = {row["budget_s"]: (row["ref_lr"], row["reference"]) for row in earlier.get("rows", [])
             if row.get("reference")}
    missing = [b for b in budgets if b not in found]
    if missing:
        raise SystemExit(f"speedrun: --reference-json {path} has no reference run for the budget(s) "
                         f"{', '.join(f'{b:g}' for b in missing)} s")
    return {b: found[b] for b in budgets}


def evaluate_run(run: Path, data: dict[str, Any], *, batches: int, batch_size: int, log_path: Path) -> float:
    """`scratchlm eval RUN --batches N`: the run's final model on the first N x batch_size
    validation windows (N = 0: all of them), the windows the trainer evaluates on."""
    run_logged([sys.executable, "-m", "scratchlm", "eval", str(run), "--data", data["val_bin"],
                "--batches", str(batches), "--batch-size", str(batch_size), "--json"], log_path)
    lines = [line for line in log_path.read_text().splitlines() if line.startswith("{")]
    return json.loads(lines[-1])["val_loss"]


if __name__ == "__main__":
    raise SystemExit(main())
