"""Mixture-of-experts benchmarks: the MoE layer against a dense FFN, and MoE vs dense training.

    python benchmarks/moe.py layer [--compile | --cudagraphs] [--json out.json]
    python benchmarks/moe.py train --train-bin T --val-bin V --tokenizer-dir K --runs DIR [--budget-s S]
    python benchmarks/moe.py throughput --train-bin T --val-bin V --tokenizer-dir K --runs DIR [--deadline-s S]
    python benchmarks/moe.py report DIR --out OUT

``layer``: forward + backward of one FFN on (tokens, d_model) fp32 activations under bf16
autocast (as in training), at the GPT-2-small shape (d_model 768, dense SwiGLU d_ff 3072). An
MoE of *equal active FLOPs* routes each token through ``top_k`` experts of width
``d_ff · 1 / top_k`` (so ``top_k · d_ff_expert = 3072``; the router's ``d_model · E`` is extra
and counted). Each MoE variant prints its time, tokens/s and the ratio of its tokens/s to the
dense FFN's (1.0 = as fast as the dense FFN of equal active FLOPs). ``--compile`` compiles every
case with ``torch.compile``; ``--cudagraphs`` (implies ``--compile``) uses
``mode="reduce-overhead"`` instead, which replays each case's forward and backward as CUDA
graphs (no launch overhead between kernels), and marks the start of every step with
``torch.compiler.cudagraph_mark_step_begin()``. Off CUDA that mode compiles without graphs.

``train``: the variants of ``VARIANTS`` (dense and MoE on the 17M preset's shape) trained
concurrently on one GPU with ``trainer.compile``, each as its own process with a time budget
(the trainer stops at the budget, evaluates and logs, so a slow variant still reports the
validation loss at the tokens it reached). Sharing the GPU makes their tokens/s incomparable;
``throughput`` measures each variant alone (a short run, eager by default: no compile wait)
for that. ``report`` reads the run directories into ``moe_results.json`` and
``moe_results.md``.

"Equal active compute": a token's FFN FLOPs are ``top_k · 3 · 2 · d_model · d_ff`` (plus the
router's ``2 · d_model · E``), so 4 experts top-1 at the dense d_ff, 4 experts top-2 at d_ff/2
and 8 experts top-2 at d_ff/2 all match the dense FFN; 4 experts top-2 at the dense d_ff spends
twice its FLOPs; 4 experts top-1 at d_ff/4 has the dense FFN's *parameters* and a quarter of its
FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (model overrides, what it is). d_ff of the 17M preset: 1344.
VARIANTS: dict[str, tuple[list[str], str]] = {
    "dense": ([], "SwiGLU d_ff 1344"),
    "moe4_top1": (["--model.ffn=moe", "--model.moe_num_experts=4", "--model.moe_top_k=1"],
                  "4 experts x 1344, top-1: dense active FLOPs, 4x FFN params"),
    "moe4_top2": (["--model.ffn=moe", "--model.moe_num_experts=4", "--model.moe_top_k=2"],
                  "4 experts x 1344, top-2: 2x dense active FLOPs"),
    "moe4_top2_dff672": (["--model.ffn=moe", "--model.moe_num_experts=4", "--model.moe_top_k=2", "--model.d_ff=672"],
                         "4 experts x 672, top-2: dense active FLOPs, 2x FFN params"),
    "moe4_top1_dff336": (["--model.ffn=moe", "--model.moe_num_experts=4", "--model.moe_top_k=1", "--model.d_ff=336"],
                         "4 experts x 336, top-1: dense FFN params, 1/4 of its FLOPs"),
    "moe8_top2_dff672": (["--model.ffn=moe", "--model.moe_num_experts=8", "--model.moe_top_k=2", "--model.d_ff=672"],
                         "8 experts x 672, top-2 (fine-grained): dense active FLOPs, 4x FFN params"),
}


# ---------------------------------------------------------------- layer throughput


def _layer_mode(compiled: bool, cudagraphs: bool) -> str:
    """How the layer benchmark ran, for its header and the report."""
    if cudagraphs:
        return "compiled, CUDA graphs"
    return "compiled" if compiled else "eager"


def _layer_cases(d_model: int, d_ff: int) -> list[tuple[str, dict | None]]:
    """(name, MoEFFN options or None for the dense SwiGLU); every MoE has the dense active FLOPs."""
    return [
        ("dense swiglu", None),
        ("moe 8x top-2 dropless, grouped_mm", dict(num_experts=8, top_k=2, d_ff=d_ff // 2, gemm="grouped_mm")),
        ("moe 8x top-2 dropless, portable", dict(num_experts=8, top_k=2, d_ff=d_ff // 2, gemm="portable")),
        ("moe 8x top-2 cf 1.25, grouped_mm", dict(num_experts=8, top_k=2, d_ff=d_ff // 2, capacity_factor=1.25,
                                                 gemm="grouped_mm")),
        ("moe 8x top-2 cf 1.25, portable (bmm)", dict(num_experts=8, top_k=2, d_ff=d_ff // 2, capacity_factor=1.25,
                                                     gemm="portable")),
        ("moe 4x top-1 dropless, grouped_mm", dict(num_experts=4, top_k=1, d_ff=d_ff, gemm="grouped_mm")),
        ("moe 16x top-4 dropless, grouped_mm", dict(num_experts=16, top_k=4, d_ff=d_ff // 4, gemm="grouped_mm")),
        ("moe 8x top-2 dropless, triton", dict(num_experts=8, top_k=2, d_ff=d_ff // 2, gemm="triton")),
        ("moe 8x top-2 cf 1.25, triton", dict(num_experts=8, top_k=2, d_ff=d_ff // 2, capacity_factor=1.25,
                                             gemm="triton")),
    ]


def _has_triton() -> bool:
    from scratchlm.kernels.triton_support import triton_available
    return triton_available()


def layer_command(args: argparse.Namespace) -> int:
    import torch

    from scratchlm.bench.harness import benchmark
    from scratchlm.bench.profile import profile_table
    from scratchlm.bench.results import write_json
    from scratchlm.model.accounting import ffn_flops
    from scratchlm.model.layers import SwiGLU
    from scratchlm.model.moe import MoEFFN, grouped_mm_supported

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    D, F, T = args.d_model, args.d_ff, args.tokens
    compile_ = args.compile or args.cudagraphs
    rows = []
    print(f"FFN forward+backward, {T} tokens, d_model {D}, dense d_ff {F}, bf16 autocast, "
          f"{_layer_mode(compile_, args.cudagraphs)}, {device}")
    dense_rate = None
    dense_flops = ffn_flops("swiglu", D, F)
    cases = _layer_cases(D, F)
    if args.cases:
        wanted = [int(i) for i in args.cases.split(",")]
        cases = [c for i, c in enumerate(cases) if i in wanted]
    for name, opts in cases:
        if opts is not None and opts["gemm"] == "grouped_mm" and not grouped_mm_supported():
            print(f"{name:40s} skipped: torch has no _grouped_mm")
            continue
        if opts is not None and opts["gemm"] == "triton" and not (_has_triton() and device.type == "cuda"):
            print(f"{name:40s} skipped: the Triton kernels need triton and a CUDA device")
            continue
        torch.manual_seed(0)
        if opts is None:
            module = SwiGLU(D, F, device=device)
            flops = dense_flops
        else:
            opts = dict(opts)
            module = MoEFFN(D, opts.pop("d_ff"), opts.pop("num_experts"), opts.pop("top_k"), device=device, **opts)
            flops = ffn_flops("moe", D, module.d_ff, num_experts=module.num_experts, top_k=module.top_k)
        if args.cudagraphs:
            fn_module = torch.compile(module, mode="reduce-overhead")
        else:
            fn_module = torch.compile(module) if compile_ else module
        x = torch.randn(T, D, device=device, requires_grad=True)
        grad = torch.randn(T, D, device=device)

        def step(fn_module=fn_module, x=x, grad=grad, module=module):
            if args.cudagraphs:  # a new step: the previous step's graph outputs may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                y = fn_module(x)
            y.backward(grad.to(y.dtype))
            module.zero_grad(set_to_none=True)
            x.grad = None

        try:
            result = benchmark(step, warmup=args.warmup, steps=args.steps, device=device)
        except Exception as exc:  # one failing variant must not hide the others
            print(f"{name:40s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        rate = T / result.median
        if opts is None:
            dense_rate = rate
        ratio = rate / dense_rate if dense_rate else None
        rows.append({"name": name, "ms": result.median * 1e3, "tokens_per_s": rate, "ratio_vs_dense": ratio,
                     "active_flops_per_token_fwd": flops, "times_ms": [t * 1e3 for t in result.times]})
        print(f"{name:40s} {result.median * 1e3:8.3f} ms  {rate / 1e6:7.2f} M tok/s  "
              f"x{ratio:.2f} of dense  ({flops / dense_flops:.3f}x dense active FLOPs)", flush=True)
        if args.profile:  # where a case's time goes: a kernel table of 5 more steps
            print(profile_table(step, 5, row_limit=args.profile_rows), flush=True)
        if args.json:  # after every row, so a timeout keeps what was measured
            out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "torch": torch.__version__, "compile": compile_, "cudagraphs": args.cudagraphs,
                   "tokens": T, "d_model": D, "d_ff": F, "rows": rows}
            write_json(args.json, out)
    return 0


# ---------------------------------------------------------------- training runs


def _common(args: argparse.Namespace, steps: int) -> list[str]:
    return [f"--data.train_path={args.train_bin}", f"--data.val_path={args.val_bin}",
            f"--data.tokenizer_dir={args.tokenizer_dir}", f"--trainer.compile={'true' if args.compile else 'false'}",
            "--trainer.checkpoint_interval=0",
            "--trainer.keep_checkpoints=1", "--trainer.sample_tokens=0", "--trainer.progress=false",
            f"--trainer.max_steps={steps}", *shlex.split(args.extra)]


def _launch(args: argparse.Namespace, name: str, run_dir: Path, steps: int, budget_s: float,
            more: list[str]) -> subprocess.Popen:
    overrides = [*VARIANTS[name][0], *_common(args, steps), *more, f"--trainer.out_dir={run_dir}"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{name}.log", "w")
    cmd = [sys.executable, __file__, "one", "--budget-s", str(budget_s), args.config, *overrides]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _variants(args: argparse.Namespace) -> list[str]:
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return names


def train_command(args: argparse.Namespace) -> int:
    """All variants at once, each stopping at its token budget or time budget, whichever first."""
    steps = max(1, args.tokens // (args.batch_size * args.context_length))
    procs = {name: _launch(args, name, Path(args.runs) / "train" / name, steps, args.budget_s, [])
             for name in _variants(args)}
    failed = []
    for name, proc in procs.items():
        try:
            rc = proc.wait(timeout=args.budget_s + args.grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed"
        if rc != 0:
            failed.append(f"{name} ({rc})")
    print("train runs done" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 0


def throughput_command(args: argparse.Namespace) -> int:
    """Each variant alone, one after another, a short compiled run; stops starting runs at the deadline."""
    deadline = time.monotonic() + args.deadline_s
    for name in _variants(args):
        left = deadline - time.monotonic()
        budget = left - 15  # the run's own time budget, 15 s short of the deadline for start-up
        if budget < args.min_run_s:
            print(f"throughput: no time left for {name}; skipped")
            continue
        proc = _launch(args, name, Path(args.runs) / "throughput" / name, args.steps, budget,
                       [f"--trainer.log_interval={args.log_interval}", "--trainer.eval_interval=0",
                        "--trainer.eval_at_start=false"])
        try:
            proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            print(f"throughput: {name} killed at the deadline")
    return 0


def one_command(args: argparse.Namespace) -> int:
    """One training run with a time budget (the trainer evaluates and finishes when it runs out)."""
    import logging

    from scratchlm.config import load_config
    from scratchlm.train.config import TrainConfig
    from scratchlm.train.run_dir import prepare_run_dir
    from scratchlm.train.trainer import Trainer

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = load_config(TrainConfig, args.config, args.overrides)
    run_dir = prepare_run_dir(cfg.trainer.out_dir, resume=False, overwrite=True)
    deadline = time.monotonic() + args.budget_s
    trainer = Trainer(cfg, run_dir)
    try:
        trainer.fit(deadline=deadline)
    finally:
        trainer.logger.close()
    return 0


# ---------------------------------------------------------------- report


def _summarise(run: Path) -> dict:
    from scratchlm.config import load_config
    from scratchlm.bench.results import read_jsonl
    from scratchlm.model.accounting import count_params, forward_flops
    from scratchlm.train.config import TrainConfig

    cfg = load_config(TrainConfig, run / "config.toml")
    records = read_jsonl(run / "metrics.jsonl")
    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    tokens_per_step = cfg.trainer.batch_size * cfg.model.context_length
    params = count_params(cfg.model)
    flops = forward_flops(cfg.model)
    steady = train[1:] if len(train) > 2 else train  # the first window holds the compilation
    tail = train[-max(1, len(train) // 5):]  # router statistics over the last fifth of training
    out = {
        "run": run.name,
        "steps": train[-1]["step"] if train else 0,
        "tokens": (train[-1]["step"] if train else 0) * tokens_per_step,
        "max_steps": cfg.trainer.max_steps,
        "params_total": params["total"], "params_active": params["active"],
        "ffn_flops_per_token_fwd": flops["ffn"] // cfg.model.context_length,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "val_curve": [(e["step"] * tokens_per_step, e["val_loss"]) for e in evals],
        "train_loss": train[-1]["loss"] if train else None,
    }
    if train and "moe_aux_loss" in train[-1]:
        mean = lambda key: statistics.fmean(r[key] for r in tail)  # noqa: E731
        out.update(moe_aux_loss=mean("moe_aux_loss"), moe_z_loss=mean("moe_z_loss"),
                   moe_router_entropy=mean("moe_router_entropy"), moe_max_expert_util=mean("moe_max_expert_util"),
                   moe_dropped_fraction=mean("moe_dropped_fraction"), moe_expert_util=train[-1]["moe_expert_util"],
                   num_experts=cfg.model.moe_num_experts)
    return out


def common_eval_tokens(curves: list[list]) -> int:
    """The largest token count at which every run evaluated: the fair comparison point."""
    seen = [{t for t, _ in curve} for curve in curves]
    return max(set.intersection(*seen), default=0) if seen else 0


def _at_tokens(curve: list, tokens: int) -> float | None:
    return next((loss for t, loss in curve if t == tokens), None)


def report_command(args: argparse.Namespace) -> int:
    runs = Path(args.runs)
    result: dict = {"layer": {}, "train": {}, "throughput": {}}
    for path in sorted(runs.glob("layer*.json")):
        result["layer"][path.stem] = json.loads(path.read_text())
    for kind in ("train", "throughput"):
        for run in sorted((runs / kind).glob("*")):
            if (run / "metrics.jsonl").is_file() and (run / "config.toml").is_file():
                try:
                    result[kind][run.name] = _summarise(run)
                except Exception as exc:  # a broken run is reported, not fatal
                    result[kind][run.name] = {"run": run.name, "error": f"{type(exc).__name__}: {exc}"}
    train = {k: v for k, v in result["train"].items() if "error" not in v}
    common = common_eval_tokens([v["val_curve"] for v in train.values()])
    lines = ["| variant | what | params total / active | FFN FLOPs/token vs dense | tokens | val loss "
             f"| val loss @ {common / 1e6:.2f}M tok | tok/s alone | tok/s shared | max expert share | aux (LB) "
             "| router entropy |", "|" + "---|" * 12]
    dense_ffn = train.get("dense", {}).get("ffn_flops_per_token_fwd")
    for name in VARIANTS:
        v = train.get(name)
        if v is None:
            continue
        alone = result["throughput"].get(name, {}).get("tokens_per_s")
        fmt = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
        share = "-" if "moe_max_expert_util" not in v else (
            f"{v['moe_max_expert_util']:.3f} (1/E = {1 / v['num_experts']:.3f})")
        lines.append(
            f"| {name} | {VARIANTS[name][1]} | {v['params_total'] / 1e6:.1f}M / {v['params_active'] / 1e6:.1f}M | "
            f"{fmt(v['ffn_flops_per_token_fwd'] / dense_ffn if dense_ffn else None, '.2f')} | "
            f"{v['tokens'] / 1e6:.2f}M | {fmt(v['val_loss'], '.4f')} | "
            f"{fmt(_at_tokens(v['val_curve'], common), '.4f')} | {fmt(alone, ',.0f')} | "
            f"{fmt(v['tokens_per_s'], ',.0f')} | {share} | {fmt(v.get('moe_aux_loss'), '.3f')} | "
            f"{fmt(v.get('moe_router_entropy'), '.3f')} |")
    layer_lines = []
    for key, layer in result["layer"].items():
        mode = _layer_mode(layer.get("compile"), layer.get("cudagraphs"))
        layer_lines.append(f"\n{key}: {layer.get('device')}, torch {layer.get('torch')}, {mode}, "
                           f"{layer.get('tokens')} tokens\n")
        layer_lines.append("| FFN | ms (fwd+bwd) | M tok/s | x dense |\n|---|---|---|---|")
        for r in layer["rows"]:
            if "error" in r:
                layer_lines.append(f"| {r['name']} | failed: {r['error'][:80]} | | |")
            else:
                layer_lines.append(f"| {r['name']} | {r['ms']:.3f} | {r['tokens_per_s'] / 1e6:.2f} | "
                                   f"{r['ratio_vs_dense']:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from scratchlm.bench.results import write_json

    write_json(out / "moe_results.json", result)
    table = "\n".join(layer_lines) + "\n\nTraining\n\n" + "\n".join(lines) + "\n"
    (out / "moe_results.md").write_text(table)
    print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("layer")
    s.add_argument("--tokens", type=int, default=32 * 1024)
    s.add_argument("--d-model", type=int, default=768)
    s.add_argument("--d-ff", type=int, default=3072)
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--warmup", type=int, default=5)
    s.add_argument("--compile", action="store_true")
    s.add_argument("--cudagraphs", action="store_true",
                   help='compile with mode="reduce-overhead" (CUDA graphs); implies --compile')
    s.add_argument("--cases", help="comma-separated indices of the cases to run (0 = dense), default all")
    s.add_argument("--profile", action="store_true", help="after each case, a profiler table of 5 more steps")
    s.add_argument("--profile-rows", type=int, default=15)
    s.add_argument("--device")
    s.add_argument("--json")
    for name, help_ in (("train", "all variants concurrently"), ("throughput", "each variant alone")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--train-bin", required=True)
        s.add_argument("--val-bin", required=True)
        s.add_argument("--tokenizer-dir", required=True)
        s.add_argument("--runs", required=True)
        s.add_argument("--config", default=str(ROOT / "configs" / "tinystories-17m.toml"))
        s.add_argument("--variants", help="comma-separated names of VARIANTS (default: all)")
        s.add_argument("--extra", default="",
                       help='more overrides for every run, as one string: --extra="--a.b=1 --c.d=2"')
        s.add_argument("--compile", type=int, default=1 if name == "train" else 0, help="trainer.compile (1/0)")
        s.add_argument("--batch-size", type=int, default=32)
        s.add_argument("--context-length", type=int, default=256)
        if name == "train":
            s.add_argument("--tokens", type=int, default=40_960_000)
            s.add_argument("--budget-s", type=float, default=300.0)
            s.add_argument("--grace-s", type=float, default=60.0, help="after the budget: eval and exit")
        else:
            s.add_argument("--steps", type=int, default=300)
            s.add_argument("--log-interval", type=int, default=25)
            s.add_argument("--deadline-s", type=float, default=120.0)
            s.add_argument("--min-run-s", type=float, default=40.0)
    s = sub.add_parser("one")
    s.add_argument("config")
    s.add_argument("--budget-s", type=float, required=True)
    s.add_argument("overrides", nargs=argparse.REMAINDER)
    s = sub.add_parser("report")
    s.add_argument("runs")
    s.add_argument("--out", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"layer": layer_command, "train": train_command, "throughput": throughput_command,
                "one": one_command, "report": report_command}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
