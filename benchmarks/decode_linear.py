"""The decode projection kernel against torch at decode shapes, each inside a CUDA graph.

    python benchmarks/decode_linear.py [--model gpt2 llama1b] [--rows 1 4 8] [--only-layers]
        [--sweep] [--json out.json]

For each projection of a block (q|k|v after the first RMSNorm, the output projection plus the
residual, w1|w3 after the second RMSNorm with the SwiGLU gate, w2 plus the residual) and each
number of rows, three peers compute the same thing in bf16:

- `decode_linear`: `scratchlm.kernels.decode_linear_triton` (one kernel);
- `torch_compiled`: `decode_linear_reference` under torch.compile (Inductor fuses the norm and the
  epilogue around cuBLAS's matmul);
- `matmul_only`: cuBLAS's `x @ wᵀ` alone, without the norm or the epilogue (a floor for torch's side).

Each is captured in a CUDA graph of `--calls` back-to-back calls, replayed `--repeats` times
(median); the time per call includes its launch inside the graph, as a decode step's does. Also
printed: GB/s of weights read and its share of the device-to-device copy bandwidth measured in
the same run, and the ratio of each peer's time to `decode_linear`'s.

Then, for attention and the output projection after it (plus the residual), at a cache of
--keys positions a row: `decode_attention_linear` (the split attention's partial results
combined inside the projection's kernel) against `decode_attention` then `decode_linear` (the
split attention, its combine kernel, then the projection: what an unfused step runs).

Then a whole fused decode step's layers (`--layers`, default the model's count, each with its
own weights so that they come from memory, not cache): per layer `decode_qkv` (RMSNorm + q|k|v +
RoPE + cache write), `decode_attention_linear`, `decode_linear` with the gate, `decode_linear`
with the residual, as `scratchlm.infer.fused_block` runs them, launched without and with
programmatic dependent launch (`pdl`, Hopper on): the step's time without the LM head, its
share of the copy bandwidth, and PDL's ratio. No torch.compile is involved, so this takes seconds.

`--sweep` instead times `decode_linear` with every tile choice (BLOCK_N in 2..16, BLOCK_K in
128..2048, num_warps in 2..8, at most 16,384 product terms a program) in place of `blocks_for`'s,
and prints the fastest per projection and row count: how `blocks_for`'s rule was chosen. With
`--only-layers` it times the layer stack with each number of attention splits at few programs
(`SPLITS_WHEN_FEW` in 1..16) at 64, 192, 320 and 1,024 cached positions instead.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from scratchlm.bench.results import environment, write_json
from scratchlm.bench.timing import captured_call_seconds, copy_bandwidth
from scratchlm.kernels import decode_attention_triton, decode_linear_triton
from scratchlm.kernels.decode_attention_triton import decode_attention
from scratchlm.kernels.decode_linear_triton import (decode_attention_linear, decode_linear, decode_linear_reference,
                                                   decode_qkv)
from scratchlm.kernels.triton_support import pdl_supported
from scratchlm.model.rope import rope_angles

SHAPES = {  # model: (d_model, q|k|v width, d_ff)
    "gpt2": (768, 3 * 768, 2048),
    "llama1b": (2048, 3 * 2048, 8192),
}
HEADS = {"gpt2": (12, 12), "llama1b": (32, 8)}  # model: (query heads, kv heads)
LAYERS = {"gpt2": 12, "llama1b": 16}


def _random(device, dtype):
    """t(*shape, scale=1.0): standard normal tensors times scale, drawn in turn from one seeded
    generator, on `device` in `dtype`."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    return t


def projections(model: str, rows: int, device="cuda", dtype=torch.bfloat16):
    """{name: (kwargs of decode_linear, weight bytes)} for one block of `model` at `rows` rows."""
    d, qkv, ff = SHAPES[model]
    t = _random(device, dtype)
    x, norm = t(rows, d), 1 + 0.1 * t(d)
    cases = {
        "qkv_norm": dict(x=x, w=t(qkv, d, scale=d ** -0.5), norm_weight=norm),
        "out_residual": dict(x=t(rows, d), w=t(d, d, scale=d ** -0.5), residual=t(rows, d)),
        "w13_norm_gate": dict(x=x, w=t(2 * ff, d, scale=d ** -0.5), norm_weight=norm, gate_up=True),
        "w2_residual": dict(x=t(rows, ff), w=t(d, ff, scale=ff ** -0.5), residual=t(rows, d)),
    }
    return {name: (kw, kw["w"].numel() * kw["w"].element_size()) for name, kw in cases.items()}


def attention_output(model: str, rows: int, keys: int, device="cuda", dtype=torch.bfloat16):
    """(q, k, v, pos, w_o, residual) of one layer's decode step of `rows` rows whose caches hold
    `keys` positions (windows of buffers with room for twice as many, as the engine's)."""
    d = SHAPES[model][0]
    H, Hkv = HEADS[model]
    hd = d // H
    t = _random(device, dtype)
    k_buf, v_buf = t(rows, Hkv, 2 * keys + 1, hd), t(rows, Hkv, 2 * keys + 1, hd)
    pos = torch.full((rows,), keys - 1, dtype=torch.long, device=device)
    return t(rows, H, 1, hd), k_buf[:, :, :keys], v_buf[:, :, :keys], pos, t(d, d, scale=d ** -0.5), t(rows, d)


def time_attention_output(model: str, rows: int, keys: int, calls: int, repeats: int) -> list[dict]:
    q, k, v, pos, w, r = attention_output(model, rows, keys)

    def unfused():
        a = decode_attention(q, k, v, pos).reshape(rows, -1)
        return decode_linear(a, w, residual=r)

    torch.testing.assert_close(decode_attention_linear(q, k, v, pos, None, w, r), unfused(), rtol=2e-2, atol=2e-2)
    peers = {"decode_attention_linear": lambda: decode_attention_linear(q, k, v, pos, None, w, r),
             "attention_then_linear": unfused}
    times = {peer: captured_call_seconds(fn, calls, repeats, replays=1) for peer, fn in peers.items()}
    out = []
    for peer, seconds in times.items():
        out.append({"model": model, "projection": "attention_out_residual", "rows": rows, "keys": keys, "peer": peer,
                    "us": seconds * 1e6, "x_fused": seconds / times["decode_attention_linear"]})
        print(f"{model:8s} attention+out  rows {rows}  {keys} keys  {peer:23s} {seconds * 1e6:7.2f} us  "
              f"{out[-1]['x_fused']:.2f}x the fused op's time", flush=True)
    return out


def layer_weights(model: str, rows: int, keys: int, device="cuda", dtype=torch.bfloat16) -> dict:
    """One layer's fused-step operands at `rows` rows and caches of `keys` positions a row."""
    d, _, ff = SHAPES[model]
    H, Hkv = HEADS[model]
    hd = d // H
    t = _random(device, dtype)
    return dict(w_qkv=t((H + 2 * Hkv) * hd, d, scale=d ** -0.5), ln1=1 + 0.1 * t(d), w_o=t(d, d, scale=d ** -0.5),
                w13=t(2 * ff, d, scale=d ** -0.5), ln2=1 + 0.1 * t(d), w2=t(d, ff, scale=ff ** -0.5),
                k_buf=t(rows, Hkv, 2 * keys + 1, hd), v_buf=t(rows, Hkv, 2 * keys + 1, hd))


def layer_stack(model: str, rows: int, keys: int, layers: int, device="cuda"):
    """(step(pdl), weight bytes a step) of a fused decode step's `layers` layers (module docstring)."""
    d = SHAPES[model][0]
    H = HEADS[model][0]
    hd = d // H
    stack = [layer_weights(model, rows, keys, device) for _ in range(layers)]
    angles = rope_angles(10_000.0, hd, 2 * keys + 1, device=device)  # RoPE's (positions, d/2) tables
    cos, sin = angles.cos(), angles.sin()
    pos = torch.full((rows,), keys - 1, dtype=torch.long, device=device)
    x = torch.randn(rows, d, device=device, dtype=torch.bfloat16)
    nbytes = sum(w.numel() * w.element_size() for layer in stack for n, w in layer.items() if n.startswith("w"))

    def step(pdl: bool) -> torch.Tensor:
        h = x
        for w in stack:
            q = decode_qkv(h, w["w_qkv"], w["ln1"], 1e-5, cos, sin, pos, w["k_buf"], w["v_buf"], H, pdl=pdl)
            q = q.view(rows, 1, H, hd).transpose(1, 2)
            h = decode_attention_linear(q, w["k_buf"][:, :, :keys], w["v_buf"][:, :, :keys], pos, None, w["w_o"],
                                        residual=h, pdl=pdl)
            gated = decode_linear(h, w["w13"], w["ln2"], gate_up=True, pdl=pdl)
            h = decode_linear(gated, w["w2"], residual=h, pdl=pdl)
        return h

    return step, nbytes


def time_layer_stack(model: str, rows: int, keys: int, layers: int, calls: int, repeats: int,
                     bandwidth: float) -> list[dict]:
    """The layer stack's step timed without and with PDL (where supported), after checking that
    both give the same result bit for bit."""
    step, nbytes = layer_stack(model, rows, keys, layers)
    peers = {"no_pdl": False}
    if pdl_supported(torch.empty(1, device="cuda")):
        peers["pdl"] = True
        if not torch.equal(step(False), step(True)):
            raise AssertionError("the step launched with PDL differs from the step without")
    times = {peer: captured_call_seconds(lambda pdl=pdl: step(pdl), calls, repeats, replays=1)
             for peer, pdl in peers.items()}
    out = []
    for peer, seconds in times.items():
        out.append({"model": model, "projection": "layer_stack", "rows": rows, "keys": keys, "layers": layers,
                    "peer": peer, "us": seconds * 1e6, "us_per_layer": seconds * 1e6 / layers,
                    "bandwidth_share": nbytes / seconds / bandwidth, "x_no_pdl": times["no_pdl"] / seconds})
        print(f"{model:8s} {layers} fused layers  rows {rows}  {keys} keys  {peer:7s} {seconds * 1e6:8.1f} us "
              f"({seconds * 1e6 / layers:5.2f} us a layer, {100 * out[-1]['bandwidth_share']:5.1f}% of copy)  "
              f"{out[-1]['x_no_pdl']:.2f}x the speed without PDL", flush=True)
    return out


SWEEP_KEYS = (64, 192, 320, 1024)  # cached positions a row for `sweep_splits`


def sweep_splits(models, row_counts, repeats: int, bandwidth: float) -> list[dict]:
    """The fused layer stack's time (launched with PDL where supported) with each number of
    splits a row's keys take in the decode attention where rows x heads are few
    (`decode_attention_triton.SPLITS_WHEN_FEW`, 1..16, with the count by keys off), at each of
    SWEEP_KEYS cached positions, then with the kernels' own rule."""
    chosen, by_keys = decode_attention_triton.SPLITS_WHEN_FEW, decode_attention_triton.KEYS_A_SPLIT
    pdl = pdl_supported(torch.empty(1, device="cuda"))
    out = []
    for model in models:
        layers = LAYERS[model]
        for rows in row_counts:
            for keys in SWEEP_KEYS:
                step, nbytes = layer_stack(model, rows, keys, layers)
                times = {}
                try:
                    decode_attention_triton.KEYS_A_SPLIT = 0  # the count set here, whatever the keys
                    for splits in (1, 2, 4, 8, 16):
                        decode_attention_triton.SPLITS_WHEN_FEW = splits
                        times[splits] = captured_call_seconds(lambda: step(pdl), 10, repeats, replays=1)
                finally:
                    decode_attention_triton.SPLITS_WHEN_FEW, decode_attention_triton.KEYS_A_SPLIT = chosen, by_keys
                best = min(times, key=times.get)
                rule = captured_call_seconds(lambda: step(pdl), 10, repeats, replays=1)  # the kernels' own rule
                us_per_layer = {s: t * 1e6 / layers for s, t in times.items()}
                out.append({"model": model, "projection": "layer_stack_splits", "rows": rows, "keys": keys,
                            "pdl": pdl, "best_splits": best, "us_per_layer": us_per_layer,
                            "bandwidth_share_best": nbytes / times[best] / bandwidth,
                            "rule_us_per_layer": rule * 1e6 / layers})
                print(f"{model:8s} layers rows {rows}  {keys:5d} keys  us a layer by splits: "
                      + "  ".join(f"{s}: {us:6.2f}" for s, us in us_per_layer.items())
                      + f"  best {best}; the rule (SPLITS_WHEN_FEW {chosen}, KEYS_A_SPLIT {by_keys}): "
                      f"{rule * 1e6 / layers:6.2f}", flush=True)
    return out


def fastest_tiles(module, rule: str, block_m: int, inputs: int, block_ns, call, calls: int,
                  repeats: int) -> tuple[tuple[float, int, int, int], float]:
    """((seconds, BLOCK_N, BLOCK_K, num_warps) of the fastest tiles, the rule's own seconds) of
    `call`, with `module.<rule>` (the kernel's tile choice) returning each candidate in turn:
    BLOCK_N in `block_ns`, BLOCK_K in 128..2048, num_warps in 2..8, at most 16,384 product terms
    a program, BLOCK_K at most twice `inputs`."""
    chosen = getattr(module, rule)
    timings = []
    try:
        for bn, bk, nw in itertools.product(block_ns, (128, 256, 512, 1024, 2048), (2, 4, 8)):
            if block_m * bn * bk > 16384 or (bk > 128 and bk > 2 * inputs):
                continue
            setattr(module, rule, lambda *a, t=(block_m, bn, bk, nw): t)
            timings.append((captured_call_seconds(call, calls, repeats, replays=1), bn, bk, nw))
    finally:
        setattr(module, rule, chosen)
    return min(timings), captured_call_seconds(call, calls, repeats, replays=1)


def sweep(models, row_counts, calls: int, repeats: int) -> list[dict]:
    """The fastest tiles of `decode_linear` per projection and row count (see the module docstring)."""
    out = []
    for model in models:
        for rows in row_counts:
            for name, (kw, _) in projections(model, rows).items():
                (seconds, bn, bk, nw), default = fastest_tiles(
                    decode_linear_triton, "blocks_for", 1 << (rows - 1).bit_length(), kw["x"].shape[1],
                    (2, 4, 8, 16), lambda kw=kw: decode_linear(**kw), calls, repeats)
                out.append({"model": model, "projection": name, "rows": rows, "best_us": seconds * 1e6,
                            "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "blocks_for_us": default * 1e6})
                print(f"{model:8s} {name:14s} rows {rows}  best {seconds * 1e6:6.2f} us "
                      f"(BLOCK_N {bn}, BLOCK_K {bk}, {nw} warps)  blocks_for's {default * 1e6:6.2f} us", flush=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", choices=sorted(SHAPES), default=["gpt2", "llama1b"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--keys", type=int, default=320, help="cached positions a row for the attention peers")
    p.add_argument("--layers", type=int, help="fused layers a step for the layer-stack peers (default: the model's; "
                                              "0 leaves them out)")
    p.add_argument("--only-layers", action="store_true", help="time the layer stacks only (with --sweep: "
                                                              "sweep the attention's splits)")
    p.add_argument("--sweep", action="store_true", help="time every tile choice instead of the peers")
    p.add_argument("--json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 1
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    if args.sweep:
        if args.only_layers:
            rows_out = sweep_splits(args.model, args.rows, args.repeats, bandwidth)
        else:
            rows_out = sweep(args.model, args.rows, args.calls, args.repeats)
        if args.json:
            write_json(args.json, {**environment(), "copy_bandwidth_bytes_per_s": bandwidth, "sweep": rows_out})
        return 0
    for limit in ("recompile_limit", "cache_size_limit"):  # one compiled entry per shape and option set
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    compiled = torch.compile(decode_linear_reference, dynamic=False)
    rows_out = []

    def save() -> None:  # after each group of peers, so a run cut short still leaves its numbers
        if args.json:
            write_json(args.json, {**environment(), "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows_out})

    for model in args.model:
        for rows in args.rows:
            layers = LAYERS[model] if args.layers is None else args.layers
            if layers:
                rows_out += time_layer_stack(model, rows, args.keys, layers, 10, args.repeats, bandwidth)
                save()
            if args.only_layers:
                continue
            for name, (kw, nbytes) in projections(model, rows).items():
                reference = decode_linear_reference(**kw)
                torch.testing.assert_close(decode_linear(**kw), reference, rtol=2e-2, atol=2e-2)
                peers = {
                    "decode_linear": lambda kw=kw: decode_linear(**kw),
                    "torch_compiled": lambda kw=kw: compiled(**kw),
                    "matmul_only": lambda kw=kw: kw["x"] @ kw["w"].t(),
                }
                times = {peer: captured_call_seconds(fn, args.calls, args.repeats, replays=1)
                         for peer, fn in peers.items()}
                for peer, seconds in times.items():
                    row = {"model": model, "projection": name, "rows": rows, "peer": peer, "us": seconds * 1e6,
                           "weight_gb_per_s": nbytes / seconds / 1e9, "bandwidth_share": nbytes / seconds / bandwidth,
                           "x_decode_linear": seconds / times["decode_linear"]}
                    rows_out.append(row)
                    print(f"{model:8s} {name:14s} rows {rows}  {peer:15s} {row['us']:7.2f} us  "
                          f"{row['weight_gb_per_s']:7.0f} GB/s  {100 * row['bandwidth_share']:5.1f}% of copy  "
                          f"{row['x_decode_linear']:.2f}x decode_linear's time", flush=True)
                save()
            rows_out += time_attention_output(model, rows, args.keys, args.calls, args.repeats)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
