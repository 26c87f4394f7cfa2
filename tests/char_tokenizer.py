"""A stand-in for a Hugging Face tokenizer in HFPolicy tests: one id per character."""


class CharTokenizer:
    """Just what HFPolicy uses of a tokenizer: one id per character (ids 1..), eos 0."""

    eos_token_id = pad_token_id = 0
    eos_token = "<eos>"
    padding_side = "left"

    def encode(self, text, add_special_tokens=False):
        return [1 + ord(c) % 40 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("|" if i == 0 else chr(ord("a") + i % 26) for i in ids)
