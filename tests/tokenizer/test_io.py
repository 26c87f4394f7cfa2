from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from scratchlm.errors import UserError
from scratchlm.tokenizer.bytes_unicode import BYTE_TO_CHAR, text_to_token, token_to_text
from scratchlm.tokenizer.io import (
    _hf_document, _vocab_texts, hf_tokenizer_json, read_merges_txt, read_vocab_json,
)
from scratchlm.tokenizer.tokenizer import Tokenizer

from ._text import random_text
from .conftest import EOT, tiktoken_from

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


def test_a_lone_surrogate_in_the_json_files_is_a_user_error(trained, tmp_path):
    # JSON can spell one ("\\udcff"); no UTF-8 text holds one, so the token has no bytes.
    trained.save(tmp_path / "tok")
    specials = tmp_path / "tok" / "special_tokens.json"
    specials.write_text('["<|endoftext|>", "\\udcff"]', encoding="utf-8")
    with pytest.raises(UserError, match=r"special_tokens.json: '\\udcff' is not valid UTF-8 text"):
        Tokenizer.load(tmp_path / "tok")
    vocab = tmp_path / "vocab.json"
    vocab.write_text('{"a": 0, "\\udcff": 1}', encoding="utf-8")
    with pytest.raises(UserError, match=r"vocab.json: '\\udcff' is not valid UTF-8 text"):
        read_vocab_json(vocab)


def test_an_id_beyond_what_a_tokenizer_holds_is_a_user_error(trained, tmp_path):
    # Ids are characters chr(id) inside the Tokenizer: one past 0x10FFFF was an OverflowError.
    vocab = tmp_path / "vocab.json"
    vocab.write_text('{"a": 0, "b": 5000000000}', encoding="utf-8")
    with pytest.raises(UserError, match="id of 'b' must be an integer from 0 to 1,114,111"):
        read_vocab_json(vocab)
    trained.save(tmp_path / "tok")
    specials = tmp_path / "tok" / "special_tokens.json"
    specials.write_text('{"special_tokens": [{"token": "<|endoftext|>", "id": 1114112}]}', encoding="utf-8")
    with pytest.raises(UserError, match=r"id 1114112 of '<\|endoftext\|>' is too large"):
        Tokenizer.load(tmp_path / "tok")


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


# Special tokens whose text is also an ordinary token's vocab.json text: one byte's ("#", "!",
# "a"; "é" is byte 0xe9's text, "Ċ" byte 0x0a's) or a merged token's ("Ġthe" is b" the"'s). The
# one-byte "\n" (byte 0x0a is "Ċ" in vocab.json) and "<|pad|>" share their text with no token.
SHARED_TEXT = ["#", "!", "a", "é", "Ċ", "Ġthe"]
SPECIALS = SHARED_TEXT + ["\n", "<|pad|>"]


def _train_with(special: str, tmp_path) -> Tokenizer:
    from scratchlm.tokenizer.train import train_bpe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text((f"the cat # sat on the mat! the dog ran, café.\nthe end{special}a hat{EOT}") * 40,
                      encoding="utf-8")
    vocab, merges = train_bpe(corpus, 300, [EOT, special], workers=1)
    return Tokenizer(vocab, merges, [EOT, special])


@pytest.mark.parametrize("special", SPECIALS)
def test_special_tokens_sharing_a_tokens_text_round_trip(special, tmp_path):
    tok = _train_with(special, tmp_path)
    assert tok.special_token_ids[special] == max(tok.vocab)  # appended after the bytes and merges
    if special == "Ġthe":
        assert b" the" in tok.vocab.values()
    tok.save(tmp_path / "tok")
    loaded = Tokenizer.load(tmp_path / "tok")
    assert loaded.vocab == tok.vocab and loaded.merges == tok.merges and loaded.vocab_size == tok.vocab_size
    assert loaded.special_token_ids == tok.special_token_ids and loaded.hash == tok.hash
    reference = tiktoken_from(tok)
    rng = random.Random(1)
    texts = SAMPLES + [f"the cat{special}# sat!\nĊ é a the Ġthe{EOT}{special}{special}x"]
    texts += [random_text(rng, 200, (EOT, special, "#", "a", " the")) for _ in range(20)]
    for text in texts:
        ids = loaded.encode(text)
        assert ids == tok.encode(text) == reference.encode(text, allowed_special="all")
        assert loaded.decode(ids) == text
        assert loaded.encode_ordinary(text) == reference.encode_ordinary(text)


@pytest.mark.parametrize("special", SHARED_TEXT)
def test_vocab_json_keeps_the_ordinary_token_and_stays_readable_by_gpt2_tools(special, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = _train_with(special, tmp_path)
    tok.save(tmp_path / "tok")
    written = json.loads((tmp_path / "tok" / "vocab.json").read_text(encoding="utf-8"))
    ordinary = {i for i in tok.vocab if i not in tok.special_token_ids.values()}
    assert set(written.values()) == ordinary | {tok.eot_id}  # the special is in special_tokens.json only
    assert written[special] != tok.special_token_ids[special]
    bpe = tokenizers.ByteLevelBPETokenizer(str(tmp_path / "tok" / "vocab.json"), str(tmp_path / "tok" / "merges.txt"))
    text = "the cat # sat on the mat! café\nthe end a hat"
    assert bpe.encode(text).ids == tok.encode_ordinary(text)


@pytest.mark.parametrize("special", ["\n", "<|pad|>"])
def test_hf_tokenizer_json_of_special_tokens_with_a_text_of_their_own_gives_same_ids(special, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = _train_with(special, tmp_path)
    tok.save(tmp_path / "tok")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    rng = random.Random(2)
    texts = SAMPLES + [random_text(rng, 200, (EOT, special)) for _ in range(20)]
    for text in texts:
        ids = tok.encode(text)
        assert hf.encode(text).ids == ids
        assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids)
    assert hf.token_to_id(special) == tok.special_token_ids[special]


@pytest.mark.parametrize("special", SHARED_TEXT)
def test_no_hf_tokenizer_json_for_a_special_token_sharing_a_tokens_text(special, tmp_path, caplog):
    tokenizers = pytest.importorskip("tokenizers")
    tok = _train_with(special, tmp_path)
    out = tmp_path / "tok"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}", encoding="utf-8")  # an older tokenizer's
    with caplog.at_level("WARNING", logger="scratchlm.tokenizer"):
        tok.save(out)
    assert sorted(p.name for p in out.iterdir()) == ["merges.txt", "special_tokens.json", "vocab.json"]
    assert f"no tokenizer.json written: the special token {special!r} (id {tok.special_token_ids[special]})" \
        in caplog.text
    with pytest.raises(UserError, match="cannot hold apart"):
        hf_tokenizer_json(tok)
    # Why: written anyway, Hugging Face gives the added token the id of the ordinary token with its text.
    texts, _ = _vocab_texts(tok.vocab, tok.special_token_ids)
    hf = tokenizers.Tokenizer.from_str(json.dumps(_hf_document(tok, texts)))
    assert hf.token_to_id(special) == texts[special] != tok.special_token_ids[special]


def test_two_ordinary_tokens_with_the_same_bytes_are_refused_before_anything_is_written(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"ab"}
    tok = Tokenizer(vocab, [(b"a", b"b")], [EOT])
    with pytest.raises(UserError, match=r"ids 256 and 257 of the vocabulary are the same token b'ab'"):
        tok.save(tmp_path / "tok")
    assert not (tmp_path / "tok").exists()


def test_special_tokens_json_that_disagrees_with_vocab_json_is_an_error(trained, tmp_path):
    trained.save(tmp_path / "tok")
    path = tmp_path / "tok" / "special_tokens.json"
    for entries, message in [
        ([{"token": EOT, "id": 5}], r"id 5 is .*, but special_tokens.json gives it to the special token '<\|endoftext"),
        ([{"token": EOT, "id": trained.eot_id}, {"token": "<|pad|>", "id": 99_999}],
         r"has no id 99999, which special_tokens.json gives to '<\|pad\|>'"),
        ([{"token": EOT, "id": trained.eot_id}, {"token": "<|pad|>", "id": trained.eot_id}],
         "two special tokens have the same id"),
        # the list read as one without ids gave <|pad|> the next free id, not the one written
        ([{"token": EOT}, {"token": "<|pad|>", "id": trained.eot_id}], "some special tokens have an id and some do not"),
    ]:
        path.write_text(json.dumps({"special_tokens": entries}), encoding="utf-8")
        with pytest.raises(UserError, match=message):
            Tokenizer.load(tmp_path / "tok")
    path.write_text(json.dumps([EOT]), encoding="utf-8")  # a list of tokens without ids reads as before
    loaded = Tokenizer.load(tmp_path / "tok")
    assert loaded.vocab == trained.vocab and loaded.special_token_ids == trained.special_token_ids


def _small(*merges: tuple[bytes, bytes]) -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)} | {256 + k: a + b for k, (a, b) in enumerate(merges)}
    return Tokenizer(vocab, list(merges), [EOT])


def test_a_save_cut_off_partway_leaves_the_old_tokenizer(tmp_path, monkeypatch):
    # Replaced vocab.json, then stopped: the new vocab.json with the old merges.txt loaded as
    # neither tokenizer (or refused).
    import scratchlm.tokenizer.io as tokenizer_io

    old, new = _small((b"a", b"b")), _small((b"t", b"h"), (b"th", b"e"))
    old.save(tmp_path / "tok")
    (tmp_path / "tok" / "train_bpe.json").write_text("{}\n")
    before = {p.name: p.read_bytes() for p in (tmp_path / "tok").iterdir()}

    def cut(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(tokenizer_io, "write_merges_txt", cut)
    with pytest.raises(OSError, match="No space left"):
        new.save(tmp_path / "tok")
    assert {p.name: p.read_bytes() for p in (tmp_path / "tok").iterdir()} == before
    assert Tokenizer.load(tmp_path / "tok").hash == old.hash
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]  # nothing left beside it
    monkeypatch.undo()
    new.save(tmp_path / "tok")
    assert Tokenizer.load(tmp_path / "tok").hash == new.hash
    assert (tmp_path / "tok" / "train_bpe.json").read_text() == "{}\n"  # what else was there is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


def test_a_save_into_a_directory_holding_a_folder_or_the_working_directory_writes_into_it(tmp_path, monkeypatch):
    old, new = _small((b"a", b"b")), _small((b"t", b"h"))
    (tmp_path / "tok" / "notes").mkdir(parents=True)
    old.save(tmp_path / "tok")
    new.save(tmp_path / "tok")
    assert Tokenizer.load(tmp_path / "tok").hash == new.hash and (tmp_path / "tok" / "notes").is_dir()
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    old.save(".")  # nor is the working directory
    assert Tokenizer.load(tmp_path / "here").hash == old.hash and Path.cwd().samefile(tmp_path / "here")
