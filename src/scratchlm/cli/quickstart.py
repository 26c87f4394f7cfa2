"""`scratchlm quickstart`: the whole pipeline, offline, on a CPU, in a few minutes.

    corpus -> BPE tokenizer -> token files -> a small Transformer trained for a time budget
           -> validation loss at the start and the end, loss/LR plots, samples

The default corpus is on every machine that runs scratchlm and needs no download: the Python
standard library's own sources. ``--data`` takes a UTF-8 text file instead, or the name of a
dataset from `scratchlm.data.registry` already fetched with `scratchlm download`
(`scratchlm.data.corpus` builds and splits the text).

The number of training steps comes from the time budget (``--minutes``): a few timed steps
measure this machine, and the run is sized to fit (``--steps`` fixes it instead, which makes
the run reproducible across machines). The output directory is a normal run directory
(`scratchlm generate`, `scratchlm eval` and `scratchlm export` take it), with the corpus and
token files under ``data/``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from scratchlm.config import load_config, parse_override, split_overrides
from scratchlm.data.corpus import EOT, build_corpus
from scratchlm.errors import UserError
from scratchlm.fileio import move_aside, write_text_atomic

DEADLINE_MARGIN = 1.25  # training stops at this multiple of --minutes even if steps remain
MARKER = "quickstart.json"  # marks a directory as a quickstart run (safe to replace)
# Config keys the quickstart sets itself, and what sets each: an override of one was ignored or
# broke the run (trainer.max_steps beat --steps, with the intervals and warm-up planned for --steps).
OWN_KEYS = {"data.train_path": "under --out (--data gives the text)",
            "data.val_path": "under --out (--data gives the text)",
            "data.tokenizer_dir": "under --out (--data gives the text)",
            "trainer.out_dir": "from --out",
            "trainer.max_steps": "from --steps or --minutes"}


def check_out_dir(out: Path) -> None:
    """Refuse an `out` that holds something other than an earlier quickstart run."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not (out / MARKER).is_file():
        raise UserError(f"{out} exists and is not a quickstart run; choose another --out")


def prepare_out_dir(out: Path) -> Path | None:
    """Create `out` afresh; a previous quickstart there is moved aside, to the returned path
    (None when there was none), for `keep_previous` or `drop_previous`; anything else is refused."""
    check_out_dir(out)
    previous = move_aside(out, "previous") if out.exists() else None
    out.mkdir(parents=True)
    write_text_atomic(out / MARKER, "{}\n")
    return previous


def keep_previous(out: Path, previous: Path | None) -> None:
    """The new run failed before training: remove what it built and put the previous run back."""
    shutil.rmtree(out, ignore_errors=True)
    if previous is not None:
        previous.rename(out)


def drop_previous(previous: Path | None) -> None:
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


def measure_step_seconds(cfg: Any, steps: int = 3) -> float:
    """Seconds per optimizer step of `cfg` on this machine (median, after one untimed warm-up step)."""
    import torch

    from scratchlm.bench.harness import benchmark
    from scratchlm.model.functional import cross_entropy
    from scratchlm.model.transformer import build_model
    from scratchlm.optim import build_optimizer

    state = torch.get_rng_state()
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.trainer.batch_size, cfg.model.context_length))

    def step() -> None:
        cross_entropy(model(x), x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = benchmark(step, warmup=1, steps=steps, device="cpu")
    torch.set_rng_state(state)
    return result.median


def plan_steps(seconds_per_step: float, budget_s: float, cfg: Any, *, cap: int) -> int:
    """Steps that fit the budget, counting evaluation passes (a forward is ~1/3 of a step)."""
    eval_cost = 5 * cfg.trainer.eval_batches / 3  # five evaluations over the run
    return max(20, min(cap, int(budget_s / seconds_per_step - eval_cost)))


def quickstart_command(argv: list[str]) -> int:
    """scratchlm quickstart [--data PATH|NAME] [--out runs/quickstart] [--minutes N]"""
    parser = argparse.ArgumentParser(
        prog="scratchlm quickstart",
        description="Train a tokenizer and a small Transformer on CPU in a few minutes, offline. "
                    "Extra --section.key=value options override the quickstart preset.")
    parser.add_argument("--data", help="a UTF-8 text file or a downloaded dataset name "
                                       "(default: the Python standard library sources)")
    parser.add_argument("--data-dir", default="data", help="where `scratchlm download` put datasets")
    parser.add_argument("--out", default="runs/quickstart", help="output run directory")
    parser.add_argument("--minutes", type=float, default=2.5, help="training time budget")
    parser.add_argument("--steps", type=int, help="train exactly this many steps (ignores --minutes)")
    parser.add_argument("--corpus-mb", type=float, default=3.0, help="training text used, in MB")
    parser.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size")
    positional, overrides = split_overrides(argv)
    args = parser.parse_args(positional)
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        if key in OWN_KEYS:
            raise UserError(f"--{key}: the quickstart sets {key} itself, {OWN_KEYS[key]}; leave it out")
    if not args.out.strip():  # would be the current directory: an unset $VARIABLE
        raise UserError("--out is empty; name the run directory (e.g. runs/quickstart)")
    for flag, value in (("--minutes", args.minutes), ("--corpus-mb", args.corpus_mb), ("--steps", args.steps)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(f"{flag} must be a positive number, got {value}")
    if int(args.corpus_mb * 1e6) < 1:  # (a text file was then read as no text at all)
        raise UserError(f"--corpus-mb {args.corpus_mb:g} is less than one byte, so no text would be read; "
                        "give at least 1e-06 (one byte)")
    if args.vocab_size < 257:
        raise UserError(f"--vocab-size must be at least 257 (256 bytes and {EOT}), got {args.vocab_size}")
    from scratchlm.data.token_file import is_token_file

    if args.data is not None and is_token_file(args.data):
        raise UserError(f"--data {args.data} is a token file (written by `scratchlm encode`), not text; "
                        "give the text file that was encoded")
    run_quickstart(args, overrides)
    return 0


def run_quickstart(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    from scratchlm.train.config import TrainConfig
    from scratchlm.train.trainer import Trainer, check_combinations

    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    out = Path(args.out)
    data = out / "data"
    base = [f"--data.train_path={data / 'train.bin'}", f"--data.val_path={data / 'valid.bin'}",
            f"--data.tokenizer_dir={out / 'tokenizer'}", f"--trainer.out_dir={out}"]
    # The overrides and the corpus first: a typo in either must not cost the previous run in --out,
    # nor come out only after the tokenizer has trained.
    first = load_config(TrainConfig, "quickstart", base + [f"--model.vocab_size={args.vocab_size}"] + overrides)
    check_combinations(first)
    check_out_dir(out)
    what, train_text, valid_text = build_corpus(args.data, Path(args.data_dir), int(args.corpus_mb * 1e6))
    # The previous run in --out goes only once the new run has started (the trainer is built: the
    # data fits a window, the model and options fit the data and the device): a corpus too small,
    # a full disk, a model the tokenizer does not fit or an interrupt before training puts it back.
    previous = prepare_out_dir(out)
    try:
        tokenizer, stats = build_data(out, what, train_text, valid_text, args.vocab_size, timings, t0)
        need = first.model.context_length + 1
        for split in ("train", "valid"):
            if stats[split]["num_tokens"] < need:
                raise UserError(f"the {split} text encodes to {stats[split]['num_tokens']} tokens, too few for one "
                                f"window of context_length {first.model.context_length} (needs {need}): give "
                                f"more text (--data, --corpus-mb) or a shorter --model.context_length")
        base.append(f"--model.vocab_size={tokenizer.vocab_size}")
        cfg = load_config(TrainConfig, "quickstart", base + overrides)
        if args.steps is not None:
            steps = args.steps
            plan = f"{steps} steps"
        else:
            per_step = measure_step_seconds(cfg)
            steps = plan_steps(per_step, args.minutes * 60, cfg, cap=4 * cfg.trainer.max_steps)
            plan = f"{steps} steps (~{steps * per_step / 60:.1f} min at {per_step:.2f} s/step)"
        every = max(1, steps // 4)
        cfg = load_config(TrainConfig, "quickstart", base + [
            f"--trainer.max_steps={steps}", f"--trainer.eval_interval={every}",
            f"--trainer.checkpoint_interval={every * 2}", f"--trainer.log_interval={max(1, steps // 20)}",
            f"--optim.warmup_steps={max(1, min(cfg.optim.warmup_steps, steps // 10))}"] + overrides)
        print(f"[4/4] training: {plan}, batch {cfg.trainer.batch_size} x {cfg.model.context_length} tokens")
        start = time.perf_counter()
        trainer = Trainer(cfg, out)
    except BaseException:
        keep_previous(out, previous)
        raise
    drop_previous(previous)
    n_params = sum(p.numel() for p in trainer.raw_model.parameters())
    # A machine that slows down mid-run (other jobs) stops at the budget plus a margin.
    deadline = None if args.steps is not None else time.monotonic() + DEADLINE_MARGIN * args.minutes * 60
    try:
        trainer.fit(deadline=deadline)
    finally:
        trainer.logger.close()
    timings["train_s"] = time.perf_counter() - start
    timings["total_s"] = time.perf_counter() - t0

    from scratchlm.train.metrics import read_metrics

    evals = [r for r in read_metrics(out / "metrics.jsonl") if r["event"] == "eval"]
    result = {"corpus": what, "params": n_params, "steps": trainer.step, "planned_steps": steps, "initial_val_loss": evals[0]["val_loss"],
              "final_val_loss": evals[-1]["val_loss"], "timings": timings, "vocab_size": tokenizer.vocab_size,
              "train_tokens": stats["train"]["num_tokens"], "valid_tokens": stats["valid"]["num_tokens"]}
    write_text_atomic(out / MARKER, json.dumps(result, indent=2) + "\n")
    print(f"\nvalidation loss {result['initial_val_loss']:.3f} -> {result['final_val_loss']:.3f} "
          f"({n_params / 1e6:.2f}M parameters, {trainer.step} steps) in {timings['total_s'] / 60:.1f} min total")
    if result["final_val_loss"] >= result["initial_val_loss"]:
        print("the validation loss did not fall: give it more --minutes or --steps")
    print(f"run directory {out}: metrics.jsonl, loss.png, lr.png, samples.txt, checkpoints/")
    print(f"next: scratchlm generate {out} --prompt 'def '   |   scratchlm eval {out} --data {data / 'valid.bin'}")
    return result


def build_data(out: Path, what: str, train_text: str, valid_text: str, vocab_size: int,
               timings: dict[str, float], t0: float) -> tuple[Any, dict[str, dict]]:
    """The corpus, the tokenizer and the token files of a quickstart run in `out`."""
    from scratchlm.tokenizer.encode_corpus import encode_corpus
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train import train_bpe

    data = out / "data"
    data.mkdir()
    write_text_atomic(data / "train.txt", train_text)
    write_text_atomic(data / "valid.txt", valid_text)
    print(f"[1/4] corpus: {what}: {len(train_text.encode()) / 1e6:.1f} MB train, "
          f"{len(valid_text.encode()) / 1e6:.2f} MB validation")
    timings["corpus_s"] = time.perf_counter() - t0

    vocab, merges = train_bpe(data / "train.txt", vocab_size, [EOT])
    tokenizer = Tokenizer(vocab, merges, [EOT])
    tokenizer.save(out / "tokenizer")
    timings["tokenizer_s"] = time.perf_counter() - t0 - sum(timings.values())
    print(f"[2/4] tokenizer: {tokenizer.vocab_size} tokens (byte-level BPE) in {timings['tokenizer_s']:.1f} s")

    stats = {}
    for split in ("train", "valid"):
        stats[split] = encode_corpus(data / f"{split}.txt", tokenizer, data / f"{split}.bin", progress=False)
    timings["encode_s"] = time.perf_counter() - t0 - sum(timings.values())
    print(f"[3/4] encoded: {stats['train']['num_tokens']:,} train and {stats['valid']['num_tokens']:,} "
          f"validation tokens ({len(train_text.encode()) / stats['train']['num_tokens']:.2f} bytes/token) "
          f"in {timings['encode_s']:.1f} s")
    return tokenizer, stats
