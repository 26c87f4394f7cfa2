"""Stand-ins for HFPolicy tests: a Hugging Face tokenizer of one id per character, and a tiny
random Llama with its policies through the decode engine and through Hugging Face's generate."""

import pytest


class CharTokenizer:
    """Just what HFPolicy uses of a tokenizer: one id per character (ids 1..), eos 0."""

    eos_token_id = pad_token_id = 0
    eos_token = "<eos>"
    padding_side = "left"

    def encode(self, text, add_special_tokens=False):
        return [1 + ord(c) % 40 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("|" if i == 0 else chr(ord("a") + i % 26) for i in ids)


def tiny_llama_policies(num_key_value_heads: int):
    """(hf, engine policy, reference policy): a 2-layer random `LlamaForCausalLM` of 41 tokens with
    its LM head x 8 (confident argmaxes: no greedy near-ties), an `HFPolicy` that decodes through
    the engine and one that uses Hugging Face's generate. Skips the test without transformers."""
    transformers = pytest.importorskip("transformers")
    import torch

    from scratchlm.align.policy import HFPolicy

    config = transformers.LlamaConfig(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=num_key_value_heads,
                                      max_position_embeddings=64, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8)
    return hf, HFPolicy(hf, CharTokenizer()), HFPolicy(hf, CharTokenizer(), use_engine=False)
