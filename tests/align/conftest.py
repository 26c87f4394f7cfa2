"""Tiny tokenizer, models and policies shared by the align tests (built in tmp_path, seconds)."""

from __future__ import annotations

import pytest
import torch

from scratchlm.align.prompts import get_template
from scratchlm.align.task import ArithmeticTask




@pytest.fixture(autouse=True)
def _tiny_models_one_thread(one_thread):
    """Every post-training test runs tiny models (see tests/conftest.py's one_thread)."""


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """A BPE tokenizer trained on a few hundred synthetic r1_zero solutions."""
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train import train_bpe

    template = get_template("r1_zero")
    examples = ArithmeticTask(difficulty=1).examples(200)
    text = "\n".join(template.format(e.question) + template.response(e.reasoning, e.answer) for e in examples)
    path = tmp_path_factory.mktemp("tok") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(path, 600, ["<|endoftext|>"])
    return Tokenizer(vocab, merges, ["<|endoftext|>"])


def tiny_model_config(vocab_size: int, context_length: int = 160):
    from scratchlm.model.config import ModelConfig

    return ModelConfig(vocab_size=vocab_size, context_length=context_length, d_model=32, num_layers=1,
                       num_heads=2, d_ff=64)


@pytest.fixture
def tiny_policy(tiny_tokenizer):
    """A randomly initialised one-layer ScratchPolicy."""
    from scratchlm.align.policy import ScratchPolicy
    from scratchlm.model.transformer import build_model

    torch.manual_seed(0)
    cfg = tiny_model_config(tiny_tokenizer.vocab_size)
    return ScratchPolicy(build_model(cfg), tiny_tokenizer, cfg)
