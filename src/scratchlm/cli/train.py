"""`scratchlm train` and `scratchlm eval`."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from scratchlm.config import load_config, split_overrides
from scratchlm.errors import UserError
from scratchlm.train.config import TrainConfig


def train_command(argv: list[str]) -> int:
    """scratchlm train [CONFIG] [--section.key=value ...] [--resume | --resume-from STEP | --overwrite]"""
    parser = argparse.ArgumentParser(
        prog="scratchlm train",
        description="Train a Transformer LM. CONFIG is a TOML file or a preset name from configs/; "
                    "any field can be overridden as --section.key=value (e.g. --optim.lr=3e-4). Ctrl-C or "
                    "SIGTERM finishes the step in progress, checkpoints it and exits (130 / 143); --resume "
                    "continues from there.")
    parser.add_argument("config", nargs="?", help="TOML config or preset name (default: built-in defaults)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue RUN/checkpoints/latest of trainer.out_dir")
    mode.add_argument("--resume-from", metavar="STEP",
                      help="continue from this checkpoint (800 or step_000800); newer ones are set aside")
    mode.add_argument("--overwrite", action="store_true", help="delete an existing run directory first")
    positional, overrides = split_overrides(argv)
    args = parser.parse_args(positional)
    if args.resume_from is not None and not args.resume_from.strip():
        raise UserError("--resume-from is empty; give the step to continue from (800 or step_000800), "
                        "or pass --resume for the latest checkpoint")
    cfg = load_config(TrainConfig, args.config, overrides)
    run_training(cfg, resume=args.resume_from or args.resume, overwrite=args.overwrite)
    return 0


def run_training(cfg: TrainConfig, *, resume: bool | int | str = False, overwrite: bool = False) -> dict[str, Any]:
    """Prepare the run directory, build the trainer with `cfg.parallel`'s strategy, train.

    `resume`: True continues from `checkpoints/latest` (or the newest intact step), a step number
    or step directory name continues from that checkpoint."""
    from scratchlm.parallel.strategy import init_strategy
    from scratchlm.train.run_dir import begin_run_dir
    from scratchlm.train.trainer import Trainer

    strategy = init_strategy(cfg.parallel, device=cfg.trainer.device)
    logging.basicConfig(level=logging.INFO if strategy.is_main else logging.WARNING, format="%(message)s")
    run_dir = Path(cfg.trainer.out_dir)
    try:
        pending = None
        try:
            if strategy.is_main:
                if overwrite:
                    _check_inputs_outside(cfg, run_dir)
                pending = begin_run_dir(run_dir, resume=bool(resume), overwrite=overwrite)
                if resume:
                    _check_same_model(cfg, run_dir)
            strategy.barrier()
            trainer = Trainer(cfg, run_dir, resume=resume, strategy=strategy)
        except BaseException:  # the run never started: no empty run directory, the replaced run back
            if pending is not None:
                pending.abandon()
            raise
        if pending is not None:
            pending.keep()
        try:
            return trainer.fit()
        finally:
            trainer.logger.close()
    finally:
        strategy.close()


def _check_inputs_outside(cfg: TrainConfig, run_dir: Path) -> None:
    """--overwrite deletes `run_dir`: refuse when the data or tokenizer the run reads lie inside it."""
    for key in ("train_path", "val_path", "tokenizer_dir"):
        value = getattr(cfg.data, key)
        if value and Path(value).resolve().is_relative_to(run_dir.resolve()):
            raise UserError(f"--overwrite would delete data.{key} {value}, which is inside the run directory "
                            f"{run_dir}; move it out first")


INIT_ONLY = frozenset({"qkv_init", "zero_init_output"})  # model fields that only change the initial weights
COMPUTE_ONLY = frozenset({"fused_projections", "packed_qkv_backward"})  # model fields that only change how the same maths runs
OPTIMIZER_LAYOUT = ("name", "decay_vectors")  # optim fields that decide the optimizer and its parameter groups


def _check_same_model(cfg: TrainConfig, run_dir: Path) -> None:
    """A resumed run must keep its model shape and optimizer (other settings, e.g. max_steps, may change)."""
    from scratchlm.config import config_to_dict, read_toml

    saved = run_dir / "config.toml"
    if not saved.is_file():
        return
    saved_cfg = read_toml(saved)
    for section in ("model", "optim"):
        if not isinstance(saved_cfg.get(section, {}), dict):
            raise UserError(f"--resume: {saved}: [{section}] must be a table, got {type(saved_cfg[section]).__name__}")
    # The optimizer state of the checkpoint only loads into the same optimizer, with the same
    # parameter groups (runs from before a field trained with its default).
    for key in OPTIMIZER_LAYOUT:
        old_value = saved_cfg.get("optim", {}).get(key, getattr(type(cfg.optim)(), key))
        if old_value != getattr(cfg.optim, key):
            raise UserError(f"--resume: {saved} trained with optim.{key}={old_value!r}, this config has "
                            f"{getattr(cfg.optim, key)!r}; its optimizer state cannot carry over: "
                            f"keep optim.{key}={old_value!r}")
    # A field the saved config does not name did not exist when the run started (or was none):
    # the run trained with its default, as `load_config` would read the file back.
    old = {**config_to_dict(type(cfg.model)()), **saved_cfg.get("model", {})}
    new = config_to_dict(cfg.model)
    # Fields that only choose the initialisation (its weights come from the checkpoint) or the
    # kernels' arrangement do not matter to a resumed run.
    changed = sorted(k for k in set(old) | set(new)
                     if old.get(k) != new.get(k) and k not in INIT_ONLY | COMPUTE_ONLY)
    if changed:
        raise UserError(f"--resume: the model in {saved} differs from this config in "
                        f"{', '.join('model.' + k for k in changed)}")


def eval_command(argv: list[str]) -> int:
    """scratchlm eval RUN --data X.bin: validation loss and perplexity of a trained model."""
    parser = argparse.ArgumentParser(prog="scratchlm eval",
                                     description="Validation loss and perplexity of a trained model on a token file.")
    parser.add_argument("run", help="run directory, step directory or checkpoint file")
    parser.add_argument("--data", required=True, help="token file (.bin with its .json sidecar)")
    parser.add_argument("--batches", type=int, default=50, help="batches to evaluate (0 = the whole file)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per batch")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    if args.batches < 0 or args.batch_size <= 0:
        raise UserError("--batches must be >= 0 and --batch-size > 0")
    result = evaluate_run(args.run, args.data, batches=args.batches, batch_size=args.batch_size, device=args.device)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"val loss {result['val_loss']:.4f} | val ppl {result['val_ppl']:.2f} | "
              f"{result['tokens']:,} tokens | {result['checkpoint']}")
    return 0


def evaluate_run(run: str, data: str, *, batches: int, batch_size: int, device: str = "auto") -> dict[str, Any]:
    """The validation loss of the model at `run` over the first `batches` batches of `data`."""
    import torch

    from scratchlm.data.batch import iterate_eval_batches
    from scratchlm.device import resolve_device
    from scratchlm.train.checkpoint import load_trained_model, resolve_checkpoint
    from scratchlm.train.data_feed import evaluate, open_checked
    from scratchlm.train.metrics import perplexity

    dev = resolve_device(device)
    model, model_cfg, tokenizer = load_trained_model(run, device=dev)
    # Data encoded with another tokenizer of the same size would give a meaningless loss.
    tokens = open_checked(data, model_cfg, "--data", tokenizer_hash=tokenizer.hash if tokenizer is not None else None)
    counted = []

    def counting(it):
        for x, y in it:
            counted.append(y.numel())
            yield x, y

    it = iterate_eval_batches(tokens, batch_size, model_cfg.context_length, batches or None, device=dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        loss = evaluate(model, counting(it))
    return {"val_loss": loss, "val_ppl": perplexity(loss), "tokens": sum(counted),
            "checkpoint": str(resolve_checkpoint(run))}
