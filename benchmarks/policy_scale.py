"""Post-training a real-sized Hugging Face policy: SFT and GRPO steps of a Qwen2 model on GSM8K.

    python benchmarks/policy_scale.py --shape qwen2.5-math-1.5b --data-dir ../shared/data --out policy_scale.json

No hub is reachable, so the model is a random-init `Qwen2ForCausalLM` of the real shape
(Qwen2.5-Math-1.5B: vocab 151,936, d_model 1536, 28 layers, 12 query / 2 key-value heads,
d_ff 8960, tied embeddings; or Qwen2.5-0.5B), with a BPE tokenizer trained here on the GSM8K
training text and loaded through `transformers.PreTrainedTokenizerFast`. It runs the code paths a
user with the real weights runs (`scratchlm.align.policy.HFPolicy`, `sft_train`, `grpo_train`):

- SFT: optimizer steps on GSM8K worked solutions in the r1_zero format (micro-batch x accumulation),
  with and without activation checkpointing: seconds per step and peak GPU memory.
- GRPO: steps of --questions x --group rollouts of up to --new-tokens tokens (random weights
  rarely sample the end token, so rollouts run to the limit), on-policy update: seconds per step,
  rollout tokens/s, peak memory.
- Rollouts alone: the same prompts sampled with the scratchlm decoding engine (through the
  Qwen2 bridge) and with the model's own `generate`, tokens/s side by side.

Parameters and AdamW state are float32, compute is bf16 autocast, as `scratchlm sft|grpo` run
a Hugging Face policy.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from scratchlm.bench.results import environment, write_json

SHAPES = {
    "qwen2.5-math-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                              rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
}


def gsm8k_tokenizer(examples, vocab_size: int, out: Path):
    """A byte-level BPE trained on the GSM8K text, as a `PreTrainedTokenizerFast`."""
    from transformers import PreTrainedTokenizerFast

    from scratchlm.tokenizer import Tokenizer, train_bpe

    text = out / "gsm8k.txt"
    text.write_text("<|endoftext|>".join(e.question + "\n" + e.reasoning + "\n" + e.answer for e in examples))
    vocab, merges = train_bpe(text, vocab_size, ["<|endoftext|>"])
    Tokenizer(vocab, merges, ["<|endoftext|>"]).save(out / "tokenizer")
    return PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer" / "tokenizer.json"),
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def set_checkpointing(model, on: bool) -> None:
    """Activation checkpointing of a transformers model on or off (the method's newer name when it has it)."""
    name = "activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") else "gradient_checkpointing"
    getattr(model, f"{name}_{'enable' if on else 'disable'}")()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-math-1.5b")
    p.add_argument("--data-dir", default="../shared/data", help="folder holding gsm8k/train.jsonl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sft-steps", type=int, default=3, help="timed SFT steps (after one warm-up step)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--questions", type=int, default=8, help="GRPO questions per step")
    p.add_argument("--group", type=int, default=8, help="GRPO samples per question")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--grpo-steps", type=int, default=2, help="timed GRPO steps (after one warm-up step)")
    p.add_argument("--tokenizer-vocab", type=int, default=8192)
    p.add_argument("--out", help="write the results to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from scratchlm.align.config import GRPOConfig, OptimConfig, SamplingConfig, SFTConfig
    from scratchlm.align.datasets import load_examples
    from scratchlm.align.grpo import grpo_train
    from scratchlm.align.policy import HFPolicy
    from scratchlm.align.prompts import get_template
    from scratchlm.align.sft import sft_train

    device = torch.device(args.device)
    torch.manual_seed(0)
    examples = load_examples("gsm8k", "train", data_dir=args.data_dir)
    tmp = Path(tempfile.mkdtemp(prefix="policy_scale_"))
    tokenizer = gsm8k_tokenizer(examples, args.tokenizer_vocab, tmp)
    shape = SHAPES[args.shape]
    with torch.device(device):  # random init on the GPU: seconds, not minutes
        model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=False))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    n_params = sum(p.numel() for p in model.parameters())
    policy = HFPolicy(model, tokenizer)
    template = get_template("r1_zero")
    pairs = [(template.format(e.question), template.response(e.reasoning, e.answer)) for e in examples[:2000]]
    results = {**environment(), "shape": args.shape, "config": shape, "parameters": n_params, "rows": []}
    print(f"{args.shape}: {n_params / 1e9:.2f}B parameters on {results['device']}", flush=True)

    def save() -> None:
        if args.out:
            write_json(args.out, results)

    optim = OptimConfig(lr=1e-6)
    for checkpointing in (False, True):
        set_checkpointing(model, checkpointing)
        sft = SFTConfig(micro_batch_size=args.micro_batch, grad_accum_steps=args.accum, max_steps=1, log_every=1000)
        try:
            sft_train(policy, pairs[: args.micro_batch * args.accum], sft=sft, optim=optim)  # warm-up
            reset_peak()
            sft.max_steps = args.sft_steps
            seconds, history = timed(lambda: sft_train(policy, pairs, sft=sft, optim=optim, seed=1))
            row = {"stage": "sft", "activation_checkpointing": checkpointing,
                   "sequences_per_step": args.micro_batch * args.accum, "seconds_per_step": seconds / args.sft_steps,
                   "peak_gib": peak_gib(), "loss": history[-1]["loss"]}
        except torch.cuda.OutOfMemoryError as e:
            row = {"stage": "sft", "activation_checkpointing": checkpointing, "error": f"out of memory: {e}"[:200]}
            torch.cuda.empty_cache()
        results["rows"].append(row)
        print(row, flush=True)
        save()
    set_checkpointing(model, True)

    rollouts = args.questions * args.group
    grpo = GRPOConfig(n_grpo_steps=1, rollout_batch_size=rollouts, group_size=args.group, train_batch_size=rollouts,
                      grad_accum_steps=rollouts // 4, eval_every=0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, batch_size=rollouts)
    train = examples[2000:]
    grpo_train(policy, train, template=template, reward_fn="r1_zero", grpo=grpo, optim=optim, sampling=sampling)
    reset_peak()
    grpo.n_grpo_steps = args.grpo_steps
    seconds, history = timed(lambda: grpo_train(policy, train, template=template, reward_fn="r1_zero", grpo=grpo,
                                                optim=optim, sampling=sampling, seed=1))
    engine = policy._twin not in (None, False)
    row = {"stage": "grpo", "rollouts_per_step": rollouts, "max_new_tokens": args.new_tokens,
           "seconds_per_step": seconds / args.grpo_steps, "peak_gib": peak_gib(),
           "rollout_tokens_per_s": sum(h["rollout_tokens_per_s"] for h in history) / len(history),
           "response_tokens_mean": sum(h["response_tokens_mean"] for h in history) / len(history),
           "rollouts_through": "scratchlm engine" if engine else "transformers generate"}
    results["rows"].append(row)
    print(row, flush=True)
    save()

    prompts = [template.format(e.question) for e in train[: args.questions] for _ in range(args.group)]
    for use_engine in (True, False):
        policy.use_engine = use_engine
        run = lambda: policy.generate(prompts, max_new_tokens=args.new_tokens, temperature=1.0, seed=0,  # noqa: E731
                                      batch_size=rollouts)
        run()  # warm-up: capture / compile
        seconds, completions = timed(run)
        tokens = sum(c.num_tokens for c in completions)
        path = "scratchlm engine" if use_engine and policy._twin not in (None, False) else "transformers generate"
        row = {"stage": "rollouts", "through": path, "prompts": len(prompts), "tokens": tokens,
               "seconds": seconds, "tokens_per_s": tokens / seconds}
        results["rows"].append(row)
        print(row, flush=True)
    rates = [r["tokens_per_s"] for r in results["rows"] if r["stage"] == "rollouts"]
    if len(rates) == 2:
        results["engine_vs_generate"] = rates[0] / rates[1]
        print(f"rollouts: engine / generate = {rates[0] / rates[1]:.2f}x", flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
