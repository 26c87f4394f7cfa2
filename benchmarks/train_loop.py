"""Steady-state training steps of `scratchlm train` against the torch.nn reference trainer.

    python benchmarks/train_loop.py [--batch 32] [--steps 50] [--profile] [--json out.json]
        [--variant NAME=--section.key=value,...]

What is timed is the real thing on each side, on the same random token file:

- scratchlm: `scratchlm.train.trainer.Trainer._train_step`, the step of `scratchlm train`
  (batch from the memmap sampler, forward under bf16 autocast, loss, backward, clipping,
  scratchlm's AdamW, scheduled lr), built from `configs/tinystories-17m.toml` plus overrides.
- reference: the step of `benchmarks/reference_trainer.py` (`scratchlm.bench.reference_model`: nn.Linear / nn.RMSNorm / SDPA,
  F.cross_entropy, clip_grad_norm_, fused torch.optim.AdamW, torch.compile), same shape.

Steps run back to back (as in training) and the device is synchronised once per window of
`--steps`; the figure is the median window. `--profile` prints each side's ten most expensive
CUDA kernels over one window (torch.profiler), to see where a step's time goes; `--step-trace`
lists one step's top-level host ops and CUDA-graph launches in order (what runs outside graphs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from scratchlm.bench.profile import kernel_times
from scratchlm.bench.reference_model import ReferenceLM, reference_adamw, window_batch
from scratchlm.bench.results import add_ratios, environment, ratio_table, write_json
from scratchlm.bench.timing import timed_windows

BASE = ["--trainer.compile=true", "--model.attention_backend=flash_triton"]


def _top_kernels(step_fn, steps: int, n: int = 10) -> list[tuple[str, float]]:
    """The step's total GPU kernel time and its ``n`` most expensive kernels, ms per step."""
    times = kernel_times(step_fn, steps, warmup=0)
    rows = sorted(((name, ms) for name, (ms, _) in times.items()), key=lambda r: -r[1])
    return [("TOTAL device ms/step", sum(ms for _, ms in rows))] + rows[:n]


def _host_profile(step_fn, steps: int) -> dict:
    """Per step: CUDA runtime calls by name (launches, copies, synchronisations) and the
    Python functions with the most self time, to tell host-bound steps from device-bound ones."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_fn()
        torch.cuda.synchronize()
    runtime = {e.key: e.count / steps for e in prof.key_averages()
               if e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudnn")}
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(steps):
        step_fn()
    pr.disable()
    host_ms = (time.perf_counter() - t0) / steps * 1e3
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(18)
    return {"runtime_calls_per_step": runtime, "host_ms_under_cprofile": host_ms, "python_top": text.getvalue()}


def _step_trace(step_fn) -> list[tuple[int, str]]:
    """The host-side sequence of one step: top-level ops and CUDA-graph launches in time order,
    runs of the same name collapsed to (count, name). Shows what runs outside the graphs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_fn()
        torch.cuda.synchronize()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    seq: list[list] = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if e.cpu_parent is not None and e.name != "cudaGraphLaunch":
            continue
        if seq and seq[-1][1] == e.name:
            seq[-1][0] += 1
        else:
            seq.append([1, e.name])
    return [(n, name) for n, name in seq]


def scratchlm_step(bin_path: str, batch: int, overrides: list[str], out_dir: str):
    from scratchlm.config import load_config
    from scratchlm.train.config import TrainConfig
    from scratchlm.train.trainer import Trainer

    cfg = load_config(TrainConfig, "tinystories-17m", [
        f"--data.train_path={bin_path}", "--data.val_path=", "--data.tokenizer_dir=",
        f"--trainer.batch_size={batch}", "--trainer.max_steps=100000", "--trainer.progress=false",
        f"--trainer.out_dir={out_dir}", *BASE, *overrides])
    trainer = Trainer(cfg, out_dir)
    return trainer._train_step, cfg


def _ref_loss(model, x, y):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


def reference_step(bin_path: str, batch: int, cfg, mode: str = "default", compile_loss: bool = False):
    m = cfg.model
    model = ReferenceLM(m.vocab_size, m.context_length, m.d_model, m.num_layers, m.num_heads, m.d_ff,
                        m.rope_theta).cuda()
    opt = reference_adamw(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    # the compiled model with the loss after it (eager), or model and loss in one compiled graph
    loss_fn, target = (torch.compile(_ref_loss, mode=mode), model) if compile_loss else (
        _ref_loss, torch.compile(model, mode=mode))
    tokens = np.memmap(bin_path, dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)
    T = m.context_length

    def step():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        x, y = window_batch(tokens, rng.integers(0, len(tokens) - T - 1, size=batch), T, "cuda")
        loss = loss_fn(target, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=50, help="steps per timed window")
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=--k=v,--k=v: a scratchlm variant (default: one with no extra overrides)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--reference-cudagraphs", action="store_true",
                   help="also time the reference compiled with mode='reduce-overhead'")
    p.add_argument("--reference-compiled-loss", action="store_true",
                   help="also time the reference with its loss compiled together with the model")
    p.add_argument("--host-profile", action="store_true", help="CUDA runtime calls and Python hot spots")
    p.add_argument("--step-trace", action="store_true",
                   help="the top-level host ops and CUDA-graph launches of one step, in order")
    p.add_argument("--json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    variants = {"scratchlm": []}
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        variants[name] = [o for o in rest.split(",") if o]
    tmp = Path(tempfile.mkdtemp())
    bin_path = str(tmp / "tokens.bin")
    np.random.default_rng(0).integers(0, 10_000, size=20_000_000, dtype=np.uint16).tofile(bin_path)
    Path(bin_path).with_suffix(".json").write_text(json.dumps(  # the sidecar the trainer checks
        {"dtype": "uint16", "vocab_size": 10_000, "num_tokens": 20_000_000}))
    results = {**environment(), "batch": args.batch, "rows": []}
    cfg = None
    steps = {}
    for name, overrides in variants.items():
        step, cfg_v = scratchlm_step(bin_path, args.batch, overrides, str(tmp / f"run_{name}"))
        cfg = cfg or cfg_v
        steps[name] = step
    steps["reference"] = reference_step(bin_path, args.batch, cfg)
    if args.reference_cudagraphs:
        steps["reference (reduce-overhead)"] = reference_step(bin_path, args.batch, cfg, "reduce-overhead")
    if args.reference_compiled_loss:
        steps["reference (loss compiled)"] = reference_step(bin_path, args.batch, cfg, compile_loss=True)
        if args.reference_cudagraphs:
            steps["reference (loss compiled, reduce-overhead)"] = reference_step(
                bin_path, args.batch, cfg, "reduce-overhead", compile_loss=True)
    tokens_per_step = args.batch * cfg.model.context_length
    for name, step in steps.items():
        t0 = time.perf_counter()
        try:
            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize()
        except Exception as exc:  # one broken variant must not cost the others' figures
            print(f"{name}: failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        warm_s = time.perf_counter() - t0
        times = timed_windows(step, args.steps, args.windows, device="cuda")
        med = float(np.median(times))
        row = {"variant": name, "overrides": variants.get(name, []), "step_ms": med * 1e3,
               "step_ms_all": [t * 1e3 for t in times], "tokens_per_s": tokens_per_step / med,
               "warmup_s": warm_s, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        results["rows"].append(row)
        print(f"{name:<28}{med * 1e3:8.2f} ms/step {tokens_per_step / med:12.0f} tok/s  (warm-up {warm_s:.1f} s)",
              flush=True)
        if args.profile:
            row["top_kernels_ms"] = _top_kernels(step, args.steps)
            for k, t in row["top_kernels_ms"]:
                print(f"    {t:8.3f}  {k[:100]}", flush=True)
        if args.host_profile:
            row["host"] = _host_profile(step, 20)
            calls = sorted(row["host"]["runtime_calls_per_step"].items(), key=lambda kv: -kv[1])
            print("    runtime calls/step: " + ", ".join(f"{k} {v:.0f}" for k, v in calls[:12]), flush=True)
            print(row["host"]["python_top"][-3500:], flush=True)
        if args.step_trace:
            row["step_trace"] = _step_trace(step)
            print("    one step: " + ", ".join(f"{n}x {name[:60]}" for n, name in row["step_trace"]), flush=True)
        torch.cuda.reset_peak_memory_stats()
    ref = next((r for r in results["rows"] if r["variant"] == "reference"), None)
    if ref is None:
        return 1
    add_ratios(results["rows"], ref, {"ratio_vs_reference": "tokens_per_s"})
    print()
    print(ratio_table(results["rows"], label="variant", value="tokens_per_s", ratio_key="ratio_vs_reference",
                      header=("variant", "tok/s", "vs ref"), value_format=".0f"))
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
