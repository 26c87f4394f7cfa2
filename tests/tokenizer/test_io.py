from __future__ import annotations

import json
import random

import pytest

from scratchlm.errors import UserError
from scratchlm.tokenizer.bytes_unicode import BYTE_TO_CHAR, text_to_token, token_to_text
from scratchlm.tokenizer.io import read_merges_txt, read_vocab_json
from scratchlm.tokenizer.tokenizer import Tokenizer

from ._text import random_text
from .conftest import EOT

SAMPLES = [
    "Hello, World!  It's a test.\n\n\tIndented\r\n", "1234567890 3.14 ½", "naïve café 日本語 😀👍🏽",
    "a<|endoftext|>b", "<|endoftext|><|endoftext|>", "   spaces   \n\n\n x", "x\u3000y\xa0z",
]


def test_bytes_unicode_matches_gpt2():
    assert len(set(BYTE_TO_CHAR)) == 256
    assert token_to_text(b" the\n") == "Ġthe\u010a"
    data = bytes(range(256))
    assert text_to_token(token_to_text(data)) == data
    with pytest.raises(ValueError):
        text_to_token("a b")  # a plain space is not in the map
    with pytest.raises(ValueError):
        text_to_token("日")


def test_gpt2_files_round_trip(gpt2_files, gpt2_tokenizer, tmp_path):
    gpt2_tokenizer.save(tmp_path / "gpt2")
    ours = json.loads((tmp_path / "gpt2" / "vocab.json").read_text(encoding="utf-8"))
    assert ours == json.loads(gpt2_files[0].read_text(encoding="utf-8"))
    assert read_merges_txt(tmp_path / "gpt2" / "merges.txt") == read_merges_txt(gpt2_files[1])


def test_save_load_round_trip(trained, tmp_path):
    trained.save(tmp_path / "tok")
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [
        "merges.txt", "special_tokens.json", "tokenizer.json", "vocab.json"]
    loaded = Tokenizer.load(tmp_path / "tok")
    assert loaded.vocab == trained.vocab and loaded.merges == trained.merges
    assert loaded.special_token_ids == trained.special_token_ids and loaded.hash == trained.hash
    for text in SAMPLES:
        assert loaded.encode(text) == trained.encode(text)


def test_hf_tokenizer_json_gives_same_ids(trained, tinystories_text, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    trained.save(tmp_path / "tok")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    rng = random.Random(0)
    texts = SAMPLES + [tinystories_text[:100_000].replace("\n\n", EOT)]
    texts += [random_text(rng, 300, (EOT,)) for _ in range(30)]
    for text in texts:
        ids = trained.encode(text)
        assert hf.encode(text).ids == ids
        assert hf.decode(ids, skip_special_tokens=False) == trained.decode(ids)
    assert hf.token_to_id(EOT) == trained.eot_id


def test_hf_tokenizer_json_for_gpt2(gpt2_tokenizer, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    gpt2_tokenizer.save(tmp_path / "gpt2")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "gpt2" / "tokenizer.json"))
    for text in SAMPLES:
        assert hf.encode(text).ids == gpt2_tokenizer.encode(text)


def test_vocab_and_merges_readable_by_gpt2_tools(trained, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    trained.save(tmp_path / "tok")
    bpe = tokenizers.ByteLevelBPETokenizer(str(tmp_path / "tok" / "vocab.json"),
                                           str(tmp_path / "tok" / "merges.txt"))
    text = "Once upon a time, there was a little girl named Lily."
    assert bpe.encode(text).ids == trained.encode(text)


def test_read_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        Tokenizer.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no vocab.json"):
        Tokenizer.load(tmp_path / "empty")
    bad = tmp_path / "vocab.json"
    bad.write_text("[1, 2]")
    with pytest.raises(UserError, match="JSON object"):
        read_vocab_json(bad)
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        read_vocab_json(bad)
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\na b c\n")
    with pytest.raises(UserError, match="merges.txt:2"):
        read_merges_txt(merges)


def test_a_missing_special_tokens_file_or_cut_merges_are_errors(trained, tmp_path):
    # Both loaded silently: <|endoftext|> was encoded as ordinary text, and the tokens of lost
    # merges were never produced.
    trained.save(tmp_path / "tok")
    (tmp_path / "tok" / "special_tokens.json").unlink()
    with pytest.raises(UserError, match=r"'<\|endoftext\|>' .* special_tokens.json \(missing\) must list it"):
        Tokenizer.load(tmp_path / "tok")
    trained.save(tmp_path / "cut")
    merges = tmp_path / "cut" / "merges.txt"
    merges.write_text("".join(merges.read_text(encoding="utf-8").splitlines(keepends=True)[:-5]), encoding="utf-8")
    with pytest.raises(UserError, match="which no merge in merges.txt makes: merges.txt is incomplete"):
        Tokenizer.load(tmp_path / "cut")
