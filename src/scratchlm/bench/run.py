"""Time forward, forward+backward and full training steps of a model shape.

`run_bench` builds the model, loss and optimizer that `BenchOptions` describe, times each
requested mode with `scratchlm.bench.harness.benchmark` and returns the results as a dict
(the `scratchlm bench` command prints it as a table or JSON).

Reports mean ± std per mode, peak memory, tokens/s and MFU. MFU counts the matmul FLOPs of
the model (`scratchlm.model.accounting.model_flops_per_token`: 2 per weight per token forward,
causal attention scores and values) times 3 for a training step, against the device's datasheet
dense rate (`scratchlm.device.peak_flops`: bf16 for the bf16 precisions, TF32 for fp32; 989 and
494.5 TFLOP/s on an H100 or H200 SXM), and also against the measured bf16 matmul rate of the
H200 used for docs/benchmarks (753 TFLOP/s).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from scratchlm.bench.harness import H200_BF16_MEASURED_MATMUL, BenchmarkResult, benchmark, timing_device
from scratchlm.bench.profile import add_layer_nvtx_ranges, memory_snapshot, nvtx_range, profile_table
from scratchlm.bench.progress import reported
from scratchlm.device import peak_flops
from scratchlm.dtypes import torch_dtype
from scratchlm.errors import UserError
from scratchlm.model.accounting import TRAIN_FORWARDS, model_flops_per_token

__all__ = ["BenchOptions", "MODES", "PRECISIONS", "SIZES", "model_flops_per_token", "run_bench"]

# GPT-2-like shapes (d_model, d_ff, num_layers, num_heads) as Llama-style models.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=64, d_ff=128, num_layers=2, num_heads=4),
    "small": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": dict(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": dict(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "10B": dict(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
}
log = logging.getLogger(__name__)
MODES = ("forward", "forward_backward", "train_step")
PRECISIONS = ("fp32", "bf16_autocast", "bf16")


@dataclass
class BenchOptions:
    """What to build and time; the fields are the flags of `scratchlm bench`."""

    config: str | None = None  # TOML preset or preset name; its [model] section is used
    size: str | None = None  # a key of SIZES (default: small without a config)
    mode: str = "all"  # one of MODES, or "all"
    warmup: int = 5  # untimed calls before the timed ones
    steps: int = 10  # timed calls per mode
    batch_size: int = 4
    context_length: int = 512
    vocab_size: int | None = None  # overrides model.vocab_size (default 10000 without a config)
    precision: str | None = None  # one of PRECISIONS (default: bf16_autocast on CUDA, fp32 on CPU)
    compile: bool = False  # torch.compile the model (and its loss)
    attention_backend: str | None = None  # overrides model.attention_backend
    activation_checkpointing: int = 0  # checkpoint every N-th block (0: off)
    fused_lm_head: bool = False  # chunked fused linear + cross-entropy loss
    optimizer: str = "scratchlm"  # scratchlm, scratchlm_fused or torch_fused
    device: str | None = None  # default: cuda when available, else cpu
    profile: bool = False  # NVTX ranges and a torch.profiler table of the last mode
    memory_snapshot: str | None = None  # file for a CUDA allocator snapshot of one train step
    seed: int = 0  # in [0, 2**64), what torch.manual_seed takes


def _model_config(options: BenchOptions, overrides: list[str]):
    from scratchlm.config import load_config
    from scratchlm.train.config import TrainConfig

    pre: list[str] = []
    size = options.size or (None if options.config else "small")
    if size:
        pre += [f"--model.{k}={v}" for k, v in SIZES[size].items()]
    if options.vocab_size:
        pre.append(f"--model.vocab_size={options.vocab_size}")
    elif not options.config:
        pre.append("--model.vocab_size=10000")
    pre.append(f"--model.context_length={options.context_length}")
    if options.attention_backend:
        pre.append(f"--model.attention_backend={options.attention_backend}")
    for text in overrides:
        if not text.startswith("--model."):
            raise UserError(f"scratchlm bench takes only --model.* overrides, got {text}")
    try:
        cfg = load_config(TrainConfig, options.config, pre + overrides).model
    except ValueError as exc:  # ModelConfig's own validation
        raise UserError(str(exc)) from None
    if cfg.context_length != options.context_length:  # the batches are --context-length tokens long
        raise UserError(f"--model.context_length={cfg.context_length} differs from --context-length "
                        f"{options.context_length}; give the length to time with --context-length only")
    return cfg


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


def run_bench(options: BenchOptions, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Build the model from `options` (plus ``--model.*`` overrides), time the requested modes,
    return a results dict: the run's description and, under "modes", one summary per mode."""
    device, precision = _device_and_precision(options)
    cfg = _model_config(options, list(overrides))
    logits = options.batch_size * options.context_length * cfg.vocab_size
    if logits > 2**63 - 1:  # (torch's TypeError or OverflowError; a smaller shape too large is out of memory)
        raise UserError(f"--batch-size {options.batch_size} x --context-length {options.context_length} x vocab_size "
                        f"{cfg.vocab_size} = {logits:.3g} logits, more than a tensor holds (2**63 - 1)")
    _check_attention_backend(cfg.attention_backend, device)
    _note_ignored_options(cfg, options, device)
    if options.fused_lm_head and cfg.logit_softcap:  # (as the trainer refuses it)
        raise UserError(f"--fused-lm-head computes the loss from uncapped logits: it would time a model without "
                        f"model.logit_softcap={cfg.logit_softcap:g}; drop one of the two")
    try:
        return _build_and_time(cfg, options, device, precision)
    except RuntimeError as exc:
        message = _cpu_out_of_memory_message(exc, cfg, options)
        if message is None:
            raise
        raise UserError(message) from None


def _build_and_time(cfg: Any, options: BenchOptions, device: torch.device, precision: str) -> dict[str, Any]:
    model = _build_model(cfg, options, device, precision)
    runner, loss_fn = _forward_and_loss(model, options)
    optimizer = _build_optimizer(model, options, device)
    B, T = options.batch_size, options.context_length
    x = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    y = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16_autocast")
    fns = _step_functions(runner, model, loss_fn, optimizer, x, y, autocast)
    modes = MODES if options.mode == "all" else (options.mode,)
    flops_token = model_flops_per_token(model, T)
    results = _describe(cfg, model, options, device, precision, flops_token)
    _warn_if_gpu_sized(results, device)
    for mode in modes:
        try:
            with reported(f"bench {mode}", options.warmup + options.steps) as counter:
                stats = benchmark(counter.wrap(fns[mode]), warmup=options.warmup, steps=options.steps, device=device)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise UserError(_out_of_memory_message(model, mode, B, T, device)) from None
        results["modes"][mode] = _summarise(stats, mode, B * T, flops_token, precision, device)
    if options.memory_snapshot:
        with memory_snapshot(options.memory_snapshot):
            fns["train_step"]()
        results["memory_snapshot"] = options.memory_snapshot
    if options.profile:
        results["profile"] = profile_table(fns[modes[-1]], steps=2)
    return results


def _note_ignored_options(cfg: Any, options: BenchOptions, device: torch.device) -> None:
    """Options that would not change what is timed: say so rather than time without them silently."""
    for note in cfg.ignored_options():
        log.warning("note: %s", note)
    if options.optimizer == "scratchlm_fused" and device.type != "cuda":
        log.warning("note: --optimizer scratchlm_fused has no effect on %s (its Triton kernel needs a CUDA device); "
                    "the optimizer steps as with --optimizer scratchlm", device.type)


CPU_PARAMS_LIMIT = 20_000_000  # above this a CPU step takes seconds: the shape is meant for a GPU


def _warn_if_gpu_sized(results: dict[str, Any], device: torch.device) -> None:
    if device.type == "cpu" and results["params"] > CPU_PARAMS_LIMIT:
        log.warning("note: %.0fM parameters on the CPU: this size is meant for a GPU, each step takes "
                    "seconds to minutes (try --size tiny)", results["params"] / 1e6)


def _device_and_precision(options: BenchOptions) -> tuple[torch.device, str]:
    """The device and precision to run at, after checking the sizes asked for."""
    device = timing_device(options.device or None)
    precision = options.precision or ("bf16_autocast" if device.type == "cuda" else "fp32")
    if options.steps < 1 or options.warmup < 0 or options.batch_size < 1 or options.context_length < 1:
        raise UserError("--steps, --batch-size and --context-length must be >= 1, --warmup >= 0")
    if options.vocab_size is not None and options.vocab_size < 1:
        raise UserError(f"--vocab-size must be >= 1, got {options.vocab_size}")
    if options.activation_checkpointing < 0:
        raise UserError(f"--activation-checkpointing must be >= 0 (0: off), got {options.activation_checkpointing}")
    if not 0 <= options.seed < 2**64:
        raise UserError(f"--seed must be in [0, 2**64), got {options.seed}")
    if options.memory_snapshot:
        # Checked before the timing, not when the snapshot is written after it.
        if device.type != "cuda":
            raise UserError(f"--memory-snapshot records the CUDA allocator: it needs a CUDA device, not {device}")
        _check_output_file(options.memory_snapshot, "--memory-snapshot")
    return device, precision


def _check_output_file(path: str, flag: str) -> None:
    """Refuse an output file that cannot be written: a folder, or below a file."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name")
    parent = next((p for p in target.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is a file, not a directory")


def _check_attention_backend(name: str, device: torch.device) -> None:
    """A backend that cannot run on `device` would time 'math' under its name: refuse it."""
    from scratchlm.model.attention_backends import ATTENTION_BACKENDS

    if not ATTENTION_BACKENDS[name]().runs_on(device):
        usable = [n for n, cls in ATTENTION_BACKENDS.items() if cls().runs_on(device)]
        raise UserError(f"attention backend {name!r} does not run on {device.type} tensors (its calls would "
                        f"time 'math' instead); choose --attention-backend {' or '.join(usable)}")


def _build_model(cfg: Any, options: BenchOptions, device: torch.device, precision: str) -> torch.nn.Module:
    """The seeded model in the precision's weight dtype, checkpointed and NVTX-ranged as asked."""
    from scratchlm.model.transformer import build_model

    torch.manual_seed(options.seed)
    model = build_model(cfg, device=device, dtype=torch_dtype("bf16" if precision == "bf16" else "fp32"))
    if options.activation_checkpointing:
        from scratchlm.train.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model, every=options.activation_checkpointing)
    if options.profile:
        add_layer_nvtx_ranges(model)
    return model


def _forward_and_loss(model: torch.nn.Module, options: BenchOptions):
    """(the module a forward pass runs, the loss function of a training step), compiled as asked."""
    runner = torch.compile(model) if options.compile else model
    if options.fused_lm_head:
        # compiled, the trunk only: the chunked loss loop stays eager (it is a few large matmuls)
        trunk = _TrunkProxy(model, torch.compile(model.head_inputs)) if options.compile else model
        loss_fn = _loss_fn(trunk, True)
    elif options.compile:
        # the model and the float32 cross-entropy in one compiled graph, as a compiled training
        # script computes its loss inside the model's forward (no eager pass over the logits)
        loss_fn = torch.compile(_loss_fn(model, False))
    else:
        loss_fn = _loss_fn(model, False)
    return runner, loss_fn


def _build_optimizer(model: torch.nn.Module, options: BenchOptions, device: torch.device) -> torch.optim.Optimizer:
    if options.optimizer == "torch_fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # CPU too: what --optimizer names
    from scratchlm.optim.adamw import AdamW

    return AdamW(model.parameters(), lr=1e-4, fused=options.optimizer == "scratchlm_fused" or None)


def _step_functions(runner, model, loss_fn, optimizer, x, y, autocast) -> dict[str, Callable[[], None]]:
    """One callable per mode in MODES, each a full step of that mode on the batch (x, y)."""

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

    return {"forward": forward, "forward_backward": forward_backward, "train_step": train_step}


def _describe(cfg: Any, model: torch.nn.Module, options: BenchOptions, device: torch.device, precision: str,
              flops_token: float) -> dict[str, Any]:
    """The results dict before timing: what ran, on what, with an empty "modes"."""
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "context_length", "d_model", "num_layers",
                                               "num_heads", "d_ff", "attention_backend")},
        "params": sum(p.numel() for p in model.parameters()),
        "batch_size": options.batch_size, "context_length": options.context_length, "precision": precision,
        "compile": options.compile, "activation_checkpointing": options.activation_checkpointing,
        "fused_lm_head": options.fused_lm_head, "optimizer": options.optimizer,
        "flops_per_token_forward": flops_token, "modes": {},
    }


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


_CPU_ALLOCATION_FAILED = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def _cpu_out_of_memory_message(exc: RuntimeError, cfg: Any, options: BenchOptions) -> str | None:
    """What to try when the CPU allocator refused a tensor (torch raises a plain RuntimeError
    there, not OutOfMemoryError); None for any other error."""
    match = _CPU_ALLOCATION_FAILED.search(str(exc))
    if match is None:
        return None
    return (f"out of memory: the CPU allocator refused {int(match.group(1)) / 2**30:,.1f} GiB for batch "
            f"{options.batch_size} x context {options.context_length} of a model with vocab_size {cfg.vocab_size}, "
            f"d_model {cfg.d_model}, {cfg.num_layers} layers; try a smaller --batch-size, --context-length "
            "or model")


def _summarise(stats: BenchmarkResult, mode: str, tokens: int, flops_token: float, precision: str,
               device: torch.device) -> dict[str, Any]:
    out = stats.to_dict()
    out["tokens_per_s"] = tokens / stats.mean
    factor = 1.0 if mode == "forward" else float(TRAIN_FORWARDS)
    achieved = factor * flops_token * tokens / stats.mean
    out["tflops"] = achieved / 1e12
    if device.type == "cuda":
        peak = peak_flops(device, "bf16" if precision.startswith("bf16") else "tf32")
        out["mfu"] = achieved / peak if peak else None
        out["mfu_vs_measured_matmul"] = achieved / H200_BF16_MEASURED_MATMUL
    return out
