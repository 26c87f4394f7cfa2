"""The peer for `scratchlm train`: the Llama-style LM a PyTorch user would write with torch.nn.

The model is `scratchlm.bench.reference_model.ReferenceLM`: scratchlm's architecture
(pre-norm, RMSNorm, interleaved RoPE, SwiGLU, untied head, no biases, the same truncated-normal
initialisation) built from ``nn.Linear`` / ``nn.Embedding`` / ``nn.RMSNorm`` and
``F.scaled_dot_product_attention``; it trains with ``F.cross_entropy`` and the fused
``torch.optim.AdamW``, with bf16 autocast on CUDA and optional ``torch.compile``. It samples
random windows of a uint16 token file, follows the same warm-up + cosine schedule, evaluates on the same sequential validation windows and writes
``metrics.jsonl`` lines shaped like scratchlm's (``{"event": "train"|"eval", "step", ...}``),
so ``benchmarks/training_report.py`` can compare the two runs step for step and second for second.

With ``--time-budget-s N`` it trains for N seconds instead of ``--steps`` (which then only caps
the run), with the meaning of scratchlm's ``trainer.time_budget_s``: the training clock starts
at the first step (compilation counts) and stops during evaluations; the learning rate of update
s (1-based) is ``min(1, s / warmup) · cosine(elapsed / N)`` from ``--lr`` to ``--min-lr``
(`lr_at_time`, scratchlm's ``budget_lr``), so the decay ends when the time does. There is no
evaluation at step 0; evaluations run the eager model (as scratchlm's single-process trainer
does). At the end the model is evaluated on the periodic evaluations' windows, then on the whole
validation file (``"full_validation": true``; the summary's ``final_val_loss``), in sequential
windows like ``scratchlm eval --batches 0``. Records carry ``elapsed_s``, the training clock.

    python benchmarks/reference_trainer.py --train-bin train.bin --val-bin valid.bin --out ref/
    python benchmarks/reference_trainer.py --train-bin train.bin --val-bin valid.bin --out ref/ --time-budget-s 60
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from scratchlm.bench.reference_model import ReferenceLM, reference_adamw, window_batch


def lr_at(step: int, max_lr: float, min_lr: float, warmup: int, cycle: int) -> float:
    if step < warmup:
        return max_lr * step / warmup
    if step <= cycle:
        return min_lr + 0.5 * (1 + math.cos(math.pi * (step - warmup) / (cycle - warmup))) * (max_lr - min_lr)
    return min_lr


def lr_at_time(update: int, progress: float, max_lr: float, min_lr: float, warmup: int) -> float:
    """The learning rate of update `update` (1-based) of a time-budget run when `progress` =
    elapsed / budget: warm-up in updates scaling a cosine over the budget.

    >>> lr_at_time(5, 0.5, 1.0, 0.0, 10)
    0.25
    """
    warm = min(1.0, update / warmup) if warmup > 0 else 1.0
    progress = min(max(progress, 0.0), 1.0)
    return warm * (min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (max_lr - min_lr))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-bin", required=True)
    p.add_argument("--val-bin", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=10_000)
    p.add_argument("--context-length", type=int, default=256)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--d-ff", type=int, default=1344)
    p.add_argument("--rope-theta", type=float, default=10_000.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=500)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="train for this many seconds (compilation included; --steps then only caps the run), "
                        "with the cosine decay over the budget and a final evaluation on the whole validation file")
    return p


def train_step(model: torch.nn.Module, step_model, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               autocast, grad_clip: float) -> torch.Tensor:
    """One optimizer step on (x, y): forward under `autocast`, float32 cross-entropy, backward,
    clipping (when grad_clip > 0) and the AdamW step; returns the loss."""
    with autocast:
        logits = step_model(x)
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train = np.memmap(args.train_bin, dtype=np.uint16, mode="r")
    val = np.memmap(args.val_bin, dtype=np.uint16, mode="r")
    T, B = args.context_length, args.batch_size
    rng = np.random.default_rng(args.seed)

    model = ReferenceLM(args.vocab_size, T, args.d_model, args.num_layers, args.num_heads, args.d_ff,
                        args.rope_theta).to(device)
    opt = reference_adamw(model, lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay,
                          fused=device == "cuda")
    step_model = torch.compile(model) if args.compile else model
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda")

    def batch(tokens: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return window_batch(tokens, starts, T, device)

    log = (out / "metrics.jsonl").open("w")
    if args.time_budget_s > 0:
        train_for_time(args, model, step_model, opt, train, val, device, log, out)
        return
    train_seconds, tokens_seen = 0.0, 0
    t0 = time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_interval == 0 or step == args.steps:
            if device == "cuda":
                torch.cuda.synchronize()
            train_seconds += time.perf_counter() - t0
            val_loss = evaluate_windows(model, val, B, T, device, args.eval_batches * B)
            log.write(json.dumps({"event": "eval", "step": step, "val_loss": val_loss, "tokens": tokens_seen,
                                  "train_seconds": train_seconds}) + "\n")
            log.flush()
            print(f"step {step:5d} | val {val_loss:.4f} | {train_seconds:7.1f}s")
            t0 = time.perf_counter()
        if step == args.steps:
            break
        lr = lr_at(step, args.lr, args.min_lr, args.warmup, args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batch(train, rng.integers(0, len(train) - T - 1, size=B))
        loss = train_step(model, step_model, opt, x, y, autocast, args.grad_clip)
        tokens_seen += B * T
        if step % args.log_interval == 0:
            log.write(json.dumps({"event": "train", "step": step, "loss": loss.item(), "lr": lr,
                                  "tokens": tokens_seen}) + "\n")
    if device == "cuda":
        torch.cuda.synchronize()
    summary = {"train_seconds": train_seconds, "tokens": tokens_seen,
               "tokens_per_second": tokens_seen / train_seconds, "final_val_loss": val_loss,
               "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


@torch.no_grad()
def evaluate_windows(model: torch.nn.Module, val: np.ndarray, batch_size: int, context_length: int, device: str,
                     max_windows: int | None = None) -> float:
    """Mean cross-entropy per token over the first `max_windows` (None: all) sequential,
    non-overlapping windows of `val`, `batch_size` at a time (the last batch may be smaller)."""
    T = context_length
    num_windows = (len(val) - 1) // T
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for first in range(0, num_windows, batch_size):
        starts = (first + np.arange(min(batch_size, num_windows - first))) * T
        x, y = window_batch(val, starts, T, device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(x)
        total += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1), reduction="sum").double()
    model.train(was_training)
    return total.item() / (num_windows * T)


def train_for_time(args, model, step_model, opt, train: np.ndarray, val: np.ndarray, device: str, log, out: Path
                   ) -> None:
    """The `--time-budget-s` loop (see the module docstring)."""
    T, B = args.context_length, args.batch_size
    rng = np.random.default_rng(args.seed)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda")
    budget, tokens_seen, step = args.time_budget_s, 0, 0
    paused = 0.0  # seconds spent evaluating, off the training clock

    def clock() -> float:
        return time.perf_counter() - start - paused

    start = time.perf_counter()
    elapsed = 0.0
    while step < args.steps and elapsed < budget:
        lr = lr_at_time(step + 1, elapsed / budget, args.lr, args.min_lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = window_batch(train, rng.integers(0, len(train) - T - 1, size=B), T, device)
        loss = train_step(model, step_model, opt, x, y, autocast, args.grad_clip)
        step += 1
        tokens_seen += B * T
        elapsed = clock()
        if step % args.log_interval == 0:
            log.write(json.dumps({"event": "train", "step": step, "loss": loss.item(), "lr": lr,
                                  "tokens": tokens_seen, "elapsed_s": elapsed}) + "\n")
        if step % args.eval_interval == 0:
            if device == "cuda":
                torch.cuda.synchronize()  # the queued steps are training time
            elapsed = clock()
            pause_start = time.perf_counter()
            val_loss = evaluate_windows(model, val, B, T, device, args.eval_batches * B)
            paused += time.perf_counter() - pause_start
            log.write(json.dumps({"event": "eval", "step": step, "val_loss": val_loss, "tokens": tokens_seen,
                                  "elapsed_s": elapsed}) + "\n")
            log.flush()
            print(f"step {step:6d} | val {val_loss:.4f} | {elapsed:7.1f}s")
    if device == "cuda":
        torch.cuda.synchronize()
    train_seconds = clock()
    # The final model on the periodic evaluations' windows (a point of the same curve), then on
    # the whole file (the figure the run is judged by).
    window_loss = evaluate_windows(model, val, B, T, device, args.eval_batches * B)
    val_loss = evaluate_windows(model, val, B, T, device)
    for loss, full in ((window_loss, False), (val_loss, True)):
        log.write(json.dumps({"event": "eval", "step": step, "val_loss": loss, "full_validation": full,
                              "tokens": tokens_seen, "elapsed_s": train_seconds,
                              "train_seconds": train_seconds}) + "\n")
    log.close()
    print(f"step {step:6d} | val {val_loss:.4f} (whole validation file) | {train_seconds:7.1f}s")
    summary = {"train_seconds": train_seconds, "tokens": tokens_seen, "steps": step,
               "tokens_per_second": tokens_seen / train_seconds, "final_val_loss": val_loss,
               "final_window_val_loss": window_loss, "time_budget_s": budget, "lr": args.lr,
               "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
