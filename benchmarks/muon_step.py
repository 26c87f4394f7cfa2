"""Cost of one optimizer step at the 17M shape: Muon's ops and host time, beside AdamW's.

    python benchmarks/muon_step.py [--steps 50] [--windows 9] [--host-divisor 64] [--json out.json]

The parameters are those of `configs/tinystories-17m.toml` (4 layers, d_model 512, d_ff 1344,
vocab 10K: 16 attention matrices (512, 512), 8 FFN w1/w3 (1344, 512), 4 w2 (512, 1344)) and the
optimizers are built as `scratchlm train` builds them (`scratchlm.optim.optimizer_spec`), with
random gradients. Rows:

- "muon matrices": `Muon.step()` over the Muon group alone (the blocks' matrices);
- "muon, all groups" and "adamw, all groups": the whole optimizer of ``optim.name=muon`` and of
  ``optim.name=adamw`` (``optim.foreach=true``, ``optim.fused=false``: the multi-tensor AdamW path,
  what CUDA runs without the Triton kernel).

For each row, from torch.profiler over one step (after warm-up):

- ``ops``: the aten ops the step issues from Python (top-level ops), and ``work_ops``: those of
  them that compute or copy (views, allocations and other metadata ops left out). On CUDA each
  work op is about one kernel launch (a `_foreach_*` op is one launch for its whole list); on a
  CUDA device the row also counts the real ``kernels``;
- ``all_ops``: every aten op, nested ones included (on CPU a `_foreach_*` op runs one op per tensor).

Host time: the median over ``--windows`` windows of ``--steps`` back-to-back steps, with every
width divided by ``--host-divisor`` (default 64: d_model 8, d_ff 21, vocab 156; the same number
and orientation of matrices, so the same ops), which leaves the arithmetic small on CPU: what is
timed is mostly Python and dispatch, the part of a step that kernel launches cost on a GPU, on
one intra-op thread (``--threads``).
``--full-steps N`` also times N steps at the real widths (arithmetic-bound on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scratchlm.bench.results import environment, write_json

# What a step does to tensors' metadata only: no kernel runs for these.
METADATA_OPS = {
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::transpose", "aten::t", "aten::permute",
    "aten::select", "aten::slice", "aten::unbind", "aten::split", "aten::chunk", "aten::narrow", "aten::expand",
    "aten::unsqueeze", "aten::squeeze", "aten::reshape", "aten::alias", "aten::detach", "aten::detach_",
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resize_", "aten::result_type",
    "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh", "aten::numpy_T", "aten::mT",
    "aten::matrix_H", "aten::to", "aten::contiguous", "aten::index_select_backward", "aten::is_nonzero",
}

SHAPE_17M = dict(vocab_size=10000, context_length=256, d_model=512, num_layers=4, num_heads=16, d_ff=1344)


def make_model(divisor: int):
    from scratchlm.model.config import ModelConfig
    from scratchlm.model.transformer import build_model

    s = SHAPE_17M
    cfg = ModelConfig(**{**s, "vocab_size": s["vocab_size"] // divisor, "d_model": s["d_model"] // divisor,
                         "d_ff": s["d_ff"] // divisor, "num_heads": max(1, s["num_heads"] // divisor)})
    return build_model(cfg)


def make_row(name: str, divisor: int, device: torch.device):
    """(step function, optimizer) of row `name` over a fresh model whose widths are divided by `divisor`."""
    from scratchlm.optim import optimizer_spec
    from scratchlm.optim.config import OptimConfig

    model = make_model(divisor).to(device)
    optim_name = "adamw" if name.startswith("adamw") else "muon"
    cfg = OptimConfig(name=optim_name, foreach=True, fused=False)
    cls, groups, kwargs = optimizer_spec(cfg)
    groups = groups(model)
    if name == "muon matrices":
        groups = [g for g in groups if g.get("muon")]
    optimizer = cls(groups, **kwargs)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    gen = torch.Generator(device="cpu").manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen).mul_(1e-2).to(device) for p in params]

    def step():
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()

    return step, optimizer


def does_work(event) -> bool:
    """Whether an op computes or copies: it is no metadata op, or one under it is none."""
    return event.name not in METADATA_OPS or any(does_work(c) for c in event.cpu_children
                                                 if c.name.startswith("aten::"))


def count_ops(step, device: torch.device) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    aten = [e for e in events if e.name.startswith("aten::")]

    def top_level(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    top = [e for e in aten if top_level(e)]
    row = {"ops": len(top), "work_ops": sum(does_work(e) for e in top), "all_ops": len(aten)}
    if device.type == "cuda":
        row["kernels"] = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    return row


def host_ms(step, device: torch.device, steps: int, windows: int) -> list[float]:
    times = []
    for _ in range(windows):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return times


ROWS = ("muon matrices", "muon, all groups", "adamw, all groups")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="steps per timed window")
    p.add_argument("--windows", type=int, default=9, help="timed windows (the median is reported)")
    p.add_argument("--host-divisor", type=int, default=64, help="widths divided by this for the host time")
    p.add_argument("--full-steps", type=int, default=0, help="also time this many steps at the real widths")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: steadier host times beside other work; 0: leave as is)")
    p.add_argument("--json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = {"environment": environment(), "args": vars(args), "rows": []}
    print(f"{'row':20s} {'ops':>5s} {'work':>5s} {'all':>5s} {'host ms/step (median, windows)':>34s}")
    for name in ROWS:
        small, _ = make_row(name, args.host_divisor, device)
        for _ in range(5):
            small()
        times = host_ms(small, device, args.steps, args.windows)
        step, _ = make_row(name, 1, device)
        for _ in range(3):
            step()
        row = {"name": name, **count_ops(step, device), "host_ms": statistics.median(times), "host_ms_windows": times}
        if args.full_steps:
            row["full_ms"] = statistics.median(host_ms(step, device, 1, args.full_steps))
        results["rows"].append(row)
        span = f"{min(times):.3f}-{max(times):.3f}"
        extra = f"  kernels {row['kernels']}" if "kernels" in row else ""
        extra += f"  full width {row['full_ms']:.1f} ms" if "full_ms" in row else ""
        print(f"{name:20s} {row['ops']:5d} {row['work_ops']:5d} {row['all_ops']:5d} "
              f"{row['host_ms']:10.3f} ({span}){extra}")
        if args.json:
            write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
