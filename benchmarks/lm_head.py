"""Fused chunked linear + cross-entropy vs the plain LM head (full logits + F.cross_entropy).

    python benchmarks/lm_head.py [--json out.json]

Forward + backward of the loss w.r.t. hidden states and the head weight, bf16 hidden states
and weight (as under autocast), on the shapes of the train-step benchmarks. "plain" runs eagerly,
"compiled" is the same function under torch.compile (as in the train-step reference), "fused" is
scratchlm's chunked head (its per-chunk loss and softmax gradient in the Triton kernel of
`cross_entropy_triton`), "fused/compiled" the same head with that chunk math compiled instead.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from scratchlm.bench.harness import benchmark
from scratchlm.bench.results import environment, write_json
from scratchlm.kernels import fused_linear_cross_entropy as flce
from scratchlm.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

SHAPES = [  # (tokens, d_model, vocab)
    (32 * 1024, 768, 32_000),
    (256 * 256, 512, 10_000),
    (32_768, 2560, 151_936),
]


def _plain(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


def _fused_compiled_chunks(h, w, t):
    flce._use_triton_rows = False
    try:
        return fused_linear_cross_entropy(h, w, t)
    finally:
        flce._use_triton_rows = True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json")
    p.add_argument("--steps", type=int, default=10)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    rows = []
    print(f"{'tokens':>8}{'d':>6}{'vocab':>8}{'impl':>15}{'ms':>9}{'peak GiB':>10}{'extra GiB':>10}{'rel err':>9}")
    for n, d, vocab in SHAPES:
        h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(vocab, d, device="cuda") / d ** 0.5).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, vocab, (n,), device="cuda")
        base = torch.cuda.memory_allocated()
        results = {}
        compiled = torch.compile(_plain, dynamic=False)  # what the train-step reference runs
        for name, fn in (("plain", _plain), ("compiled", compiled), ("fused", fused_linear_cross_entropy),
                         ("fused/compiled", _fused_compiled_chunks)):
            def step():
                loss = fn(h, w, t)
                torch.autograd.grad(loss, (h, w))
            try:
                r = benchmark(step, warmup=2, steps=args.steps)
                loss = fn(h, w, t)
                results[name] = {"ms": r.mean * 1e3, "std_ms": r.std * 1e3, "peak_gib": r.peak_memory_bytes / 2**30,
                                 "extra_gib": (r.peak_memory_bytes - base) / 2**30, "loss": loss.item()}
            except torch.cuda.OutOfMemoryError:
                results[name] = {"error": "out of memory"}
            torch.cuda.empty_cache()
        ref = results.get("plain", {}).get("loss")
        for name, r in results.items():
            err = abs(r["loss"] - ref) / abs(ref) if ref and "loss" in r else float("nan")
            if "ms" in r:
                print(f"{n:>8}{d:>6}{vocab:>8}{name:>15}{r['ms']:>9.2f}{r['peak_gib']:>10.2f}{r['extra_gib']:>10.2f}{err:>9.1e}")
            else:
                print(f"{n:>8}{d:>6}{vocab:>8}{name:>15}   {r['error']}")
        rows.append({"tokens": n, "d_model": d, "vocab": vocab, **results})
        del h, w, t
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, {**environment(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
