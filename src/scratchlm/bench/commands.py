"""`scratchlm bench`: time forward, forward+backward and full training steps of the model.

    scratchlm bench [CONFIG] [--size small] [--model.KEY=VALUE ...] [--mode all]
                    [--batch-size 4] [--context-length 512] [--precision bf16_autocast]
                    [--compile] [--attention-backend flash_triton] [--activation-checkpointing N]
                    [--fused-lm-head] [--profile] [--memory-snapshot FILE] [--json]

Reports mean ± std per mode, peak memory, tokens/s and MFU. MFU counts the matmul FLOPs of
the model (2 per weight per token forward, causal attention scores and values) times 3 for a
training step, against the H200's datasheet dense bf16 rate (989 TFLOP/s), and also against
the measured bf16 matmul rate on that machine (753 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from scratchlm.bench.harness import H200_BF16_MEASURED_MATMUL, BenchmarkResult, benchmark, peak_flops
from scratchlm.bench.profile import add_layer_nvtx_ranges, memory_snapshot, nvtx_range, profile_table
from scratchlm.errors import UserError

__all__ = ["bench_command", "SIZES", "model_flops_per_token", "run_bench"]

# GPT-2-like shapes (d_model, d_ff, num_layers, num_heads) as Llama-style models.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=64, d_ff=128, num_layers=2, num_heads=4),
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    "10B": dict(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
}
MODES = ("forward", "forward_backward", "train_step")
PRECISIONS = ("fp32", "bf16_autocast", "bf16")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scratchlm bench", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="TOML preset (its [model] section is used)")
    p.add_argument("--size", choices=sorted(SIZES), help="model shape (default: small without a config)")
    p.add_argument("--mode", choices=(*MODES, "all"), default="all")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--vocab-size", type=int, help="overrides model.vocab_size (default 10000 without a config)")
    p.add_argument("--precision", choices=PRECISIONS, help="default: bf16_autocast on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--attention-backend", choices=("math", "flash_torch", "flash_triton"))
    p.add_argument("--activation-checkpointing", type=int, default=0, metavar="N",
                   help="checkpoint every N-th block (0: off)")
    p.add_argument("--fused-lm-head", action="store_true", help="chunked fused linear + cross-entropy loss")
    p.add_argument("--optimizer", choices=("scratchlm", "scratchlm_fused", "torch_fused"), default="scratchlm",
                   help="scratchlm.optim.AdamW (multi-tensor on CUDA), the same with fused=True (one Triton "
                        "kernel per group on CUDA) or torch.optim.AdamW(fused=True)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--profile", action="store_true",
                   help="NVTX ranges (forward/backward/optimizer, per layer) and a torch.profiler table")
    p.add_argument("--memory-snapshot", metavar="FILE", help="dump a CUDA allocator snapshot of one train step")
    p.add_argument("--json", action="store_true", help="print results as one JSON object")
    p.add_argument("--seed", type=int, default=0)
    return p


def _model_config(args: argparse.Namespace, overrides: list[str]):
    from scratchlm.config import load_config
    from scratchlm.train.config import TrainConfig

    pre: list[str] = []
    size = args.size or (None if args.config else "small")
    if size:
        pre += [f"--model.{k}={v}" for k, v in SIZES[size].items()]
    if args.vocab_size:
        pre.append(f"--model.vocab_size={args.vocab_size}")
    elif not args.config:
        pre.append("--model.vocab_size=10000")
    pre.append(f"--model.context_length={args.context_length}")
    if args.attention_backend:
        pre.append(f"--model.attention_backend={args.attention_backend}")
    for text in overrides:
        if not text.startswith("--model."):
            raise UserError(f"scratchlm bench takes only --model.* overrides, got {text}")
    try:
        return load_config(TrainConfig, args.config, pre + overrides).model
    except ValueError as exc:  # ModelConfig's own validation
        raise UserError(str(exc)) from None


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Forward matmul FLOPs per token: 2 per weight of every matrix except the embedding
    table (a lookup), plus causal attention (q·k and p·v: 2·T·d_model per layer and token)."""
    emb = getattr(model, "token_embeddings", None)
    skip = {id(emb.weight)} if emb is not None and not getattr(model, "tie_embeddings", False) else set()
    matrix_params = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)
    layers = len(getattr(model, "layers", []))
    d_model = getattr(model, "d_model", 0)
    return 2.0 * matrix_params + 2.0 * layers * seq_len * d_model


def _loss_fn(model, fused: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if fused:
        from scratchlm.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

        def loss(x, y):
            return fused_linear_cross_entropy(model.head_inputs(x), model.lm_head.weight, y)
    else:
        def loss(x, y):
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
    return loss


def run_bench(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """Build the model from the arguments, time the requested modes, return a results dict."""
    from scratchlm.model.transformer import build_model

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda given but no CUDA device is available")
    precision = args.precision or ("bf16_autocast" if device.type == "cuda" else "fp32")
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1 or args.context_length < 1:
        raise UserError("--steps, --batch-size and --context-length must be >= 1, --warmup >= 0")
    cfg = _model_config(args, overrides)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = build_model(cfg, device=device, dtype=dtype)
    if args.activation_checkpointing:
        from scratchlm.train.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model, every=args.activation_checkpointing)
    if args.profile:
        add_layer_nvtx_ranges(model)
    runner = torch.compile(model) if args.compile else model
    if args.fused_lm_head:
        # compiled, the trunk only: the chunked loss loop stays eager (it is a few large matmuls)
        trunk = _TrunkProxy(model, torch.compile(model.head_inputs)) if args.compile else model
        loss_fn = _loss_fn(trunk, True)
    elif args.compile:
        # the model and the float32 cross-entropy in one compiled graph, as a compiled training
        # script computes its loss inside the model's forward (no eager pass over the logits)
        loss_fn = torch.compile(_loss_fn(model, False))
    else:
        loss_fn = _loss_fn(model, False)

    if args.optimizer == "torch_fused":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    else:
        from scratchlm.optim.adamw import AdamW

        optimizer = AdamW(model.parameters(), lr=1e-4, fused=args.optimizer == "scratchlm_fused" or None)

    B, T = args.batch_size, args.context_length
    x = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    y = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16_autocast")

    def forward() -> None:
        with torch.no_grad(), autocast, nvtx_range("forward"):
            runner(x)

    def forward_backward() -> None:
        with autocast, nvtx_range("forward"):
            loss = loss_fn(x, y)
        with nvtx_range("backward"):
            loss.backward()
        model.zero_grad(set_to_none=True)

    def train_step() -> None:
        with autocast, nvtx_range("forward"):
            loss = loss_fn(x, y)
        with nvtx_range("backward"):
            loss.backward()
        with nvtx_range("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    fns = {"forward": forward, "forward_backward": forward_backward, "train_step": train_step}
    modes = MODES if args.mode == "all" else (args.mode,)
    flops_token = model_flops_per_token(model, T)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "context_length", "d_model", "num_layers",
                                               "num_heads", "d_ff", "attention_backend")},
        "params": sum(p.numel() for p in model.parameters()),
        "batch_size": B, "context_length": T, "precision": precision, "compile": args.compile,
        "activation_checkpointing": args.activation_checkpointing, "fused_lm_head": args.fused_lm_head,
        "optimizer": args.optimizer, "flops_per_token_forward": flops_token, "modes": {},
    }
    for mode in modes:
        try:
            stats = benchmark(fns[mode], warmup=args.warmup, steps=args.steps, device=device)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise UserError(_out_of_memory_message(model, mode, B, T, device)) from None
        results["modes"][mode] = _summarise(stats, mode, B * T, flops_token, precision, device)
    if args.memory_snapshot:
        with memory_snapshot(args.memory_snapshot):
            train_step()
        results["memory_snapshot"] = args.memory_snapshot
    if args.profile:
        results["profile"] = profile_table(fns[modes[-1]], steps=2)
    return results


class _TrunkProxy:
    """Exposes a compiled `head_inputs` with the model's `lm_head` for the fused loss."""

    def __init__(self, model, head_inputs):
        self.head_inputs = head_inputs
        self.lm_head = model.lm_head


def _out_of_memory_message(model: torch.nn.Module, mode: str, B: int, T: int, device: torch.device) -> str:
    """What to try when `mode` ran out of memory: smaller activations, unless the weights (and,
    for a training step, their gradients and AdamW's two moments) alone exceed the device."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    state = weights * (4 if mode == "train_step" else 2 if mode == "forward_backward" else 1)
    total = torch.cuda.get_device_properties(device).total_memory
    what = {"train_step": "weights, gradients and AdamW state", "forward_backward": "weights and gradients",
            "forward": "weights"}[mode]
    head = (f"out of GPU memory in {mode} with batch {B} x context {T} "
            f"({sum(p.numel() for p in params) / 1e6:.0f}M parameters)")
    if state > total:
        return (f"{head}: the {what} alone need {state / 2**30:.1f} GiB, more than the device's "
                f"{total / 2**30:.1f} GiB; use a smaller model or shard it over GPUs (--parallel.strategy=fsdp in train)")
    return (f"{head}; try a smaller --batch-size/--context-length, --activation-checkpointing 1 "
            "or --fused-lm-head")


def _summarise(stats: BenchmarkResult, mode: str, tokens: int, flops_token: float, precision: str,
               device: torch.device) -> dict[str, Any]:
    out = stats.to_dict()
    out["tokens_per_s"] = tokens / stats.mean
    factor = 1.0 if mode == "forward" else 3.0
    achieved = factor * flops_token * tokens / stats.mean
    out["tflops"] = achieved / 1e12
    if device.type == "cuda":
        out["mfu"] = achieved / peak_flops(precision)
        out["mfu_vs_measured_matmul"] = achieved / H200_BF16_MEASURED_MATMUL
    return out


def _print_table(results: dict[str, Any]) -> None:
    m = results["model"]
    print(f"{results['device']}: d_model {m['d_model']}, {m['num_layers']} layers, {m['num_heads']} heads, "
          f"d_ff {m['d_ff']}, vocab {m['vocab_size']}, {results['params'] / 1e6:.1f}M params; batch "
          f"{results['batch_size']} x {results['context_length']}, {results['precision']}, "
          f"attention {m['attention_backend']}, compile {results['compile']}")
    print(f"{'mode':<18}{'mean ± std (ms)':>22}{'min (ms)':>10}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}")
    for mode, r in results["modes"].items():
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        mem = f"{r['peak_memory_bytes'] / 2**30:.2f}" if r["peak_memory_bytes"] is not None else "-"
        print(f"{mode:<18}{r['mean'] * 1e3:>12.2f} ± {r['std'] * 1e3:<7.2f}{r['min'] * 1e3:>10.2f}"
              f"{r['tokens_per_s']:>12.0f}{r['tflops']:>9.1f}{mfu:>7}{mem:>10}")
    if "profile" in results:
        print(results["profile"])


def bench_command(argv: list[str]) -> int:
    """Entry point of `scratchlm bench`."""
    from scratchlm.config import split_overrides

    positional, overrides = split_overrides(argv)
    args = _parser().parse_args(positional)
    results = run_bench(args, overrides)
    if args.json:
        json.dump(results, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_table(results)
    return 0
