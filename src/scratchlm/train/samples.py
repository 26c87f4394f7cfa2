"""Text samples from the model at the end of training, written to RUN/samples.txt."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from scratchlm.fileio import write_text_atomic
from scratchlm.train.config import TrainConfig

log = logging.getLogger("scratchlm.train")

def write_samples(model: torch.nn.Module, cfg: TrainConfig, run_dir: Path, device: torch.device) -> list[str]:
    """Sample `trainer.sample_tokens` tokens after each prompt; print them and save them.

    Needs `scratchlm.infer.generate` and the run's tokenizer copy; without either it logs
    why and returns no samples (sampling is a courtesy, never a reason for a run to fail).
    """
    tc = cfg.trainer
    try:
        from scratchlm.infer.generate import generate
    except ImportError:
        log.warning("scratchlm.infer.generate is not available; skipping samples")
        return []
    tokenizer_dir = run_dir / "tokenizer"
    if not tokenizer_dir.is_dir():
        log.warning("no tokenizer in %s (set data.tokenizer_dir); skipping samples", run_dir)
        return []
    from scratchlm.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(tokenizer_dir)
    eos_id = tokenizer.eot_id
    prompts = list(tc.sample_prompts) or [""]
    # An empty prompt starts a fresh document, as after <|endoftext|> in the training stream.
    start = [eos_id if eos_id is not None else 0]
    rows = [(tokenizer.encode(p) if p else start)[-(cfg.model.context_length // 2):] for p in prompts]
    budget = min(tc.sample_tokens, cfg.model.context_length - max(len(r) for r in rows))
    outs = generate(model, rows, budget, temperature=tc.sample_temperature, top_p=tc.sample_top_p,
                    eos_id=eos_id, seed=tc.seed)
    # Ids of a vocab_size padded above the tokenizer's have no text: U+FFFD, as for invalid UTF-8.
    texts = [prompt + tokenizer.decode([t for t in out if t != eos_id], unknown="\ufffd")
             for prompt, out in zip(prompts, outs)]
    sep = "\n" + "-" * 72 + "\n"
    write_text_atomic(run_dir / "samples.txt", sep.join(texts) + "\n")
    print(f"samples ({run_dir / 'samples.txt'}):", file=sys.stdout)
    print(sep.join(texts), file=sys.stdout)
    return texts
