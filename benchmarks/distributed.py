"""Data-parallel strategies on 2 local gloo processes: memory per rank and communication per step.

Two measurements, each in fresh 2-rank process groups (scratchlm.parallel.launch.spawn):

1. Memory. For every engine strategy, one training step of a TransformerLM, then on each rank
   the bytes of the tensors it holds (sum of numel * element_size over parameters, gradients
   and optimizer state) and the process's resident set size (current and peak, /proc). The
   tensor bytes are compared with the textbook formula for P fp32 parameters and N ranks:
   DDP P / P / 2P, ZeRO-1 P / P / 2P/N, FSDP P/N / P/N / 2P/N (params / grads / AdamW state;
   FSDP's replicated RMSNorm gains are the small excess).
2. Communication. Step time of naive (per-parameter all-reduce after backward), flat (one
   all-reduce after backward), overlapped (per-parameter async all-reduce during backward) and
   bucketed DDP for bucket sizes 1, 10, 100, 1000 MB, with PyTorch's DistributedDataParallel
   (25 MB buckets) as the peer, and the same step with no communication at all (each rank
   trains alone) as the floor. "exposed comm" is the time spent in
   finish_gradient_synchronization (the communication that did not overlap backward);
   "overhead" is step time minus the no-communication step time (the faster of two such runs,
one before and one after the others).

    python benchmarks/distributed.py                 # GPT-2 small shape, batch 1 x 64 tokens
    python benchmarks/distributed.py --shape reduced # 4 layers of width 512: quicker on a busy CPU

Prints two tables and writes JSON (default docs/benchmarks/distributed.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from scratchlm.bench.results import write_json

SHAPES = {
    # GPT-2 small (124M parameters with a 50257 vocabulary), tiny batch so a CPU can step it.
    "gpt2-small": dict(vocab_size=50257, context_length=64, d_model=768, num_layers=12, num_heads=12, d_ff=3072),
    "reduced": dict(vocab_size=8192, context_length=64, d_model=512, num_layers=4, num_heads=8, d_ff=2048),
}
MEMORY_STRATEGIES = ["ddp", "zero1", "fsdp", "torch_ddp", "torch_fsdp2"]
# "none" runs first and last: a drift between the two shows how much the shared CPU's load moved.
COMM_VARIANTS = ["none", "naive_ddp", "flat_ddp", "ddp", "bucket_1", "bucket_10", "bucket_100", "bucket_1000",
                 "torch_ddp", "none_again"]


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB, from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields.get("VmRSS", float("nan")), fields.get("VmHWM", float("nan"))


def _nbytes(tensors) -> int:
    """Bytes of distinct tensors (a tied weight counts once); a DTensor counts its local shard."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t) or id(t) in seen:
            continue
        seen.add(id(t))  # `tensors` keeps t alive, so its id cannot be reused meanwhile
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _batch(shape: dict, batch: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    t = torch.randint(0, shape["vocab_size"], (batch, shape["context_length"] + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _loss(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def memory_worker(rank: int, world: int, shape: dict, batch: int, strategy: str) -> dict:
    from scratchlm.model.transformer import TransformerLM
    from scratchlm.optim.adamw import AdamW
    from scratchlm.parallel.config import ParallelConfig
    from scratchlm.parallel.engine import init_engine

    torch.manual_seed(0)
    engine = init_engine(ParallelConfig(strategy=strategy, backend="gloo"))
    plain = TransformerLM(**shape)
    num_params = sum(p.numel() for p in plain.parameters())
    model = engine.wrap_model(plain)
    opt = engine.build_optimizer(model, AdamW, lr=1e-4, foreach=False)
    x, y = _batch(shape, batch, rank, 0)
    _loss(model, x, y).backward()
    engine.sync_gradients(model)
    opt.step()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    state_source = getattr(opt, "local_optimizer", opt).state
    state = [v for s in state_source.values() for v in s.values()]
    rss, peak = _rss_mb()
    return {"num_params": num_params, "params": _nbytes(params), "grads": _nbytes(grads),
            "optimizer_state": _nbytes(state), "rss_mb": rss, "peak_rss_mb": peak}


def comm_worker(rank: int, world: int, shape: dict, batch: int, steps: int, variants: list[str]) -> dict:
    from scratchlm.model.transformer import TransformerLM
    from scratchlm.parallel.ddp import DDP, FlatDDP, NaiveDDP

    torch.manual_seed(0)
    model = TransformerLM(**shape)
    results = {}
    for variant in variants:
        if variant.startswith("none"):
            wrapped, finish = model, (lambda: None)
        elif variant == "torch_ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model, bucket_cap_mb=25)
            finish = lambda: None  # noqa: E731 - torch DDP waits inside backward
        else:
            if variant == "naive_ddp":
                wrapped = NaiveDDP(model)
            elif variant == "flat_ddp":
                wrapped = FlatDDP(model)
            elif variant == "ddp":
                wrapped = DDP(model)
            else:
                wrapped = DDP(model, bucket_size_mb=float(variant.split("_")[1]))
            finish = wrapped.finish_gradient_synchronization
        step_times, finish_times = [], []
        for step in range(steps + 1):  # the first step warms up and is not counted
            x, y = _batch(shape, batch, rank, step)
            for p in model.parameters():
                p.grad = None
            torch.distributed.barrier()
            t0 = time.perf_counter()
            _loss(wrapped, x, y).backward()
            t1 = time.perf_counter()
            finish()
            t2 = time.perf_counter()
            if step:
                step_times.append(t2 - t0)
                finish_times.append(t2 - t1)
        if hasattr(wrapped, "remove_hooks"):
            wrapped.remove_hooks()
        results[variant] = {"step_s": step_times, "finish_s": finish_times}
        del wrapped
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-small")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-comm", action="store_true")
    parser.add_argument("--out", default="docs/benchmarks/distributed.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    from scratchlm.parallel.launch import spawn

    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two ranks on a small CPU: one thread each
    shape = SHAPES[args.shape]
    world = 2
    report = {"shape": args.shape, "model": shape, "batch_per_rank": args.batch, "world_size": world,
              "torch": torch.__version__, "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
              "memory": {}, "comm": {}}

    if not args.skip_memory:
        print(f"memory per rank, {args.shape}, {world} gloo ranks, after one AdamW step (MiB)")
        print(f"{'strategy':<12} {'params':>9} {'grads':>9} {'optim':>9} {'formula p/g/o':>22} "
              f"{'RSS':>8} {'peak RSS':>9} {'vs ddp':>7}")
        for strategy in MEMORY_STRATEGIES:
            r0, r1 = spawn(memory_worker, world, args=(shape, args.batch, strategy), timeout_s=1200)
            P = r0["num_params"] * 4
            formula = {"ddp": (P, P, 2 * P), "torch_ddp": (P, P, 2 * P), "zero1": (P, P, 2 * P / world),
                       "fsdp": (P / world, P / world, 2 * P / world),
                       "torch_fsdp2": (P / world, P / world, 2 * P / world)}[strategy]
            report["memory"][strategy] = {"rank0": r0, "rank1": r1, "formula_bytes": formula}
        base = report["memory"].get("ddp")
        for strategy, m in report["memory"].items():
            r0 = m["rank0"]
            total = r0["params"] + r0["grads"] + r0["optimizer_state"]
            ratio = total / (base["rank0"]["params"] + base["rank0"]["grads"] + base["rank0"]["optimizer_state"])
            f = "/".join(f"{b / 2**20:.0f}" for b in m["formula_bytes"])
            print(f"{strategy:<12} {r0['params'] / 2**20:9.1f} {r0['grads'] / 2**20:9.1f} "
                  f"{r0['optimizer_state'] / 2**20:9.1f} {f:>22} {r0['rss_mb']:8.0f} {r0['peak_rss_mb']:9.0f} "
                  f"{ratio:7.2f}")

    if not args.skip_comm:
        per_rank = spawn(comm_worker, world, args=(shape, args.batch, args.steps, COMM_VARIANTS), timeout_s=3000)
        grad_mb = sum(p.numel() for p in __import__("scratchlm.model.transformer", fromlist=["x"])
                      .TransformerLM(**shape).parameters()) * 4 / 2**20
        print(f"\nstep time, {args.shape} ({grad_mb:.0f} MiB of fp32 gradients), {world} gloo ranks, "
              f"batch {args.batch}x{shape['context_length']} per rank, median of {args.steps} steps (s)")
        print(f"{'variant':<12} {'step':>8} {'exposed comm':>13} {'overhead':>9} {'vs naive':>9}")
        medians = {}
        for variant in COMM_VARIANTS:
            # A step lasts as long as its slowest rank.
            step = [max(a, b) for a, b in zip(per_rank[0][variant]["step_s"], per_rank[1][variant]["step_s"])]
            fin = [max(a, b) for a, b in zip(per_rank[0][variant]["finish_s"], per_rank[1][variant]["finish_s"])]
            medians[variant] = (statistics.median(step), statistics.median(fin))
            report["comm"][variant] = {"step_s": step, "finish_s": fin, "median_step_s": medians[variant][0],
                                       "median_exposed_comm_s": medians[variant][1]}
        floor = min(medians["none"][0], medians["none_again"][0])
        for variant, (step, fin) in medians.items():
            print(f"{variant:<12} {step:8.3f} {fin:13.3f} {step - floor:9.3f} {medians['naive_ddp'][0] / step:9.2f}")
    out = Path(args.out)
    if out.is_file():  # a partial run keeps the other part of an earlier report
        earlier = json.loads(out.read_text())
        for part, skipped in (("memory", args.skip_memory), ("comm", args.skip_comm)):
            if skipped and earlier.get("shape") == args.shape:
                report[part] = earlier.get(part, {})
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
