"""Where a training step's GPU time goes: scratchlm's step vs the torch.nn reference, by kernel class.

    python benchmarks/step_breakdown.py [--shape gpt2small] [--variant cudagraphs] [--rows 30]
        [--json out.json]

Builds the two steps of `train_step.py` (`scratchlm.bench.training_step`) at one of its shapes:
the reference that compiles its model and loss together (its faster form) and one scratchlm
variant of `VARIANTS` (default "cudagraphs": fused LM head, Triton AdamW, CUDA graphs). Each is
timed (median of synchronised steps and back to back, as in `train_step.py`), then profiled over two steps:
milliseconds per step of each kernel class (`scratchlm.bench.profile.KERNEL_CLASSES`: matmul,
attention, loss, optimizer, Inductor's fused kernels, other) side by side, and each step's
largest kernels. The profiler adds some time to every kernel, so its totals run a few percent
above the timed step; compare the two sides within one run.
"""

from __future__ import annotations

import argparse
import sys

import torch

from scratchlm.bench.profile import kernel_breakdown, kernel_times
from scratchlm.bench.results import write_json
from scratchlm.bench.training_step import (SHAPES, VARIANTS, make_reference, make_scratchlm, measure_step,
                                           reference_flops_per_token)


def measure(name: str, make, shape: dict, rows: int) -> dict:
    """`measure_step`'s row for the step, plus its kernels over two profiled steps."""

    def profile(step, row):
        times = kernel_times(step, steps=2)
        for kernel, (ms, launches) in sorted(times.items(), key=lambda kv: -kv[1][0])[:rows]:
            print(f"  {ms:8.3f} ms {launches:5.0f}x  {kernel[:120]}")
        row.update(classes_ms=kernel_breakdown(times), kernels={k: list(v) for k, v in times.items()})

    torch._dynamo.reset()
    return measure_step(name, make, shape, 3, 10, reference_flops_per_token(shape), after=profile)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=[k for k in SHAPES if k != "longctx"], default="gpt2small")
    p.add_argument("--variant", choices=list(VARIANTS), default="cudagraphs")
    p.add_argument("--rows", type=int, default=30, help="largest kernels listed per step")
    p.add_argument("--json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("step_breakdown needs a CUDA device", file=sys.stderr)
        return 2
    shape = SHAPES[args.shape]
    label, kwargs = VARIANTS[args.variant]
    holder: dict = {}
    results = [measure("torch.nn reference, model + loss compiled", make_reference(shape, holder, True),
                       shape, args.rows)]
    holder.clear()
    results.append(measure(label, make_scratchlm(shape, holder, **kwargs), shape, args.rows))
    holder.clear()
    if any("error" in r for r in results):
        return 1
    ref, ours = (r["classes_ms"] for r in results)
    print(f"\n{args.shape}: ms per step by kernel class (profiled)")
    print(f"  {'class':<12}{'reference':>11}{'scratchlm':>11}{'difference':>12}")
    for cls in [c for c in dict.fromkeys([*ref, *ours]) if c != "total"] + ["total"]:
        a, b = ref.get(cls, 0.0), ours.get(cls, 0.0)
        print(f"  {cls:<12}{a:11.2f}{b:11.2f}{b - a:+12.2f}")
    ratio = results[0]["median_s"] / results[1]["median_s"]
    print(f"  speed ratio, scratchlm vs reference: {ratio:.3f}x synchronised, "
          f"{results[0]['back_to_back_s'] / results[1]['back_to_back_s']:.3f}x back to back")
    if args.json:
        write_json(args.json, {"shape": args.shape, **shape, "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
