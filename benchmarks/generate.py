"""Decoding speed: the scratchlm engine vs Hugging Face `generate` (dynamic cache, and static cache + compile).

    python benchmarks/generate.py --model gpt2 [--rollout-batch 256] [--repeats 2] [--out out.json]

One random-weight scratchlm model is converted with scratchlm.model.hf into an identical
LlamaForCausalLM (same weights, bf16), so every peer does the same arithmetic. Two shapes:
"gpt2" (GPT-2-small-like: vocab 50257, d_model 768, 12 layers, 12 heads, d_ff 2048) and
"llama1b" (1B-class Llama: vocab 128256, d_model 2048, 16 layers, 32 heads, d_ff 8192, tied
embeddings). Two workloads:

- batch 1: greedy, a 64-token prompt, --new-tokens (256) new tokens. Peers: HF `generate`
  (dynamic cache), HF `generate` with `cache_implementation="static"` (which compiles its
  decoding forward), the engine with CUDA graphs, the engine with CUDA graphs + torch.compile
  (`generate`'s default: fused blocks, and PDL on Hopper, at up to 8 rows), the same with its
  blocks run module by module (`..._compile_unfused`), and variants of the latter: without the stacked q|k|v and w1|w3 projections, and with
  Inductor's "max-autotune-no-cudagraphs" (Triton matmul templates benchmarked against cuBLAS per
  shape, epilogues fused; a longer compilation: `--skip scratchlm_engine_graphs_compile_autotune`),
  with Inductor's `decompose_mem_bound_mm` and `coordinate_descent_tuning` (the batch-1 matmuls as
  reductions fused with their neighbours), with fused blocks (`fused_blocks=True`: each block's
  norms, gate and residual adds inside its matmul kernels, compiled and not), and with the Triton decode attention
  (`decode_attention="triton"`, at batch 1 and in the rollouts).
  tokens/s, and the share of the memory-bandwidth limit: one token needs every weight the
  step reads (all but the input embedding, unless tied) once, so the limit is
  bandwidth / weight bytes tokens/s; bandwidth is measured (device-to-device copy).
  `--greedy-batch N` runs it with N prompts of the same length instead (tokens/s counts every
  row's tokens; `ms_per_token` is then a step's, and the limit's share is of steps a second).
- rollouts: --rollout-batch prompts of 32-256 tokens, sampled at temperature 1 with a set of
  stop ids sized so that rows stop after ~--rollout-mean tokens on average, at most
  --rollout-max new tokens (each row stops on its own: ragged rollouts). tokens/s counts the
  tokens actually generated (rows stop at different steps on each side, so counts differ).

Each timing is the median of --repeats (batch 1) or --rollout-repeats runs after one warm-up
run (which also compiles and captures). `--only PEER...` runs the named peers alone, `--skip
PEER...` all but those (the names of BATCH1_PEERS; the rollouts run those of theirs that are
left), e.g. HF's dynamic cache and the default engine only:

    python benchmarks/generate.py --rollout-batch --only hf_generate_dynamic scratchlm_engine_graphs_compile
--profile PREFIX writes, for batch 1 and 64, what one captured decode step spends its time on (kernels,
GPU-busy time, gaps between kernels) to PREFIX_b{B}.txt, and for batch 1 with GEMV_OPTIONS to
PREFIX_b1_gemv.txt and with fused blocks to PREFIX_b1_fused.txt (PREFIX_b1_fused_projections.txt with
RoPE and the cache write left to Inductor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from scratchlm.bench.results import environment, write_json
from scratchlm.bench.timing import copy_bandwidth
from scratchlm.infer.generate import generate
from scratchlm.model.config import ModelConfig
from scratchlm.model.hf import hf_config, to_hf_state_dict
from scratchlm.model.transformer import build_model

# The batch-1 peers, in the order they run (the rollouts time a subset of them); `--skip` and
# `--only` take these names.
BATCH1_PEERS = (
    "hf_generate_dynamic", "scratchlm_engine_graphs", "scratchlm_engine_graphs_compile",
    "scratchlm_engine_graphs_compile_unfused", "hf_generate_static_compile",
    "scratchlm_engine_graphs_compile_unstacked",
    "scratchlm_engine_graphs_compile_gemv", "scratchlm_engine_graphs_compile_fused",
    "scratchlm_engine_graphs_compile_fused_projections", "scratchlm_engine_graphs_compile_fused_pdl",
    "scratchlm_engine_graphs_compile_fused_one_step_replays",
    "scratchlm_engine_graphs_compile_fused_inductor_pdl", "scratchlm_engine_graphs_fused",
    "scratchlm_engine_graphs_compile_sdpa_attention", "scratchlm_engine_graphs_compile_autotune",
)

SHAPES = {
    "gpt2": ModelConfig(vocab_size=50257, context_length=1024, d_model=768, num_layers=12, num_heads=12, d_ff=2048),
    "llama1b": ModelConfig(vocab_size=128256, context_length=2048, d_model=2048, num_layers=16, num_heads=32,
                           d_ff=8192, rope_theta=500_000.0, tie_embeddings=True),
}


def _timed(fn, repeats: int):
    fn()  # warm-up (compilation, graph capture)
    times, out = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _time_peers(impls: dict, repeats: int, skip, count_tokens, label: str) -> dict:
    """{name: (median seconds, output)} of each peer not in `skip`; a peer that fails is reported
    and left out, the others still run."""
    results = {}
    for name, fn in impls.items():
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            seconds, out = _timed(fn, repeats)
        except Exception as e:
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
            continue
        results[name] = (seconds, out)
        tokens = count_tokens(out)
        print(f"{name}{label}: {tokens / seconds:.0f} tokens/s, {tokens} tokens "
              f"({time.perf_counter() - t0:.0f} s with warm-up)", flush=True)
    return results


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: all, less the embedding table unless tied."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or (name == "token_embeddings.weight" and p is not model.lm_head.weight):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def _hf_model(model, cfg, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    options = {k: v for k, v in hf_config(cfg, dtype=dtype).items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("cuda"):  # random init on the GPU: seconds, not minutes, for 1B parameters
        hf = LlamaForCausalLM(LlamaConfig(**options))
    hf = hf.to(dtype).eval()
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), cfg), strict=False)
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf


def _hf_generate(hf, prompts, new_tokens, *, static=False, sample=False, stop_ids=None):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    kwargs = {"cache_implementation": "static"} if static else {}
    if sample:
        kwargs.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False, min_new_tokens=new_tokens)
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0,
                          eos_token_id=stop_ids, **kwargs)
    rows = out[:, width:].tolist()
    if stop_ids:  # HF pads finished rows; keep each row through its first stop id
        stops = set(stop_ids)
        rows = [r[: next((i + 1 for i, t in enumerate(r) if t in stops), len(r))] for r in rows]
    return rows


_KEPT: dict[str, tuple[int, object]] = {}  # variant -> (max_len, its engine), kept across the timed runs


# Inductor turning the tiny matmuls of a batch-1 step into reductions it can fuse with their
# neighbours (RMSNorm before, residual add after), its kernels tuned by coordinate descent
GEMV_OPTIONS = {"decompose_mem_bound_mm": True, "coordinate_descent_tuning": True}

def _variant(name: str, model, prompts, new_tokens, *, stop_ids=(), compile=True, steps_per_replay=None,
             **engine_options):
    """Decoding by a captured engine (compiled unless `compile` is False) built with `engine_options` (one kept per variant):
    greedy without `stop_ids`, else sampled at temperature 1 (seed 0) as the rollouts are, with
    the attention windows of `generate`'s engines; `steps_per_replay` replaces the engine's.
    Blocks run module by module and without PDL unless `engine_options` ask for them, so each
    variant changes one thing from the module-by-module compiled step (`..._compile_unfused`)."""
    engine_options = {"fused_blocks": False, "pdl": False, **engine_options}
    from scratchlm.infer.engine import DecodeEngine
    from scratchlm.infer.generate import _LEN_BUCKET

    need = max(len(p) for p in prompts) + new_tokens
    if name not in _KEPT or _KEPT[name][0] != need:
        _KEPT[name] = (need, DecodeEngine(model, len(prompts), need, compile=compile, len_bucket=_LEN_BUCKET,
                                          **engine_options))
        if steps_per_replay is not None:
            _KEPT[name][1].steps_per_replay = steps_per_replay
    engine = _KEPT[name][1]
    with torch.inference_mode():
        if not stop_ids:
            return engine.run(prompts, [new_tokens] * len(prompts), temperature=0)
        generator = torch.Generator(device="cuda").manual_seed(0)
        return engine.run(prompts, [new_tokens] * len(prompts), temperature=1.0, stop_ids=stop_ids,
                          generator=generator)


def _agreement(a, b) -> float:
    same = total = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same, total = same + n, total + len(y)
    return same / max(total, 1)


def _profile(model, prompts, steps: int, path: str, compile: bool, **engine_options) -> dict:
    """What one captured decode step spends its time on, at batch len(prompts), window 256.

    The step is the one `generate` replays (CUDA graph, after torch.compile when `compile`).
    Wall time per replay is measured with CUDA events over `steps` back-to-back replays; the
    profiler (CUPTI sees the kernels inside a graph) gives each kernel's time, their number per
    step and the GPU-busy time per step. Wall minus busy is the gaps between kernels in the graph.
    Writes the kernel table to `path` and returns the summary.
    """
    from torch.profiler import ProfilerActivity, profile

    from scratchlm.infer.engine import DecodeEngine

    B = len(prompts)
    engine = DecodeEngine(model, B, 512, compile=compile, **engine_options)
    with torch.inference_mode():
        engine.run(prompts, [300] * B, temperature=0)  # compiles and captures the steps it takes
        for _ in range(3):
            engine._step(B, 256, True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            engine._step(B, 256, True)
        end.record()
        torch.cuda.synchronize()
        wall_ms = start.elapsed_time(end) / steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine._step(B, 256, True)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in kernels) / 1e3 / steps  # device_time is in us
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
    summary = {"batch": B, "compile": compile, "wall_ms_per_step": wall_ms, "kernels_per_step": len(kernels) / steps,
               "gpu_busy_ms_per_step": busy_ms, "gap_ms_per_step": wall_ms - busy_ms}
    with open(path, "w") as f:
        f.write(json.dumps(summary) + "\n\n" + table)
    print(json.dumps(summary), flush=True)
    print(table[:5000], flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="gpt2")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rollout-batch", type=int, nargs="*", default=[256])
    p.add_argument("--rollout-mean", type=int, default=256)
    p.add_argument("--rollout-max", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rollout-repeats", type=int, default=1)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--skip", nargs="*", default=[], metavar="PEER", help="peers to leave out (e.g. "
                       "hf_generate_static_compile): names of BATCH1_PEERS")
    which.add_argument("--only", nargs="+", metavar="PEER", help="the peers to run, every other one left out")
    steps = ["b1", "b1_gemv", "b1_fused", "b1_fused_pdl", "b1_fused_projections", "b64"]
    p.add_argument("--profile-steps", nargs="*", default=steps, choices=steps, help="which steps --profile profiles")
    p.add_argument("--no-batch1", action="store_true", help="leave out the batch-1 greedy workload (rollouts only)")
    p.add_argument("--greedy-batch", type=int, default=1,
                   help="rows of the greedy workload (default 1; 2-8 time the fused blocks' several-row kernels)")
    p.add_argument("--profile", help="write the engine's kernel-time table here")
    p.add_argument("--out", help="write the rows to this JSON file")
    args = p.parse_args(argv)
    unknown = [name for name in [*args.skip, *(args.only or [])] if name not in BATCH1_PEERS]
    if unknown:
        p.error(f"unknown peer(s) {', '.join(unknown)}; the peers are {', '.join(BATCH1_PEERS)}")
    if args.only:
        args.skip = [name for name in BATCH1_PEERS if name not in args.only]
    dtype = torch.bfloat16

    bandwidth = copy_bandwidth()
    torch.manual_seed(0)
    cfg = SHAPES[args.model]
    model = build_model(cfg, device="cuda", dtype=dtype).eval()
    if not cfg.tie_embeddings:
        with torch.no_grad():  # sharper next-token distributions, so greedy paths are not near-ties
            model.lm_head.weight.mul_(4)
    hf = _hf_model(model, cfg, dtype)
    wbytes = weight_bytes(model)
    limit = bandwidth / wbytes  # tokens/s at batch 1 if only the weights had to be read
    print(f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, "
          f"{wbytes / 1e6:.0f} MB read per step, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"batch-1 limit {limit:.0f} tokens/s", flush=True)

    rows, gen = [], torch.Generator().manual_seed(1)

    def save() -> None:  # after each workload, so a run cut short still leaves its numbers
        if args.out:
            import transformers

            write_json(args.out, {**environment(), "transformers": transformers.__version__,
                                  "copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes_per_step": wbytes,
                                  "rows": rows})
    B1 = args.greedy_batch
    if B1 < 1:
        raise SystemExit(f"--greedy-batch must be >= 1, got {B1}")
    prompt = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(B1)]
    n = args.new_tokens
    impls = {
        "hf_generate_dynamic": lambda: _hf_generate(hf, prompt, n),
        "scratchlm_engine_graphs": lambda: generate(model, prompt, n, temperature=0),
        # generate's default compiled engine: fused blocks (+ PDL on Hopper) at up to 8 rows
        "scratchlm_engine_graphs_compile": lambda: generate(model, prompt, n, temperature=0, compile=True),
        # the compiled engine with its blocks run module by module (the default before fused blocks)
        "scratchlm_engine_graphs_compile_unfused": lambda: _variant("unfused", model, prompt, n),
        "hf_generate_static_compile": lambda: _hf_generate(hf, prompt, n, static=True),
        # the same compiled engine with q, k, v and w1, w3 as separate matmuls: what stacking gives
        "scratchlm_engine_graphs_compile_unstacked": lambda: _variant("unstacked", model, prompt, n,
                                                                      stack_projections=False),
        # the matmuls as fusable reductions (GEMV_OPTIONS)
        "scratchlm_engine_graphs_compile_gemv": lambda: _variant("gemv", model, prompt, n, inductor_options=GEMV_OPTIONS),
        # each block's norms, SwiGLU gate and residual adds inside its matmul kernels
        # (`DecodeEngine(fused_blocks=True)`, scratchlm.infer.fused_block), compiled and not
        "scratchlm_engine_graphs_compile_fused": lambda: _variant("fused", model, prompt, n, fused_blocks=True),
        # the same with RoPE and the cache write left to Inductor instead of in the q|k|v kernel
        "scratchlm_engine_graphs_compile_fused_projections": lambda: _variant("fused_projections", model, prompt, n,
                                                                              fused_blocks="projections"),
        # the fused blocks' kernels launched with programmatic dependent launch (pdl=True), then
        # with one greedy step a graph replay instead of DecodeEngine.steps_per_replay, then with
        # Inductor's own kernels (embedding, final norm, argmax, bookkeeping) launched with PDL too
        "scratchlm_engine_graphs_compile_fused_pdl": lambda: _variant("fused_pdl", model, prompt, n,
                                                                      fused_blocks=True, pdl=True),
        "scratchlm_engine_graphs_compile_fused_one_step_replays": lambda: _variant(
            "fused_one_step", model, prompt, n, fused_blocks=True, steps_per_replay=1),
        "scratchlm_engine_graphs_compile_fused_inductor_pdl": lambda: _variant(
            "fused_inductor_pdl", model, prompt, n, fused_blocks=True, pdl=True,
            inductor_options={"triton.enable_pdl": True}),
        "scratchlm_engine_graphs_fused": lambda: _variant("fused_eager", model, prompt, n, compile=False,
                                                          fused_blocks=True),
        # decode attention by torch's fused kernel over the masked window, where the engine's
        # default (`default_decode_attention`) is the Triton kernel that reads each row's keys only
        "scratchlm_engine_graphs_compile_sdpa_attention": lambda: _variant("sdpa_attention", model, prompt, n,
                                                                           decode_attention="sdpa"),
        # Inductor's autotuned matmul templates (epilogues fused) instead of cuBLAS where they win
        "scratchlm_engine_graphs_compile_autotune": lambda: _variant("autotune", model, prompt, n,
                                                                     compile_mode="max-autotune-no-cudagraphs"),
    }
    assert tuple(impls) == BATCH1_PEERS, "BATCH1_PEERS names every batch-1 peer, in order"
    results = {} if args.no_batch1 else _time_peers(impls, args.repeats, args.skip, lambda out: n * B1,
                                                    "" if B1 == 1 else f" x{B1}")
    ref = results.get("hf_generate_dynamic")
    static = results.get("hf_generate_static_compile")
    for name, (seconds, out) in results.items():
        steps_per_s = n / seconds  # B1 tokens a step: the weights are read once a step
        rows.append({
            "model": args.model, "workload": f"batch{B1}_greedy", "impl": name, "batch": B1,
            "prompt_len": args.prompt_len, "new_tokens": n, "seconds": seconds, "tokens_per_s": B1 * steps_per_s,
            "ms_per_token": 1e3 * seconds / n, "bandwidth_limit_share": steps_per_s / limit,
            "vs_hf_dynamic": ref[0] / seconds if ref else None,
            "vs_hf_static_compile": static[0] / seconds if static else None,
            "agree_with_hf": _agreement(out, ref[1]) if ref else None,
        })
    save()
    if args.profile and not args.no_batch1:  # before the rollouts: short, and it reuses the batch-1 compilation
        profiles = ((1, "", {}), (1, "_gemv", {"inductor_options": GEMV_OPTIONS}),
                    (1, "_fused", {"fused_blocks": True, "pdl": False}), (1, "_fused_pdl", {"fused_blocks": True, "pdl": True}),
                    (1, "_fused_projections", {"fused_blocks": "projections"}), (64, "", {}))
        for B, name, options in profiles:
            if f"b{B}{name}" not in args.profile_steps:
                continue
            rows.append({"model": args.model, "workload": "profile", "engine": name.strip("_") or "default",
                         **_profile(model, [prompt[0]] * B, 50, f"{args.profile}_b{B}{name}.txt", compile=True,
                                    **options)})
        save()

    for B in args.rollout_batch:
        lens = torch.randint(32, 257, (B,), generator=gen).tolist()
        prompts = [torch.randint(0, cfg.vocab_size, (k,), generator=gen).tolist() for k in lens]
        # a row stops at each step with probability ~ (stop ids / vocab) under near-uniform draws
        n_stop = max(1, round(cfg.vocab_size / args.rollout_mean))
        stop_ids = torch.randperm(cfg.vocab_size, generator=gen)[:n_stop].tolist()
        m = args.rollout_max
        impls = {
            "scratchlm_engine_graphs": lambda: generate(model, prompts, m, temperature=1.0, eos_id=stop_ids, seed=0),
            "hf_generate_dynamic": lambda: _hf_generate(hf, prompts, m, sample=True, stop_ids=stop_ids),
            "scratchlm_engine_graphs_compile": lambda: generate(model, prompts, m, temperature=1.0, eos_id=stop_ids,
                                                                seed=0, compile=True),
            "scratchlm_engine_graphs_compile_sdpa_attention": lambda: _variant(
                f"sdpa_attention_x{B}", model, prompts, m, stop_ids=stop_ids, decode_attention="sdpa"),
        }
        timed = _time_peers(impls, args.rollout_repeats, args.skip, lambda out: sum(len(o) for o in out),
                            f" rollouts x{B}")
        results = {name: (seconds, sum(len(o) for o in out)) for name, (seconds, out) in timed.items()}
        ref = results.get("hf_generate_dynamic")
        for name, (seconds, count) in results.items():
            rows.append({
                "model": args.model, "workload": "rollouts_sampled", "impl": name, "batch": B, "prompt_len": "32-256",
                "new_tokens": f"<= {m}, mean {count / B:.0f}", "seconds": seconds, "tokens": count,
                "tokens_per_s": count / seconds,
                "vs_hf_dynamic": (count / seconds) / (ref[1] / ref[0]) if ref else None,
            })
        save()

    print(f"{'model':<8} {'workload':<17} {'impl':<32} {'batch':>5} {'tok/s':>8} {'vs HF':>6} {'vs HF st+c':>10} {'% BW':>5}")
    for r in rows:
        if r["workload"] == "profile":
            continue
        st = r.get("vs_hf_static_compile")
        bw = r.get("bandwidth_limit_share")
        print(f"{r['model']:<8} {r['workload']:<17} {r['impl']:<32} {r['batch']:>5} {r['tokens_per_s']:>8.0f} "
              f"{r['vs_hf_dynamic'] or 0:>6.2f} {st or 0:>10.2f} {100 * bw if bw else 0:>5.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
