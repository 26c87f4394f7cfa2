"""The peer for `scratchlm train`: the Llama-style LM a PyTorch user would write with torch.nn.

Same architecture as scratchlm's TransformerLM (pre-norm, RMSNorm, interleaved RoPE, SwiGLU,
untied head, no biases, the same truncated-normal initialisation), but built from
``nn.Linear`` / ``nn.Embedding`` / ``nn.RMSNorm``, ``F.scaled_dot_product_attention``,
``F.cross_entropy`` and the fused ``torch.optim.AdamW``, with bf16 autocast on CUDA and optional
``torch.compile``. It samples random windows of a uint16 token file, follows the same
warm-up + cosine schedule, evaluates on the same sequential validation windows and writes
``metrics.jsonl`` lines shaped like scratchlm's (``{"event": "train"|"eval", "step", ...}``),
so ``benchmarks/training.py`` can compare the two runs step for step and second for second.

    python benchmarks/reference_trainer.py --train-bin train.bin --val-bin valid.bin --out ref/
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def rope_tables(d_head: int, max_len: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = theta ** (-torch.arange(0, d_head, 2, device=device, dtype=torch.float32) / d_head)
    angles = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return angles.cos(), angles.sin()  # (T, d/2) each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]); x: (B, H, T, d)."""
    x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int):
        super().__init__()
        self.num_heads = num_heads
        self.ln1 = nn.RMSNorm(d_model, eps=1e-5)
        self.ln2 = nn.RMSNorm(d_model, eps=1e-5)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.num_heads, D // self.num_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
        q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, D))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ReferenceLM(nn.Module):
    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads, d_ff) for _ in range(num_layers))
        self.ln_f = nn.RMSNorm(d_model, eps=1e-5)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        cos, sin = rope_tables(d_model // num_heads, context_length, rope_theta, None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # The same initialisation as scratchlm's layers. qkv is one (3d, d) Linear, so q, k and v
        # each get std sqrt(2 / (d + 3d)), which scratchlm's attention gives its q_proj, k_proj, v_proj.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                fan_out, fan_in = module.weight.shape
                std = math.sqrt(2.0 / (fan_in + fan_out))
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
            elif isinstance(module, nn.Embedding):
                nn.init.trunc_normal_(module.weight, std=1.0, a=-3.0, b=3.0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.ln_f(x))


def lr_at(step: int, max_lr: float, min_lr: float, warmup: int, cycle: int) -> float:
    if step < warmup:
        return max_lr * step / warmup
    if step <= cycle:
        return min_lr + 0.5 * (1 + math.cos(math.pi * (step - warmup) / (cycle - warmup))) * (max_lr - min_lr)
    return min_lr


def main(argv=None) -> None:
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
    args = p.parse_args(argv)

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
    decay = [p_ for p_ in model.parameters() if p_.dim() >= 2]
    no_decay = [p_ for p_ in model.parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(args.beta1, args.beta2), eps=1e-8, fused=device == "cuda",
    )
    step_model = torch.compile(model) if args.compile else model
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda")

    def batch(tokens: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([tokens[s:s + T + 1] for s in starts]).astype(np.int64)
        t = torch.from_numpy(rows).pin_memory().to(device, non_blocking=True) if device == "cuda" \
            else torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        losses = []
        for i in range(args.eval_batches):
            starts = np.arange(i * B, (i + 1) * B) * T
            if starts[-1] + T + 1 > len(val):
                break
            x, y = batch(val, starts)
            with autocast:
                logits = step_model(x)
            losses.append(F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)).item())
        model.train()
        return sum(losses) / len(losses)

    log = (out / "metrics.jsonl").open("w")
    train_seconds, tokens_seen = 0.0, 0
    t0 = time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_interval == 0 or step == args.steps:
            if device == "cuda":
                torch.cuda.synchronize()
            train_seconds += time.perf_counter() - t0
            val_loss = evaluate()
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
        with autocast:
            logits = step_model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
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


if __name__ == "__main__":
    main()
