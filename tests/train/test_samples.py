"""`write_samples`: the text samples a run writes when it ends."""

import torch

from scratchlm.config import load_config
from scratchlm.model.transformer import build_model
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.train.config import TrainConfig
from scratchlm.train.samples import write_samples


def test_samples_of_a_model_with_a_padded_vocabulary(tmp_path):
    # vocab_size padded above the tokenizer's 257 tokens: the untrained model samples ids 257..511,
    # which made decoding raise after the whole run had trained, and the run end without its "end" record.
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(tmp_path / "tokenizer")
    cfg = load_config(TrainConfig, None, [
        "--model.vocab_size=512", "--model.context_length=32", "--model.d_model=32", "--model.num_layers=1",
        "--model.num_heads=4", "--model.d_ff=64", "--trainer.sample_tokens=20", "--trainer.sample_prompts=[\"ab\"]",
        "--trainer.sample_temperature=1", "--trainer.sample_top_p=1"])
    torch.manual_seed(0)
    texts = write_samples(build_model(cfg.model), cfg, tmp_path, torch.device("cpu"))
    assert texts[0].startswith("ab") and "\ufffd" in texts[0]
    assert (tmp_path / "samples.txt").read_text(encoding="utf-8") == texts[0] + "\n"
