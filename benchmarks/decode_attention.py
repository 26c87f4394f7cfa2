"""Decode attention: the Triton kernel that reads each row's own keys vs torch's fused attention.

    python benchmarks/decode_attention.py [--json out.json]

One query per row and head over a static KV cache, as in a decode step of the engine: q (b, H,
1, d), the cache window k, v (b, Hkv, L, d) (views of (b, Hkv, L + 1, d) buffers), each row's
position pos < L. Peers, in bf16:

- "triton": `scratchlm.kernels.decode_attention_triton.decode_attention`, which reads keys
  0 .. pos of each row only;
- "sdpa": the engine's default (`scratchlm.infer.static_cache.grouped_sdpa` with the step's
  (b, 1, 1, L) mask, built once as the engine builds it), with torch's backend choice, and the
  same under each SDPA backend forced in turn where it accepts the inputs (cuDNN, efficient).

Rows: batch 1 to 256, windows of 256 and 1024 slots, rows' positions either all at the end of
the window ("full") or uniform over its second half ("ragged", as rows of different lengths in a
rollout batch). Each peer is captured in a CUDA graph of 20 calls and the graph is replayed back
to back, so the times are the kernels' (no launch overhead, as in the engine's captured steps).
"useful GB/s" counts the bytes of the keys and values each row attends to (pos + 1 of them).
"""

from __future__ import annotations

import argparse
import sys

import torch

from scratchlm.bench.results import environment, write_json
from scratchlm.bench.timing import captured_call_seconds
from scratchlm.infer.static_cache import grouped_sdpa
from scratchlm.kernels.decode_attention_triton import decode_attention

HEADS = {  # name: (H, Hkv, d)
    "gpt2": (12, 12, 64),
    "llama1b": (32, 32, 64),
    "gqa-d128": (32, 8, 128),
}
CALLS_PER_GRAPH = 20


def _inputs(b: int, H: int, Hkv: int, d: int, L: int, ragged: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k_buf = torch.randn(b, Hkv, L + 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v_buf = torch.randn(b, Hkv, L + 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(b, H, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    if ragged:
        pos = torch.randint(L // 2, L, (b,), device="cuda", generator=g)
    else:
        pos = torch.full((b,), L - 1, device="cuda")
    mask = (torch.arange(L, device="cuda") <= pos[:, None])[:, None, None, :]
    return q, k_buf[:, :, :L], v_buf[:, :, :L], pos, mask


def _forced(backend, q, k, v, mask):
    """The engine's attention with torch's SDPA backend `backend` forced."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return grouped_sdpa(q, k, v, mask)


def measure(name: str, b: int, L: int, ragged: bool, repeats: int) -> list[dict]:
    H, Hkv, d = HEADS[name]
    q, k, v, pos, mask = _inputs(b, H, Hkv, d, L, ragged)
    useful = int((pos + 1).sum()) * Hkv * d * 2 * k.element_size()
    expected = grouped_sdpa(q, k, v, mask).float()
    from torch.nn.attention import SDPBackend

    peers = {"triton": lambda: decode_attention(q, k, v, pos),
             "sdpa": lambda: grouped_sdpa(q, k, v, mask),
             "sdpa_cudnn": lambda: _forced(SDPBackend.CUDNN_ATTENTION, q, k, v, mask),
             "sdpa_efficient": lambda: _forced(SDPBackend.EFFICIENT_ATTENTION, q, k, v, mask)}
    rows = []
    for peer, fn in peers.items():
        row = {"heads": name, "H": H, "Hkv": Hkv, "d": d, "batch": b, "L": L, "rows": "ragged" if ragged else "full",
               "impl": peer}
        try:
            err = (fn().float() - expected).abs().max().item()
            seconds = captured_call_seconds(fn, CALLS_PER_GRAPH, repeats)
        except RuntimeError as exc:  # a forced backend that does not take these inputs
            row["error"] = " ".join(str(exc).split())[:160]
            rows.append(row)
            continue
        row.update(us=seconds * 1e6, useful_gb_per_s=useful / seconds / 1e9, max_abs_err_vs_sdpa=err)
        rows.append(row)
    base = next((r["us"] for r in rows if r["impl"] == "sdpa" and "us" in r), None)
    for r in rows:
        if "us" in r and base:
            r["speedup_vs_sdpa"] = base / r["us"]
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", nargs="+", choices=sorted(HEADS), default=sorted(HEADS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_attention.py times CUDA kernels; no CUDA device here", file=sys.stderr)
        return 1
    rows = []
    print("| heads | batch | L | rows | impl | us | useful GB/s | vs sdpa |")
    print("|---|---:|---:|---|---|---:|---:|---:|")
    for name in args.heads:
        for b in args.batches:
            for L in args.lengths:
                for ragged in (False, True):
                    for r in measure(name, b, L, ragged, args.repeats):
                        rows.append(r)
                        if "us" in r:
                            print(f"| {name} | {b} | {L} | {r['rows']} | {r['impl']} | {r['us']:.1f} | "
                                  f"{r['useful_gb_per_s']:.0f} | {r.get('speedup_vs_sdpa', 0):.2f} |", flush=True)
                        else:
                            print(f"| {name} | {b} | {L} | {r['rows']} | {r['impl']} | n/a | | |", flush=True)
                    if args.json:
                        write_json(args.json, {**environment(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
