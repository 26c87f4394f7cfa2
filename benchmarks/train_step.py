"""A full training step of scratchlm vs a torch.nn reference of the same Llama-shaped model.

    python benchmarks/train_step.py [--shapes gpt2small gpt2medium tinystories longctx] [--variants ...]
        [--json out.json] [--profile ROWS] [--no-references]

scratchlm: `build_model` (attention_backend "flash_triton"), bf16 autocast, torch.compile, in the
variants of `scratchlm.bench.training_step.VARIANTS` (`--variants`, default all): scratchlm's AdamW (multi-tensor path), torch's
fused AdamW, scratchlm's Triton AdamW; then the fastest configuration, the compiled trunk
(`head_inputs`: `hidden_states` in the autocast dtype) with the fused LM head + loss
(`fused_linear_cross_entropy`, no float32 logits) and the Triton AdamW, with and without CUDA
graphs (mode="reduce-overhead"); model and loss compiled together; and the CUDA-graph
configuration with q/k/v and w1/w3 as separate forward matmuls (`model.fused_projections=False`),
and with q/k/v's backward as three matmuls each way (`model.packed_qkv_backward=False`).
Reference (`scratchlm.bench.reference_model.ReferenceLM`): nn.Embedding / nn.RMSNorm / nn.Linear, F.scaled_dot_product_attention (causal),
SwiGLU, rotate-half rotary embeddings, fused torch.optim.AdamW, bf16 autocast, torch.compile, and
F.cross_entropy on float32 logits. MFU counts 6 FLOPs per matrix weight per token plus causal
attention (`scratchlm.bench.training_step.reference_flops_per_token`), against the
datasheet 989 TFLOP/s and the measured 753 TFLOP/s bf16 matmul rate of the H200. Each variant
is timed twice: step by step, synchronising around every step (median; this includes each
step's launch latency before its first kernel), and back to back as a training loop runs
(`scratchlm.bench.timing.back_to_back`); tokens/s and ratios are given for both. Memory is
the peak allocated over the timed steps and the allocator's peak reserved memory (which
counts CUDA graphs' private pools; "allocated" does not).

The long-context shape (vocab 151,936, context 32,768, batch 1) runs eagerly (`run_longctx`):
scratchlm with the fused LM head and the Triton AdamW, against the torch.nn reference with full
logits (the plain-PyTorch way), each with activation checkpointing on every block, on one block
in K, or none (`--checkpoint-every`); a density that does not fit in memory is reported as such,
and each side's fastest row that fits is compared. `--profile ROWS` prints each variant's top ops.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from scratchlm.bench.results import environment, write_json
from scratchlm.bench.training_step import (SHAPES, VARIANTS, compare_rows, fused_loss, make_reference,
                                           make_scratchlm, measure_step, plain_loss, reference_flops_per_token,
                                           reference_model, scratchlm_model, step_fn)


def run_shape(key, warmup, steps, variants=("foreach", "torch_fused"), checkpoint_every=(1,), *, measure=measure_step,
              references=True):
    """Both references and each of `variants` at the shape `key` (longctx: `run_longctx`).
    ``measure``: `measure_step` with the caller's profiling and saving options bound.
    ``references=False``: the variants only, each compared with the first (e.g. FP8 against
    bf16 when the time for the two torch.nn references is not at hand)."""
    shape = SHAPES[key]
    flops_token = reference_flops_per_token(shape)
    print(f"{key}: {shape}, forward FLOPs/token {flops_token / 1e6:.0f}M", flush=True)
    if key == "longctx":
        return run_longctx(shape, warmup, steps, flops_token, checkpoint_every, measure=measure)
    holder = {}

    def measure_variants():
        rows = []
        for name in variants:
            label, kwargs = VARIANTS[name]
            torch._dynamo.reset()
            rows.append(measure(label, make_scratchlm(shape, holder, **kwargs), shape, warmup, steps, flops_token))
            holder.clear()
        return rows

    if not references:
        rows = measure_variants()
        compare_rows(rows[0], rows[1:], suffix="_vs_first_variant")
        return {"shape": key, **shape, "rows": rows}

    # Two references: the model compiled and the loss eager (the reference of the earlier runs),
    # and model + loss compiled together; ratios are given against both, and the faster one is
    # the bar (the best plain-PyTorch setup).
    ref = measure("torch.nn reference (SDPA, fused AdamW)", make_reference(shape, holder, False), shape,
                  warmup, steps, flops_token)
    holder.pop("m", None)
    torch._dynamo.reset()  # each variant compiles afresh (the loss function is shared between them)
    ref_cl = measure("torch.nn reference, loss compiled too", make_reference(shape, holder, True), shape,
                     warmup, steps, flops_token)
    holder.pop("m", None)
    rows = [ref, ref_cl, *measure_variants()]
    compare_rows(ref, rows[1:])
    best = max((r for r in (ref, ref_cl) if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"], default=ref)
    if best is not ref:
        compare_rows(best, rows[2:], suffix="_vs_best_reference")
    return {"shape": key, **shape, "rows": rows}


def run_longctx(shape, warmup, steps, flops_token, checkpoint_every=(1,), *, measure=measure_step):
    """The long-context step, eager, at each density of activation checkpointing in
    `checkpoint_every` (k: every k-th block; 0: none) for both sides: the torch.nn reference
    (full float32 logits, fused torch AdamW, cuDNN SDPA) and scratchlm (fused LM head, Triton
    AdamW, flash_triton); plus scratchlm's plain path (full logits, no checkpointing). A density
    that does not fit is reported as out of memory; each side's fastest row that fits is its
    best configuration, and the ratio of the two bests is the headline."""
    from scratchlm.optim.adamw import AdamW
    from scratchlm.train.activation_checkpoint import apply_activation_checkpointing

    holder = {}

    def scratchlm_step(every, fused_head=True):
        def make(x, y):
            torch.manual_seed(0)
            m = holder["m"] = scratchlm_model(shape)
            apply_activation_checkpointing(m, every=every)
            opt = AdamW(m.parameters(), lr=1e-4, foreach=True, fused=True)
            return step_fn(m, opt, x, y, fused_loss if fused_head else plain_loss)
        return make

    def reference_step(every):
        def make(x, y):
            torch.manual_seed(0)
            with torch.device("cuda"):  # 2.7B parameters: initialised on the GPU, not on the host
                m = holder["m"] = reference_model(shape, checkpoint_every=every)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
            return step_fn(m, opt, x, y, plain_loss)
        return make

    def label(every):
        return {0: "no checkpointing", 1: "checkpointing every block"}.get(every, f"checkpointing 1 block in {every}")

    def measure_once(name, make):
        row = measure(name, make, shape, warmup, steps, flops_token, b2b_repeats=1)
        holder.clear()
        return row

    refs = [dict(measure_once(f"torch.nn, {label(k)}, full logits (eager)", reference_step(k)), checkpoint_every=k)
            for k in checkpoint_every]
    ours = [dict(measure_once(f"scratchlm, {label(k)}, fused head (eager)", scratchlm_step(k)), checkpoint_every=k)
            for k in checkpoint_every]
    plain = measure_once("scratchlm plain path, no checkpointing, full logits (eager)", scratchlm_step(0, False))
    fits = lambda rows: [r for r in rows if "tokens_per_s" in r]  # noqa: E731
    out = {"shape": "longctx", **shape, "rows": [*refs, *ours, plain]}
    if fits(refs):
        first = fits(refs)[0]
        compare_rows(first, [r for r in out["rows"] if r is not first])
        best_ref = max(fits(refs), key=lambda r: r["tokens_per_s"])
        if fits(ours):
            best = max(fits(ours), key=lambda r: r["tokens_per_s"])
            compare_rows(best_ref, [best], suffix="_vs_best_reference")
            out["best"] = {"reference": best_ref["variant"], "scratchlm": best["variant"]}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["gpt2small", "tinystories"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="scratchlm variants to time against the reference (gpt2small and tinystories)")
    p.add_argument("--no-references", dest="references", action="store_false",
                   help="time the --variants only, each against the first (gpt2small and tinystories)")
    p.add_argument("--checkpoint-every", type=int, nargs="+", default=[1, 2, 0], metavar="K",
                   help="longctx: the activation-checkpointing densities to time on both sides (every K-th block; 0: none)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="after each variant, print its ROWS most expensive ops over 2 steps (torch.profiler)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = True
    out = {**environment(), "shapes": []}

    def save(row=None):
        if row is not None:
            out.setdefault("rows_of_unfinished_shape", []).append(row)
        if args.json:
            write_json(args.json, out)

    measure = functools.partial(measure_step, profile_rows=args.profile, on_row=save)
    for key in args.shapes:
        warm, steps = (1, 3) if key == "longctx" else (args.warmup, args.steps)
        out["shapes"].append(run_shape(key, warm, steps, args.variants, args.checkpoint_every, measure=measure,
                                       references=args.references))
        out.pop("rows_of_unfinished_shape", None)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
