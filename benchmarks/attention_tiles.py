"""Tile sizes of the Triton attention kernels: every candidate config of each kernel, timed.

    python benchmarks/attention_tiles.py [--shapes 4x16x4096x128 1x20x32768x128] [--kernels fwd dq dkdv]
        [--json out.json]

Each shape is batch x heads x seq x head_dim, bf16, causal (`--noncausal` for the other case).
For every shape it times, with `triton.testing.do_bench` (median):

- the forward kernel under each candidate (BLOCK_M, BLOCK_N, num_warps, num_stages);
- the backward (dQ kernel, then dK/dV kernel) with the dQ kernel under each candidate and the
  dK/dV kernel at its autotuned config, then the dK/dV kernel under each candidate with the dQ
  kernel at the best dQ config found; differences between rows are the swept kernel's;
- the autotuned configs themselves (what `FlashAttentionTriton` runs), printed first, for comparison.

`--kernels` sweeps only the named kernels; the others run at their autotuned configs.

Configs that do not compile or do not fit (shared memory, registers) are listed as failed.
The output of each config is checked against the autotuned path on the same inputs, so a
fast but wrong config cannot win. The best configs are printed last: candidates for
`_FWD_TILES`, `_DQ_TILES` and `_DKDV_TILES` in `scratchlm/kernels/flash_attention_triton.py`.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from scratchlm.bench.results import environment, write_json
from scratchlm.kernels import flash_attention_triton as fa
from scratchlm.model.accounting import attention_flops

BLOCKS_M, BLOCKS_N, WARPS, STAGES = (32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4)
KERNELS = ("fwd", "dq", "dkdv")


def candidates(kernel: str) -> list[tuple[int, int, int, int]]:
    # The causal split needs one tile size to divide the other: BLOCK_N | BLOCK_M for the forward
    # and dQ kernels (they stream over keys), BLOCK_M | BLOCK_N for dK/dV (it streams over queries).
    out = []
    for m, n, w, s in itertools.product(BLOCKS_M, BLOCKS_N, WARPS, STAGES):
        if (m % n if kernel in ("fwd", "dq") else n % m) == 0 and m * n >= 32 * 64:
            out.append((m, n, w, s))
    return out


def _inputs(B, H, T, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    return q, k, v, do


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep_shape(B, H, T, D, causal: bool, kernels=KERNELS) -> dict:
    import triton

    q, k, v, do = _inputs(B, H, T, D)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")  # noqa: E731
    # The autotuned path (the tuners' choices are read back after the first call).
    o_ref, lse_ref = fa._forward_triton(q, k, v, causal)
    dq_ref, dk_ref, dv_ref = fa._backward_triton(do, q, k, v, o_ref, lse_ref, causal)
    auto = {name: _tuned(getattr(fa, name)) for name in ("_fwd_tuned", "_fwd_tuned_big_d", "_dq_tuned",
                                                          "_dq_tuned_big_d", "_dkdv_tuned", "_dkdv_tuned_big_d")}
    fixed = fa._fixed_tiles(q.dtype, fa._block_d(D))  # what the launchers use when they do not tune
    result = {"shape": [B, H, T, D], "causal": causal, "auto": auto,
              "auto_fwd_ms": bench(lambda: fa._forward_triton(q, k, v, causal)),
              "auto_bwd_ms": bench(lambda: fa._backward_triton(do, q, k, v, o_ref, lse_ref, causal))}
    flops = attention_flops(B, H, T, D, causal, "forward")
    chosen = {kernel: auto[f"_{kernel}_tuned{'_big_d' if D > 64 else ''}"] for kernel in KERNELS}  # this D's tuners
    print(f"{B}x{H}x{T}x{D} causal={causal}: autotuned forward {result['auto_fwd_ms']:.3f} ms, "
          f"backward {result['auto_bwd_ms']:.3f} ms; configs {chosen}", flush=True)
    o, lse = fa._alloc_out(q), torch.empty_like(lse_ref)

    def fwd(tiles):
        fa._launch_forward(q, k, v, o, lse, causal, autotune=False, tiles=tiles)

    grads = [fa._alloc_out(t) for t in (q, k, v)]

    def bwd(tiles):
        fa._launch_backward(do, q, k, v, o_ref, *grads, lse_ref, causal, autotune=False, tiles=tiles)

    def timed(label, run, check):
        try:
            run()
            torch.cuda.synchronize()
            err = check()
            ms = bench(run)
        except Exception as exc:  # out of resources, or a compile error: not a candidate
            print(f"  {label:<28} failed: {str(exc).splitlines()[0][:100]}", flush=True)
            return {"failed": str(exc).splitlines()[0][:200]}
        print(f"  {label:<28} {ms:8.3f} ms  err {err:.1e}", flush=True)
        return {"ms": ms, "rel_err_vs_auto": err}

    rows = {"fwd": [], "dq": [], "dkdv": []}
    for t in candidates("fwd") if "fwd" in kernels else ():
        r = timed(f"fwd {t}", lambda: fwd(t), lambda: max(_rel(o, o_ref), _rel(lse, lse_ref)))
        if "ms" in r:
            r["tflops"] = flops / r["ms"] / 1e9
        rows["fwd"].append([list(t), r])
    dkdv_auto = chosen["dkdv"] or fixed["dkdv"]
    for t in candidates("dq") if "dq" in kernels else ():
        rows["dq"].append([list(t), timed(f"bwd dq {t}", lambda: bwd({"dq": t, "dkdv": dkdv_auto}),
                                          lambda: _rel(grads[0], dq_ref))])
    best_dq = _best(rows["dq"]) or chosen["dq"] or fixed["dq"]
    for t in candidates("dkdv") if "dkdv" in kernels else ():
        rows["dkdv"].append([list(t), timed(f"bwd dkdv {t}", lambda: bwd({"dq": best_dq, "dkdv": t}),
                                            lambda: max(_rel(grads[1], dk_ref), _rel(grads[2], dv_ref)))])
    result["rows"] = rows
    result["best"] = {name: _best(r) for name, r in rows.items()}
    return result


def _tuned(kernel):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) an autotuner chose, None if it has not run."""
    c = getattr(kernel, "best_config", None)
    return None if c is None else fa.config_tiles(c)


def _best(rows, max_err: float = 2e-2):
    ok = [(r["ms"], tuple(t)) for t, r in rows if "ms" in r and r["rel_err_vs_auto"] < max_err]
    return min(ok)[1] if ok else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["4x16x4096x128", "1x20x32768x128"])
    p.add_argument("--noncausal", action="store_true")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS),
                   help="which kernels' candidates to sweep (the others run at their autotuned configs)")
    p.add_argument("--json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    out = {**environment(), "shapes": []}
    for spec in args.shapes:
        B, H, T, D = (int(x) for x in spec.split("x"))
        out["shapes"].append(sweep_shape(B, H, T, D, not args.noncausal, args.kernels))
        if args.json:
            write_json(args.json, out)
    for s in out["shapes"]:
        print(f"best for {'x'.join(map(str, s['shape']))}: {s['best']} (autotuned forward {s['auto_fwd_ms']:.3f} ms,"
              f" backward {s['auto_bwd_ms']:.3f} ms; best forward "
              f"{min((r['ms'] for _, r in s['rows']['fwd'] if 'ms' in r), default=float('nan')):.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
