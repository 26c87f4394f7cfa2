"""The training steps that `benchmarks/train_step.py` and `benchmarks/step_breakdown.py` time.

One step is forward, loss, backward and the optimizer step under bf16 autocast on CUDA, on random
tokens of one of `SHAPES`. Two sides build it:

- scratchlm: `build_model` with the flash_triton attention, compiled, in the configurations of
  `VARIANTS` (optimizer, fused LM head, CUDA graphs, projection options);
- the torch.nn reference (`scratchlm.bench.reference_model.ReferenceLM` with rotate-half RoPE,
  fused `torch.optim.AdamW`, `F.cross_entropy` on float32 logits), compiled either alone or
  together with its loss.

`measure_step` times a built step twice, synchronising around every step (the harness) and back
to back (`scratchlm.bench.timing.back_to_back`), and returns one result row with tokens/s,
TFLOP/s, MFU and memory; `compare_rows` adds the ratios against a reference row and prints them.
A maker is ``make(x, y) -> step``: it builds model and optimizer for the batch (x, y) and keeps
the model in a ``holder`` dict so the caller can drop it and free its memory.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from scratchlm.bench.harness import H200_BF16_DENSE_PEAK, H200_BF16_MEASURED_MATMUL, benchmark
from scratchlm.bench.reference_model import ReferenceLM
from scratchlm.bench.results import add_ratios
from scratchlm.bench.timing import back_to_back
from scratchlm.model.accounting import TRAIN_FORWARDS, model_flops_per_token

__all__ = ["SHAPES", "VARIANTS", "model_kwargs", "reference_model", "reference_flops_per_token", "step_fn",
           "plain_loss", "fused_loss", "scratchlm_model", "make_reference", "make_scratchlm", "measure_step",
           "compare_rows"]

Maker = Callable[[torch.Tensor, torch.Tensor], Callable[[], None]]

SHAPES: dict[str, dict[str, int]] = {
    # d_ff 2048 = 8/3 * 768: the SwiGLU width that keeps GPT-2 small's FFN parameter count.
    "gpt2small": dict(vocab_size=32_000, context_length=1024, d_model=768, num_layers=12, num_heads=12,
                      d_ff=2048, batch=32),
    # GPT-2 medium's width and depth; d_ff 2816 = 8/3 * 1024 rounded up to a multiple of 128.
    "gpt2medium": dict(vocab_size=32_000, context_length=1024, d_model=1024, num_layers=24, num_heads=16,
                       d_ff=2816, batch=16),
    "tinystories": dict(vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16,
                        d_ff=1344, batch=256),
    "longctx": dict(vocab_size=151_936, context_length=32_768, d_model=2560, num_layers=24, num_heads=20,
                    d_ff=6912, batch=1),
}

# scratchlm's variants of the compiled step (flash_triton attention throughout), by --variants name:
# (label, make_scratchlm options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
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
    # "cudagraphs" with the blocks' matmuls in FP8 (trainer.fp8; scratchlm.model.fp8)
    "cudagraphs_fp8": ("scratchlm (cudagraphs variant, FP8 block matmuls)",
                       dict(optimizer="triton", fused_head=True, mode="reduce-overhead", fp8=True)),
    # the same with row-wise scales and a bf16 weight gradient (trainer.fp8_recipe="rowwise")
    "cudagraphs_fp8_rowwise": ("scratchlm (cudagraphs variant, FP8 row-wise, bf16 weight gradient)",
                               dict(optimizer="triton", fused_head=True, mode="reduce-overhead", fp8="rowwise")),
    # "cudagraphs" with the residual stream in bf16 (model.low_precision_residual; numerics differ)
    "cudagraphs_bf16_residual": ("scratchlm (cudagraphs variant, bf16 residual stream)",
                                 dict(optimizer="triton", fused_head=True, mode="reduce-overhead",
                                      low_precision_residual=True)),
    # "cudagraphs" with q/k/v's backward as three matmuls each way (model.packed_qkv_backward=False)
    "cudagraphs_unpacked_qkv": ("scratchlm (cudagraphs variant, q/k/v backward per projection)",
                                dict(optimizer="triton", fused_head=True, mode="reduce-overhead",
                                     packed_qkv_backward=False)),
    # "cudagraphs" with the attention's five-matmul backward (flash_attention_triton.using_backward_dq)
    "cudagraphs_atomic_dq": ("scratchlm (cudagraphs variant, five-matmul attention backward)",
                             dict(optimizer="triton", fused_head=True, mode="reduce-overhead", atomic_dq=True)),
}


def model_kwargs(shape: dict[str, int]) -> dict[str, int]:
    """The model's arguments of a shape (everything but the batch size)."""
    return {k: v for k, v in shape.items() if k != "batch"}


def reference_model(shape: dict[str, int], *, checkpoint_every: int = 0) -> ReferenceLM:
    """The torch.nn reference of a shape, with rotate-half RoPE (on the current default device)."""
    return ReferenceLM(**model_kwargs(shape), rope_pairs="halves", checkpoint_every=checkpoint_every)


def reference_flops_per_token(shape: dict[str, int]) -> float:
    """Forward matmul FLOPs per token of the shape (`model_flops_per_token` of its reference model,
    built on the meta device)."""
    with torch.device("meta"):
        model = reference_model(shape)
    # model_flops_per_token reads scratchlm's names (token_embeddings, layers, d_model): alias them
    model.token_embeddings, model.layers = model.embed, model.blocks
    return model_flops_per_token(model, shape["context_length"])


def step_fn(model, optimizer, x: torch.Tensor, y: torch.Tensor, loss_fn) -> Callable[[], None]:
    """One training step: ``loss_fn(model, x, y)`` under bf16 autocast, backward, optimizer step."""
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def plain_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's logits, upcast to float32."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def fused_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """scratchlm's fused LM head + loss on the model's head inputs (no logits materialised)."""
    from scratchlm.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

    return fused_linear_cross_entropy(model.head_inputs(x), model.lm_head.weight, y)


def scratchlm_model(shape: dict[str, int], backend: str = "flash_triton", fused_projections: bool = True,
                    packed_qkv_backward: bool = True, low_precision_residual: bool = False):
    """scratchlm's model of a shape on CUDA."""
    from scratchlm.model.config import ModelConfig
    from scratchlm.model.transformer import build_model

    cfg = ModelConfig(**model_kwargs(shape), attention_backend=backend,
                      fused_projections=fused_projections, packed_qkv_backward=packed_qkv_backward,
                      low_precision_residual=low_precision_residual)
    return build_model(cfg, device="cuda")


def make_reference(shape: dict[str, int], holder: dict, compile_loss: bool) -> Maker:
    """The torch.nn reference's step: its model compiled, and with ``compile_loss`` the float32
    upcast and cross-entropy compiled with it (nanoGPT-style)."""
    def make(x, y):
        torch.manual_seed(0)
        m = reference_model(shape).cuda()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        holder["m"] = m
        if compile_loss:
            return step_fn(m, opt, x, y, torch.compile(plain_loss))
        return step_fn(torch.compile(m), opt, x, y, plain_loss)
    return make


def _with_atomic_dq(step: Callable[[], None]) -> Callable[[], None]:
    from scratchlm.kernels.flash_attention_triton import using_backward_dq

    def run() -> None:
        with using_backward_dq("atomic"):
            step()
    return run


def make_scratchlm(shape: dict[str, int], holder: dict, optimizer: str, fused_head: bool = False,
                   mode: str = "default", compile_loss: bool = False, fused_projections: bool = True,
                   packed_qkv_backward: bool = True, fp8: bool | str = False, atomic_dq: bool = False,
                   low_precision_residual: bool = False) -> Maker:
    """scratchlm's compiled step in one `VARIANTS` configuration. ``optimizer``: "scratchlm"
    (multi-tensor AdamW), "torch_fused" or "triton" (scratchlm's AdamW with fused=True).
    ``atomic_dq``: every call of the step (so its tracing too) runs with the attention's
    five-matmul backward, the setting restored after each."""
    from scratchlm.optim.adamw import AdamW

    def make(x, y):
        torch.manual_seed(0)
        m = holder["m"] = scratchlm_model(shape, fused_projections=fused_projections,
                                          packed_qkv_backward=packed_qkv_backward,
                                          low_precision_residual=low_precision_residual)
        if fp8:
            from scratchlm.model.fp8 import convert_to_float8

            convert_to_float8(m, recipe="tensorwise" if fp8 is True else fp8)
        opt = (torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) if optimizer == "torch_fused"
               else AdamW(m.parameters(), lr=1e-4, foreach=True, fused=optimizer == "triton"))
        if fused_head:  # compiled trunk; the chunked head's loop stays eager (its chunk math compiles)
            from scratchlm.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

            trunk = torch.compile(m.head_inputs, mode=mode)
            step = step_fn(m, opt, x, y, lambda _m, a, b: fused_linear_cross_entropy(
                trunk(a), m.lm_head.weight, b))
        elif compile_loss:
            step = step_fn(m, opt, x, y, torch.compile(plain_loss, mode=mode))
        else:
            step = step_fn(torch.compile(m, mode=mode), opt, x, y, plain_loss)
        if atomic_dq:
            step = _with_atomic_dq(step)
        if mode != "reduce-overhead":
            return step

        def graphed_step():
            torch.compiler.cudagraph_mark_step_begin()
            step()
        return graphed_step
    return make


def measure_step(name: str, make: Maker, shape: dict[str, int], warmup: int, steps: int, flops_token: float, *,
                 after: Callable[[Callable[[], None], dict], None] | None = None, b2b_repeats: int = 3,
                 profile_rows: int = 0, on_row: Callable[[dict], None] | None = None) -> dict:
    """Time the step ``make(x, y)`` builds, synchronised (median) and back to back, into one row.

    A step that runs out of memory gives ``{"variant": name, "error": "out of memory"}``.
    ``profile_rows``: print the step's most expensive ops after timing it; ``after(step, row)``
    may add to the row (step_breakdown.py profiles the step); ``on_row(row)`` is then called
    (train_step.py writes its JSON so far, so a timed-out run keeps its rows).
    """
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
    b2b = back_to_back(step, steps, b2b_repeats)
    tokens_s = B * T / r.median
    achieved = TRAIN_FORWARDS * flops_token * tokens_s
    row = {"variant": name, "median_s": r.median, "mean_s": r.mean, "std_s": r.std, "tokens_per_s": tokens_s,
           "back_to_back_s": b2b, "tokens_per_s_back_to_back": B * T / b2b,
           "tflops": achieved / 1e12, "mfu_989": achieved / H200_BF16_DENSE_PEAK,
           "mfu_753": achieved / H200_BF16_MEASURED_MATMUL, "peak_gib": r.peak_memory_bytes / 2**30,
           # the allocator's reserved memory counts CUDA graphs' private pools, which "allocated" does not
           "reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    print(f"  {name:<42}{r.median * 1e3:9.1f} ms{tokens_s:12.0f} tok/s{achieved / 1e12:8.1f} TFLOP/s"
          f"{100 * row['mfu_989']:6.1f}% /989{100 * row['mfu_753']:6.1f}% /753{row['peak_gib']:8.1f} GiB"
          f" ({row['reserved_gib']:.1f} reserved); back-to-back {b2b * 1e3:.1f} ms/step,"
          f" {B * T / b2b:.0f} tok/s", flush=True)
    if profile_rows:
        from scratchlm.bench.profile import profile_table

        print(profile_table(step, 2, row_limit=profile_rows), flush=True)
    if after is not None:
        after(step, row)
    if on_row is not None:
        on_row(row)
    return row


def compare_rows(ref: dict, rows: list[dict], suffix: str = "_vs_reference") -> None:
    """Add each measured row's speed and memory ratios to the reference row ``ref``, and print them."""
    if "tokens_per_s" not in ref:
        return
    fields = {"ratio" + suffix: "tokens_per_s", "peak_memory" + suffix: "peak_gib",
              "reserved" + suffix: "reserved_gib", "ratio_back_to_back" + suffix: "tokens_per_s_back_to_back"}
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        add_ratios([r], ref, fields)
        print(f"  ratio {r['variant']} vs {ref['variant']}: {r['ratio' + suffix]:.3f}x speed (synchronised steps), "
              f"{r['ratio_back_to_back' + suffix]:.3f}x back-to-back, {r['peak_memory' + suffix]:.2f}x peak "
              f"allocated, {r['reserved' + suffix]:.2f}x reserved memory", flush=True)
