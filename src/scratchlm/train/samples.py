"""Text samples from the model at the end of training, written to RUN/samples.txt."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from scratchlm.train.config import TrainConfig

log = logging.getLogger("scratchlm.train")

ENDOFTEXT = "<|endoftext|>"


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
    eos_id = _special_id(tokenizer, ENDOFTEXT)
    prompts = list(tc.sample_prompts) or [""]
    generator = torch.Generator(device=device).manual_seed(tc.seed)
    texts = []
    model.eval()
    for prompt in prompts:
        ids = tokenizer.encode(prompt) if prompt else [eos_id if eos_id is not None else 0]
        ids = ids[-(cfg.model.context_length - 1):]
        out = generate(model, ids, max_new_tokens=min(tc.sample_tokens, cfg.model.context_length - len(ids)),
                       temperature=tc.sample_temperature, top_p=tc.sample_top_p, eos_id=eos_id,
                       generator=generator)
        texts.append(prompt + tokenizer.decode(list(out)))
    model.train()
    sep = "\n" + "-" * 72 + "\n"
    (run_dir / "samples.txt").write_text(sep.join(texts) + "\n", encoding="utf-8")
    print(f"samples ({run_dir / 'samples.txt'}):", file=sys.stdout)
    print(sep.join(texts), file=sys.stdout)
    return texts


def _special_id(tokenizer, token: str) -> int | None:
    try:
        ids = tokenizer.encode(token)
    except Exception:
        return None
    return ids[0] if len(ids) == 1 else None
