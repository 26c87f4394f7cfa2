"""Decoding speed: scratchlm generate (KV cache / no cache) vs Hugging Face LlamaForCausalLM.generate.

    python benchmarks/generate.py [--batch-sizes 1 8 32] [--prompt-len 64] [--new-tokens 256] [--json out.json]

One random-weight model of GPT-2-small shape (d_model 768, 12 layers, 12 heads, d_ff 2048,
vocab 32000, context 1024) is converted with scratchlm.model.hf into an identical
LlamaForCausalLM, so both sides run the same weights, dtype and greedy decoding of the same
prompts. Prompts in a batch have different lengths (prompt_len down to prompt_len / 2, left
padded). tokens/s counts generated tokens only (batch x new tokens), median of --repeats runs
after a warm-up. "agree" is the fraction of generated tokens equal to Hugging Face's, up to
the first divergence of each row (argmax near-ties flip under different kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from scratchlm.infer.generate import generate
from scratchlm.model.config import ModelConfig
from scratchlm.model.hf import hf_config, to_hf_state_dict
from scratchlm.model.transformer import build_model


def _timed(fn, repeats: int):
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _hf_model(model, cfg, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = {k: v for k, v in hf_config(cfg, dtype=dtype).items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = LlamaForCausalLM(LlamaConfig(**hf_cfg)).to(device="cuda", dtype=dtype).eval()
    hf.load_state_dict(to_hf_state_dict(model.state_dict(), cfg))
    return hf


def _hf_generate(hf, prompts, new_tokens):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, width:].tolist()


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same, total = same + n, total + len(y)
    return same / max(total, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-uncached", action="store_true", help="skip the (slow) recompute-everything path")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32_000, context_length=1024, d_model=768, num_layers=12, num_heads=12, d_ff=2048)
    model = build_model(cfg, device="cuda", dtype=dtype).eval()
    with torch.no_grad():  # sharper next-token distributions, so greedy paths are not near-ties
        model.lm_head.weight.mul_(4)
    hf = _hf_model(model, cfg, dtype)

    rows = []
    gen = torch.Generator().manual_seed(1)
    for B in args.batch_sizes:
        lens = torch.linspace(args.prompt_len, args.prompt_len // 2, B).round().int().tolist()
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
        n_tokens = B * args.new_tokens
        impls = {
            "hf_llama_generate": lambda: _hf_generate(hf, prompts, args.new_tokens),
            "scratchlm_kv_cache": lambda: generate(model, prompts, args.new_tokens, temperature=0),
        }
        if not args.no_uncached:
            impls["scratchlm_no_cache"] = lambda: generate(model, prompts, args.new_tokens, temperature=0, use_kv_cache=False)
        results = {name: _timed(fn, args.repeats) for name, fn in impls.items()}
        ref_time, ref_out = results["hf_llama_generate"]
        for name, (seconds, out) in results.items():
            rows.append({
                "impl": name, "batch": B, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                "dtype": args.dtype, "seconds": seconds, "tokens_per_s": n_tokens / seconds,
                "speed_vs_hf": ref_time / seconds, "agree_with_hf": _agreement(out, ref_out),
            })

    print(f"{'impl':<20} {'batch':>5} {'seconds':>8} {'tok/s':>9} {'vs HF':>6} {'agree':>6}")
    for r in rows:
        print(f"{r['impl']:<20} {r['batch']:>5} {r['seconds']:>8.3f} {r['tokens_per_s']:>9.0f} "
              f"{r['speed_vs_hf']:>6.2f} {r['agree_with_hf']:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
