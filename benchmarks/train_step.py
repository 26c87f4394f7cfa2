"""A full training step of scratchlm vs a torch.nn reference of the same Llama-shaped model.

    python benchmarks/train_step.py [--shapes gpt2small tinystories longctx] [--variants ...]
        [--json out.json] [--profile ROWS]

scratchlm: `build_model` (attention_backend "flash_triton"), bf16 autocast, torch.compile, in the
variants of VARIANTS (`--variants`, default all): scratchlm's AdamW (multi-tensor path), torch's
fused AdamW, scratchlm's Triton AdamW; then the fastest configuration, the compiled trunk
(`head_inputs`: `hidden_states` in the autocast dtype) with the fused LM head + loss
(`fused_linear_cross_entropy`, no float32 logits) and the Triton AdamW, with and without CUDA
graphs (mode="reduce-overhead"); model and loss compiled together; and the CUDA-graph
configuration with q/k/v and w1/w3 as separate forward matmuls (`model.fused_projections=False`),
and with q/k/v's backward as three matmuls each way (`model.packed_qkv_backward=False`).
Reference: nn.Embedding / nn.RMSNorm / nn.Linear, F.scaled_dot_product_attention (causal),
SwiGLU, rotary embeddings, fused torch.optim.AdamW, bf16 autocast, torch.compile, and
F.cross_entropy on float32 logits. MFU counts 6 FLOPs per matrix weight per token plus causal
attention (the formula of scratchlm.bench.commands.model_flops_per_token), against the
datasheet 989 TFLOP/s and the measured 753 TFLOP/s bf16 matmul rate of the H200. Each variant
is timed twice: step by step, synchronising around every step (median; this includes each
step's launch latency before its first kernel), and back to back as a training loop runs
(`_back_to_back`); tokens/s and ratios are given for both. Memory is
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
import json
import sys

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from scratchlm.bench.run import model_flops_per_token
from scratchlm.bench.harness import H200_BF16_DENSE_PEAK, H200_BF16_MEASURED_MATMUL, benchmark

SHAPES = {
    # d_ff 2048 = 8/3 * 768: the SwiGLU width that keeps GPT-2 small's FFN parameter count.
    "gpt2small": dict(vocab_size=32_000, context_length=1024, d_model=768, num_layers=12, num_heads=12,
                      d_ff=2048, batch=32),
    "tinystories": dict(vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16,
                        d_ff=1344, batch=256),
    "longctx": dict(vocab_size=151_936, context_length=32_768, d_model=2560, num_layers=24, num_heads=20,
                    d_ff=6912, batch=1),
}


class RefBlock(nn.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int):
        super().__init__()
        self.num_heads = num_heads
        self.ln1, self.ln2 = nn.RMSNorm(d_model, eps=1e-5), nn.RMSNorm(d_model, eps=1e-5)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.num_heads, D // self.num_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(B, T, D))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _rotate(x, cos, sin):  # rotate-half RoPE; x: (B, H, T, d)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RefLM(nn.Module):
    def __init__(self, vocab_size, context_length, d_model, num_layers, num_heads, d_ff):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(RefBlock(d_model, num_heads, d_ff) for _ in range(num_layers))
        self.norm = nn.RMSNorm(d_model, eps=1e-5)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        d = d_model // num_heads
        inv = 10_000.0 ** (-torch.arange(0, d, 2).float() / d)
        ang = torch.arange(context_length).float()[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    checkpoint_every = 0  # torch.utils.checkpoint around every k-th block (the long-context step)

    def forward(self, ids):
        T = ids.shape[1]
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            if self.checkpoint_every and i % self.checkpoint_every == 0:
                x = torch.utils.checkpoint.checkpoint(layer, x, self.cos[:T], self.sin[:T], use_reentrant=False)
            else:
                x = layer(x, self.cos[:T], self.sin[:T])
        return self.lm_head(self.norm(x))


def _ref_flops_model(shape):
    # model_flops_per_token reads token_embeddings/layers/d_model: give it an equivalent view
    with torch.device("meta"):
        m = RefLM(**{k: v for k, v in shape.items() if k != "batch"})
    m.token_embeddings = m.embed
    return m


def _step_fn(model, optimizer, x, y, loss_fn):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _plain_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _fused_loss(model, x, y):
    from scratchlm.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

    return fused_linear_cross_entropy(model.head_inputs(x), model.lm_head.weight, y)


def _scratchlm_model(shape, backend="flash_triton", fused_projections=True, packed_qkv_backward=True):
    from scratchlm.model.config import ModelConfig
    from scratchlm.model.transformer import build_model

    cfg = ModelConfig(**{k: v for k, v in shape.items() if k != "batch"}, attention_backend=backend,
                      fused_projections=fused_projections, packed_qkv_backward=packed_qkv_backward)
    return build_model(cfg, device="cuda")


def make_reference(shape: dict, holder: dict, compile_loss: bool):
    """`make(x, y) -> step` of the torch.nn reference: its model compiled, and with `compile_loss`
    the float32 upcast and cross-entropy compiled with it (nanoGPT-style). The model is kept in
    `holder["m"]` (the caller drops it to free the memory)."""
    def make(x, y):
        torch.manual_seed(0)
        m = RefLM(**{k: v for k, v in shape.items() if k != "batch"}).cuda()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        holder["m"] = m
        if compile_loss:
            return _step_fn(m, opt, x, y, torch.compile(_plain_loss))
        return _step_fn(torch.compile(m), opt, x, y, _plain_loss)
    return make


def make_scratchlm(shape: dict, holder: dict, optimizer: str, fused_head: bool = False, mode: str = "default",
                   compile_loss: bool = False, fused_projections: bool = True, packed_qkv_backward: bool = True):
    """`make(x, y) -> step` of scratchlm's compiled step in one VARIANTS configuration; the model
    is kept in `holder["m"]`."""
    from scratchlm.optim.adamw import AdamW

    def make(x, y):
        torch.manual_seed(0)
        m = holder["m"] = _scratchlm_model(shape, fused_projections=fused_projections,
                                           packed_qkv_backward=packed_qkv_backward)
        opt = (torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) if optimizer == "torch_fused"
               else AdamW(m.parameters(), lr=1e-4, foreach=True, fused=optimizer == "triton"))
        if fused_head:  # compiled trunk; the chunked head's loop stays eager (its chunk math compiles)
            from scratchlm.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

            trunk = torch.compile(m.head_inputs, mode=mode)
            step = _step_fn(m, opt, x, y, lambda _m, a, b: fused_linear_cross_entropy(
                trunk(a), m.lm_head.weight, b))
        elif compile_loss:
            step = _step_fn(m, opt, x, y, torch.compile(_plain_loss, mode=mode))
        else:
            step = _step_fn(torch.compile(m, mode=mode), opt, x, y, _plain_loss)
        if mode != "reduce-overhead":
            return step

        def graphed_step():
            torch.compiler.cudagraph_mark_step_begin()
            step()
        return graphed_step
    return make


PROFILE_ROWS = 0  # --profile: a kernel table of each variant after its timing
ON_ROW = None  # called with each measured row (main writes the JSON so far: a timed-out run keeps its rows)


def _back_to_back(step, steps: int, repeats: int = 3) -> float:
    """Seconds per step of `steps` steps run back to back, as a training loop runs them (the host
    queues the next step while the GPU works; one synchronisation at the end), the median of
    `repeats` such runs. `benchmark` instead synchronises around every step, which adds each
    step's launch latency before its first kernel."""
    per_step = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        per_step.append(start.elapsed_time(end) / 1e3 / steps)
    return sorted(per_step)[len(per_step) // 2]


def _measure(name, make, shape, warmup, steps, flops_token, after=None, b2b_repeats=3):
    """Time the step `make(x, y)` builds (synchronised steps and back to back) into one row;
    `after(step, row)`, if given, then adds to the row (step_breakdown.py profiles the step)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    B, T = shape["batch"], shape["context_length"]
    x = torch.randint(0, shape["vocab_size"], (B, T), device="cuda")
    y = torch.randint(0, shape["vocab_size"], (B, T), device="cuda")
    try:
        step = make(x, y)
        r = benchmark(step, warmup=warmup, steps=steps)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        print(f"  {name:<42} out of memory", flush=True)
        return {"variant": name, "error": "out of memory"}
    back_to_back = _back_to_back(step, steps, b2b_repeats)
    tokens_s = B * T / r.median
    achieved = 3 * flops_token * tokens_s
    row = {"variant": name, "median_s": r.median, "mean_s": r.mean, "std_s": r.std, "tokens_per_s": tokens_s,
           "back_to_back_s": back_to_back, "tokens_per_s_back_to_back": B * T / back_to_back,
           "tflops": achieved / 1e12, "mfu_989": achieved / H200_BF16_DENSE_PEAK,
           "mfu_753": achieved / H200_BF16_MEASURED_MATMUL, "peak_gib": r.peak_memory_bytes / 2**30,
           # the allocator's reserved memory counts CUDA graphs' private pools, which "allocated" does not
           "reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    print(f"  {name:<42}{r.median * 1e3:9.1f} ms{tokens_s:12.0f} tok/s{achieved / 1e12:8.1f} TFLOP/s"
          f"{100 * row['mfu_989']:6.1f}% /989{100 * row['mfu_753']:6.1f}% /753{row['peak_gib']:8.1f} GiB"
          f" ({row['reserved_gib']:.1f} reserved); back-to-back {back_to_back * 1e3:.1f} ms/step,"
          f" {B * T / back_to_back:.0f} tok/s", flush=True)
    if PROFILE_ROWS:
        from scratchlm.bench.profile import profile_table

        print(profile_table(step, 2, row_limit=PROFILE_ROWS), flush=True)
    if after is not None:
        after(step, row)
    if ON_ROW is not None:
        ON_ROW(row)
    return row


def _compare(ref: dict, rows: list[dict], suffix: str = "_vs_reference") -> None:
    """Add each measured row's speed and memory ratios to the reference row `ref`, and print them."""
    for r in rows:
        if "tokens_per_s" in r and "tokens_per_s" in ref:
            speed = r["ratio" + suffix] = r["tokens_per_s"] / ref["tokens_per_s"]
            peak = r["peak_memory" + suffix] = r["peak_gib"] / ref["peak_gib"]
            reserved = r["reserved" + suffix] = r["reserved_gib"] / ref["reserved_gib"]
            b2b = r["ratio_back_to_back" + suffix] = r["tokens_per_s_back_to_back"] / ref["tokens_per_s_back_to_back"]
            print(f"  ratio {r['variant']} vs {ref['variant']}: {speed:.3f}x speed (synchronised steps), "
                  f"{b2b:.3f}x back-to-back, {peak:.2f}x peak allocated, {reserved:.2f}x reserved memory", flush=True)


def run_shape(key, warmup, steps, variants=("foreach", "torch_fused"), checkpoint_every=(1,)):
    shape = SHAPES[key]
    flops_token = model_flops_per_token(_ref_flops_model(shape), shape["context_length"])
    print(f"{key}: {shape}, forward FLOPs/token {flops_token / 1e6:.0f}M", flush=True)
    if key == "longctx":
        return run_longctx(shape, warmup, steps, flops_token, checkpoint_every)
    holder = {}

    # Two references: the model compiled and the loss eager (the reference of the earlier runs),
    # and model + loss compiled together; ratios are given against both, and the faster one is
    # the bar (the best plain-PyTorch setup).
    ref = _measure("torch.nn reference (SDPA, fused AdamW)", make_reference(shape, holder, False), shape,
                   warmup, steps, flops_token)
    holder.pop("m", None)
    torch._dynamo.reset()  # each variant compiles afresh (the loss function is shared between them)
    ref_cl = _measure("torch.nn reference, loss compiled too", make_reference(shape, holder, True), shape,
                      warmup, steps, flops_token)
    holder.pop("m", None)
    rows = [ref, ref_cl]
    for name in variants:
        label, kwargs = VARIANTS[name]
        torch._dynamo.reset()
        rows.append(_measure(label, make_scratchlm(shape, holder, **kwargs), shape, warmup, steps, flops_token))
        holder.clear()
    _compare(ref, rows[1:])
    best = max((r for r in (ref, ref_cl) if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"], default=ref)
    if best is not ref:
        _compare(best, rows[2:], suffix="_vs_best_reference")
    return {"shape": key, **shape, "rows": rows}


def run_longctx(shape, warmup, steps, flops_token, checkpoint_every=(1,)):
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
            m = holder["m"] = _scratchlm_model(shape)
            apply_activation_checkpointing(m, every=every)
            opt = AdamW(m.parameters(), lr=1e-4, foreach=True, fused=True)
            return _step_fn(m, opt, x, y, _fused_loss if fused_head else _plain_loss)
        return make

    def reference_step(every):
        def make(x, y):
            torch.manual_seed(0)
            with torch.device("cuda"):  # 2.7B parameters: initialised on the GPU, not on the host
                m = holder["m"] = RefLM(**{k: v for k, v in shape.items() if k != "batch"})
            m.checkpoint_every = every
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
            return _step_fn(m, opt, x, y, _plain_loss)
        return make

    def label(every):
        return {0: "no checkpointing", 1: "checkpointing every block"}.get(every, f"checkpointing 1 block in {every}")

    def measure(name, make):
        row = _measure(name, make, shape, warmup, steps, flops_token, b2b_repeats=1)
        holder.clear()
        return row

    refs = [dict(measure(f"torch.nn, {label(k)}, full logits (eager)", reference_step(k)), checkpoint_every=k)
            for k in checkpoint_every]
    ours = [dict(measure(f"scratchlm, {label(k)}, fused head (eager)", scratchlm_step(k)), checkpoint_every=k)
            for k in checkpoint_every]
    plain = measure("scratchlm plain path, no checkpointing, full logits (eager)", scratchlm_step(0, False))
    fits = lambda rows: [r for r in rows if "tokens_per_s" in r]  # noqa: E731
    out = {"shape": "longctx", **shape, "rows": [*refs, *ours, plain]}
    if fits(refs):
        first = fits(refs)[0]
        _compare(first, [r for r in out["rows"] if r is not first])
        best_ref = max(fits(refs), key=lambda r: r["tokens_per_s"])
        if fits(ours):
            best = max(fits(ours), key=lambda r: r["tokens_per_s"])
            _compare(best_ref, [best], suffix="_vs_best_reference")
            out["best"] = {"reference": best_ref["variant"], "scratchlm": best["variant"]}
    return out


# scratchlm's variants of the compiled step (flash_triton attention throughout), by --variants name
VARIANTS = {
    "foreach": ("scratchlm (flash_triton, scratchlm AdamW)", dict(optimizer="scratchlm")),
    "torch_fused": ("scratchlm (flash_triton, torch fused AdamW)", dict(optimizer="torch_fused")),
    "triton_adamw": ("scratchlm (flash_triton, Triton AdamW)", dict(optimizer="triton")),
    "fused_head": ("scratchlm (+ fused LM head, Triton AdamW)", dict(optimizer="triton", fused_head=True)),
    "cudagraphs": ("scratchlm (+ fused head, Triton AdamW, CUDA graphs)",
                   dict(optimizer="triton", fused_head=True, mode="reduce-overhead")),
    "compiled_loss": ("scratchlm (model + loss compiled, Triton AdamW)", dict(optimizer="triton", compile_loss=True)),
    "compiled_loss_cudagraphs": ("scratchlm (model + loss compiled, Triton AdamW, CUDA graphs)",
                                 dict(optimizer="triton", compile_loss=True, mode="reduce-overhead")),
    # "cudagraphs" with q/k/v and w1/w3 as separate forward matmuls (model.fused_projections=False)
    "cudagraphs_separate_proj": ("scratchlm (cudagraphs variant, separate q/k/v, w1/w3)",
                                 dict(optimizer="triton", fused_head=True, mode="reduce-overhead",
                                      fused_projections=False)),
    # "cudagraphs" with q/k/v's backward as three matmuls each way (model.packed_qkv_backward=False)
    "cudagraphs_unpacked_qkv": ("scratchlm (cudagraphs variant, q/k/v backward per projection)",
                                dict(optimizer="triton", fused_head=True, mode="reduce-overhead",
                                     packed_qkv_backward=False)),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["gpt2small", "tinystories"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="scratchlm variants to time against the reference (gpt2small and tinystories)")
    p.add_argument("--checkpoint-every", type=int, nargs="+", default=[1, 2, 0], metavar="K",
                   help="longctx: the activation-checkpointing densities to time on both sides (every K-th block; 0: none)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="after each variant, print its ROWS most expensive ops over 2 steps (torch.profiler)")
    args = p.parse_args(argv)
    global PROFILE_ROWS, ON_ROW
    PROFILE_ROWS = args.profile
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = True
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": []}

    def save(row=None):
        if row is not None:
            out.setdefault("rows_of_unfinished_shape", []).append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    ON_ROW = save
    for key in args.shapes:
        warm, steps = (1, 3) if key == "longctx" else (args.warmup, args.steps)
        out["shapes"].append(run_shape(key, warm, steps, args.variants, args.checkpoint_every))
        out.pop("rows_of_unfinished_shape", None)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
