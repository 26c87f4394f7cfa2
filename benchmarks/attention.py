"""scratchlm's Triton FlashAttention-2 vs PyTorch SDPA (flash and cuDNN backends).

    python benchmarks/attention.py [--seqs 1024 4096 16384] [--head-dims 64 128] [--kv-heads N] [--json out.json]

bf16, hidden size 2048 (heads = 2048 / head_dim), batch = 16384 tokens / seq, causal and
not, forward and forward+backward. TFLOP/s counts 4·B·H·T²·d for the forward (halved when
causal) and 2.5x that for the backward; times are medians of triton.testing.do_bench.
`--kv-heads N` gives k and v N heads (grouped-query attention; SDPA then runs with enable_gqa=True).
`--atomic-dq` adds, for forward+backward, scratchlm's kernels with the five-matmul backward
(`flash_attention_triton.using_backward_dq("atomic")`: dQ added into float32 by the dK/dV kernel, no dQ
kernel) and its ratio to the default backward (`x recompute`), checking its gradients first.
It ends by printing the tile configs scratchlm's autotuners chose in the run (per kernel and key).
`--cuda-graphs` times each side's step replayed from a CUDA graph instead (warmed up, autotuned, then
captured once): the GPU's time alone, without the host's time to launch the kernels, which an eager
step includes wherever the host falls behind the GPU (short sequences, where a step is ~1 ms).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from scratchlm.bench.results import environment, ratio, write_json
from scratchlm.bench.timing import graph_replay
from scratchlm.kernels.flash_attention_triton import FlashAttentionTriton, tuned_tiles, using_backward_dq
from scratchlm.model.accounting import attention_flops


def _sdpa(backend):
    def run(q, k, v, causal):
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
    return run


IMPLS = {
    "scratchlm_triton": lambda q, k, v, causal: FlashAttentionTriton.apply(q, k, v, causal),
    "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
}


def _time(fn, mode, q, k, v, g, causal, dq="recompute", graphs=False):
    import triton

    if mode == "forward":
        def step():
            with torch.no_grad():
                fn(q, k, v, causal)
    else:
        def step():
            out = fn(q, k, v, causal)
            torch.autograd.grad(out, (q, k, v), g)
    with using_backward_dq(dq):
        run = graph_replay(step) if graphs else step
        return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") / 1e3


def tuned_configs() -> dict[str, list[int]]:
    """The configs scratchlm's autotuners chose in this process, "tuner N_CTX,HEAD_DIM,..." ->
    [BLOCK_M, BLOCK_N, num_warps, num_stages] (`flash_attention_triton.tuned_tiles`)."""
    return {key: list(tiles) for key, tiles in tuned_tiles().items()}


def _atomic_dq_error(q, k, v, g, causal) -> float:
    """The largest relative error of the five-matmul backward's gradients against the default's."""
    out = FlashAttentionTriton.apply(q, k, v, causal)
    expected = torch.autograd.grad(out, (q, k, v), g)
    with using_backward_dq("atomic"):
        got = torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, causal), (q, k, v), g)
    return max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, expected))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--kv-heads", type=int, default=None,
                   help="heads of k and v (grouped-query attention); default: as many as q")
    p.add_argument("--causal", choices=("both", "causal", "noncausal"), default="both")
    p.add_argument("--modes", nargs="+", default=["forward", "forward_backward"])
    p.add_argument("--atomic-dq", action="store_true",
                   help="also time forward+backward with the five-matmul backward (dQ by atomic adds)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="time every step replayed from a CUDA graph (GPU time without host launch time)")
    p.add_argument("--json", help="write all rows to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for d in args.head_dims:
        if args.kv_heads is not None and (args.kv_heads < 1 or (args.hidden // d) % args.kv_heads):
            print(f"--kv-heads {args.kv_heads} must divide the {args.hidden // d} heads of head dim {d}",
                  file=sys.stderr)
            return 1
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    causals = {"both": [True, False], "causal": [True], "noncausal": [False]}[args.causal]
    rows = []
    header = (f"{'seq':>6}{'d':>5}{'causal':>7}{'mode':>17}{'ours':>8}{'flash':>8}{'cudnn':>8}"
              f"{'x flash':>9}{'x cudnn':>9}   (TFLOP/s)")
    print(torch.cuda.get_device_name(), "bf16, hidden", args.hidden, "tokens", args.tokens,
          "kv heads", args.kv_heads or "all", "CUDA graphs" if args.cuda_graphs else "eager")
    print(header, flush=True)
    for d in args.head_dims:
        for seq in args.seqs:
            B, H = max(1, args.tokens // seq), args.hidden // d
            Hkv = args.kv_heads or H
            q = torch.randn(B, H, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = [torch.randn(B, Hkv, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2)]
            g = torch.randn_like(q)
            for causal in causals:
                # correctness against the flash backend on these very inputs
                ours = IMPLS["scratchlm_triton"](q, k, v, causal)
                ref = IMPLS["sdpa_flash"](q, k, v, causal)
                err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
                for mode in args.modes:
                    row = {"seq": seq, "head_dim": d, "batch": B, "heads": H, "kv_heads": Hkv, "causal": causal,
                           "mode": mode, "rel_err_vs_flash": err}
                    flops = attention_flops(B, H, seq, d, causal, mode)
                    for name, fn in IMPLS.items():
                        try:
                            t = _time(fn, mode, q, k, v, g, causal, graphs=args.cuda_graphs)
                            row[name] = {"seconds": t, "tflops": flops / t / 1e12}
                        except RuntimeError as exc:  # a backend may refuse a shape
                            row[name] = {"error": str(exc).splitlines()[0][:200]}
                    tf = {n: row[n].get("tflops") for n in IMPLS}
                    row["ratio_vs_flash"] = ratio(tf["scratchlm_triton"], tf["sdpa_flash"])
                    row["ratio_vs_cudnn"] = ratio(tf["scratchlm_triton"], tf["sdpa_cudnn"])
                    fmt = lambda x: f"{x:8.1f}" if x else "     n/a"  # noqa: E731
                    rat = lambda x: f"{x:9.2f}" if x else "      n/a"  # noqa: E731
                    atomic = ""
                    if args.atomic_dq and mode == "forward_backward":
                        fn = IMPLS["scratchlm_triton"]
                        row["atomic_dq_grad_err"] = _atomic_dq_error(q, k, v, g, causal)
                        t = _time(fn, mode, q, k, v, g, causal, dq="atomic", graphs=args.cuda_graphs)
                        row["scratchlm_triton_atomic_dq"] = {"seconds": t, "tflops": flops / t / 1e12}
                        row["atomic_dq_ratio"] = ratio(flops / t / 1e12, tf["scratchlm_triton"])
                        atomic = (f"   atomic dQ {flops / t / 1e12:6.1f} TFLOP/s, x recompute "
                                  f"{row['atomic_dq_ratio']:.2f}, grad err {row['atomic_dq_grad_err']:.1e}")
                    rows.append(row)
                    print(f"{seq:>6}{d:>5}{str(causal):>7}{mode:>17}{fmt(tf['scratchlm_triton'])}"
                          f"{fmt(tf['sdpa_flash'])}{fmt(tf['sdpa_cudnn'])}{rat(row['ratio_vs_flash'])}"
                          f"{rat(row['ratio_vs_cudnn'])}   err {err:.1e}{atomic}", flush=True)
            del q, k, v, g
            torch.cuda.empty_cache()
    configs = tuned_configs()
    print("autotuned configs (BLOCK_M, BLOCK_N, warps, stages):",
          "; ".join(f"{k}: {tuple(v)}" for k, v in configs.items()), flush=True)
    if args.json:
        write_json(args.json, {**environment(), "cuda_graphs": args.cuda_graphs, "rows": rows,
                               "tuned_configs": configs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
