"""`scratchlm generate`: sample completions from a trained run or checkpoint."""

from __future__ import annotations

import argparse
import math
import sys
import time

from scratchlm.errors import UserError

EOT = "<|endoftext|>"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scratchlm generate",
        description="Continue text prompts with a trained model (a run directory, a step directory or a checkpoint file).",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="run directory, step directory or checkpoint file")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for a batch (default: one unconditional sample)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate per prompt (default 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0 disables (default 50)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass; 1 disables (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole window at every step")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step before its CUDA graph is captured (GPU; slower start)")
    p.add_argument("--fused-blocks", action=argparse.BooleanOptionalAction, default=None,
                   help="run each block's norms, SwiGLU gate and residual adds inside its matmul kernels at up to "
                        "8 prompts (GPU, Triton; docs/benchmarks/generate.md). Default: on with --compile at up to "
                        "8 prompts where Triton runs")
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="with --compile and fused blocks, launch a one-prompt step's kernels with programmatic "
                        "dependent launch (Hopper GPUs or later; 1.07x on an H100, docs/benchmarks/generate.md). "
                        "Default: on where the fused blocks are and the GPU supports it")
    p.add_argument("--device", default="auto", help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:1, mps ...")
    p.add_argument("--dtype", type=_dtype_arg, default="auto",
                   help="weights and activations: auto, bf16, fp32 or fp16 (bfloat16, float32, float16 also work); "
                        "auto is bf16 on cuda, fp32 elsewhere")
    return p


def _dtype_arg(name: str) -> str:
    """A --dtype value: auto, or a dtype name in either spelling, made canonical (bf16, fp32, fp16)."""
    from scratchlm.dtypes import canonical_dtype

    if name == "auto":
        return name
    try:
        return canonical_dtype(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _check_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature must be a number >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise UserError(f"--top-k must be >= 0, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 2**32:
        raise UserError(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.pdl and not args.compile:
        raise UserError("--pdl needs --compile")
    if args.pdl and args.fused_blocks is False:
        raise UserError("--pdl needs the fused blocks: drop --no-fused-blocks")


def check_tokenizer_fits(tokenizer, vocab_size: int, source: str) -> None:
    """Refuse the tokenizer found beside `source` when it has more tokens than the model has
    embedding rows: its ids past vocab_size would index beyond them."""
    if tokenizer.vocab_size > vocab_size:
        raise UserError(f"the tokenizer beside {source} has {tokenizer.vocab_size} tokens, more than the "
                        f"model's vocab_size={vocab_size}: it is not the tokenizer the model was trained with")


def _warn_if_context_cuts(prompts: list[list[int]], args: argparse.Namespace, context_length: int) -> None:
    """With the KV cache a sample stops at the context length: say so before generating."""
    longest = max(len(ids) for ids in prompts)
    if args.no_kv_cache or longest + args.max_new_tokens <= context_length:
        return
    room = context_length - longest
    print(f"note: --max-new-tokens {args.max_new_tokens} does not fit context_length={context_length} "
          f"after a {longest}-token prompt: samples stop after {room} new tokens "
          "(--no-kv-cache slides the window instead)", file=sys.stderr)


def _note_if_blocks_unfused(args, device, n_prompts: int) -> None:
    """--fused-blocks where it cannot take effect: say so rather than ignore it silently."""
    from scratchlm.kernels.decode_linear_triton import MAX_ROWS
    from scratchlm.kernels.triton_support import triton_available

    why = ("it needs a CUDA device" if device.type != "cuda" else "it needs triton" if not triton_available()
           else "it needs the KV cache" if args.no_kv_cache
           else f"it takes at most {MAX_ROWS} prompts at once, not {n_prompts}" if n_prompts > MAX_ROWS else None)
    if why is not None:
        print(f"note: --fused-blocks has no effect here ({why}); the blocks run module by module", file=sys.stderr)


def _note_if_not_compiled(args, device) -> None:
    """--compile where it cannot take effect (the engine compiles its CUDA steps only): say so."""
    why = ("it needs a CUDA device" if device.type != "cuda"
           else "it needs the KV cache" if args.no_kv_cache else None)
    if why is not None:
        print(f"note: --compile has no effect here ({why}); the model runs eagerly", file=sys.stderr)


def note_if_greedy(args: argparse.Namespace, parser: argparse.ArgumentParser,
                   names: tuple[str, ...] = ("top_k", "top_p", "seed")) -> None:
    """Sampling options `names` of `parser` (--top-k, --top-p, --seed) given with --temperature 0:
    greedy decoding takes the most likely token, which none of them changes; say so rather than
    ignore them silently. `scratchlm generate` and `scratchlm eval-math` call it."""
    if args.temperature != 0:
        return
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) != parser.get_default(name)]
    if given:
        print(f"note: {', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect here (--temperature 0 "
              "decodes greedily: the most likely token every step)", file=sys.stderr)


def _check_pdl(device) -> None:
    """--pdl where the kernels cannot be launched with it: a one-line error (the engine would refuse)."""
    import torch

    from scratchlm.kernels.triton_support import pdl_supported

    if device.type != "cuda" or not pdl_supported(torch.empty(0, device=device)):
        raise UserError(f"--pdl needs a CUDA GPU of compute capability 9 or more (Hopper or later) and a Triton "
                        f"with grid dependency control; this run is on {device}")


def generate_command(argv: list[str]) -> int:
    """Load the model and tokenizer, generate for each --prompt, print completions and speed."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(args)
    note_if_greedy(args, parser)
    from scratchlm.device import resolve_device
    from scratchlm.dtypes import torch_dtype
    from scratchlm.infer.generate import generate
    from scratchlm.train.checkpoint import load_trained_model

    device = resolve_device(args.device)
    model, cfg, tokenizer = load_trained_model(args.checkpoint, device)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    model.to(torch_dtype(dtype))
    if tokenizer is None:
        raise UserError(f"{args.checkpoint} has no tokenizer/ directory beside it, so text prompts cannot be encoded")
    check_tokenizer_fits(tokenizer, cfg.vocab_size, args.checkpoint)
    eos_id = getattr(tokenizer, "special_token_ids", {}).get(EOT)
    texts = args.prompt if args.prompt is not None else [""]
    prompts = []
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes of another encoding on the command line
            raise UserError(f"--prompt {ascii(text)} is not valid UTF-8 text") from None
        ids = tokenizer.encode(text)
        if not ids:
            if eos_id is None:
                raise UserError(f"an empty prompt needs the tokenizer to have {EOT} to start from")
            ids = [eos_id]
        if not args.no_kv_cache and len(ids) >= cfg.context_length and args.max_new_tokens > 0:
            raise UserError(
                f"a prompt of {len(ids)} tokens leaves no room in context_length={cfg.context_length}; "
                "shorten it or pass --no-kv-cache (which slides the window)"
            )
        prompts.append(ids)
    _warn_if_context_cuts(prompts, args, cfg.context_length)
    if args.compile:
        _note_if_not_compiled(args, device)
    if args.fused_blocks or args.pdl:
        _note_if_blocks_unfused(args, device, len(prompts))
    if args.pdl:
        _check_pdl(device)

    start = time.perf_counter()
    outs = generate(
        model,
        prompts,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p if args.top_p < 1 else None,
        eos_id=eos_id,
        use_kv_cache=not args.no_kv_cache,
        seed=args.seed,
        compile=args.compile,
        # --pdl launches the fused blocks' kernels, so it asks for them
        fused_blocks="auto" if args.fused_blocks is None and not args.pdl else bool(args.fused_blocks or args.pdl),
        pdl="auto" if args.pdl is None else args.pdl,
    )
    seconds = time.perf_counter() - start
    total = sum(len(o) for o in outs)
    # A model's vocab_size may be padded above the tokenizer's: ids of those rows have no text.
    outside = sum(t not in tokenizer.vocab for out in outs for t in out)
    if outside:
        print(f"note: {outside} sampled token(s) are ids the tokenizer ({tokenizer.vocab_size} tokens) does not "
              f"have (the model's vocab_size is {cfg.vocab_size}); each is shown as U+FFFD", file=sys.stderr)
    for i, (text, out) in enumerate(zip(texts, outs)):
        completion = out[:-1] if out and out[-1] == eos_id else out
        print(f"--- sample {i + 1}/{len(outs)} ({len(out)} tokens) ---")
        print(text + tokenizer.decode(completion, unknown="\ufffd"))
    cache = "off" if args.no_kv_cache else "on"
    print(f"--- {total} tokens in {seconds:.2f} s: {total / max(seconds, 1e-9):.1f} tokens/s "
          f"(device {device}, {dtype}, batch {len(prompts)}, KV cache {cache}) ---")
    return 0
