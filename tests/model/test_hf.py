"""Hugging Face Llama bridge: same logits as LlamaForCausalLM, round trips, export directory."""

from __future__ import annotations

import json

import pytest
import torch

from scratchlm.errors import UserError
from scratchlm.model.config import ModelConfig
from scratchlm.model.hf import (
    check_exportable,
    export_hf,
    from_hf_state_dict,
    half_to_interleaved,
    hf_config,
    interleaved_to_half,
    model_config_from_hf,
    to_hf_state_dict,
)
from scratchlm.model.transformer import build_model

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=101, context_length=32, d_model=48, num_layers=2, num_heads=4, d_ff=80, rope_theta=500.0)


def _model(seed: int = 0, **kwargs):
    cfg = ModelConfig(**TINY, **kwargs)
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():  # RMSNorm weights start at 1; make them matter
        for name, p in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.uniform_(0.5, 1.5)
    return model.eval(), cfg


def _llama(cfg, state):
    config = transformers.LlamaConfig(**hf_config(cfg))
    config._attn_implementation = "eager"
    llama = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = llama.load_state_dict(state, strict=False)
    assert not unexpected
    assert all(k == "lm_head.weight" for k in missing) and (not missing or cfg.tie_embeddings)
    if cfg.tie_embeddings:
        assert llama.lm_head.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()
    return llama


def test_rope_permutation_is_the_documented_order_and_inverts():
    w = torch.arange(2 * 6, dtype=torch.float32)[:, None].repeat(1, 3)  # 2 heads of 6 rows
    half = interleaved_to_half(w, num_heads=2)
    assert half[:, 0].tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]
    torch.testing.assert_close(half_to_interleaved(half, num_heads=2), w)
    with pytest.raises(ValueError):
        interleaved_to_half(torch.zeros(10, 3), num_heads=2)  # odd head size


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_llama(tie):
    model, cfg = _model(tie_embeddings=tie)
    llama = _llama(cfg, to_hf_state_dict(model.state_dict(), cfg))
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.context_length))
    with torch.no_grad():
        ours = model(ids)
        theirs = llama(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_logits_differ_without_the_permutation():
    # Guards the test above: the permutation is needed (so the comparison can fail).
    model, cfg = _model()
    state = to_hf_state_dict(model.state_dict(), cfg)
    for key in list(state):
        if key.endswith(("q_proj.weight", "k_proj.weight")):
            state[key] = half_to_interleaved(state[key], cfg.num_heads)
    llama = _llama(cfg, state)
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.context_length))
    with torch.no_grad():
        assert (model(ids) - llama(input_ids=ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip(tie):
    model, cfg = _model(seed=1, tie_embeddings=tie)
    sd = model.state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, cfg), cfg)
    assert set(sd) <= set(back)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    # From a Hugging Face model into a fresh scratchlm model: same logits.
    llama = _llama(cfg, to_hf_state_dict(sd, cfg))
    cfg2 = model_config_from_hf(llama.config.to_dict())
    assert cfg2 == cfg
    fresh = build_model(cfg2).eval()
    fresh.load_state_dict(from_hf_state_dict(llama.state_dict(), cfg2))
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs", [dict(norm_position="post"), dict(use_rmsnorm=False), dict(use_rope=False), dict(ffn="silu"),
                dict(ffn="relu2"), dict(logit_softcap=15.0)]
)
def test_non_llama_variants_refused(kwargs, tmp_path):
    model, cfg = _model(**kwargs)
    with pytest.raises(UserError, match="default Llama architecture"):
        check_exportable(cfg)
    with pytest.raises(UserError):
        export_hf(model, cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


class _FakeTokenizer:
    """Writes a byte-level BPE tokenizer.json like the scratchlm Tokenizer directory holds."""

    def __init__(self, vocab_size: int) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tok.train_from_iterator(["the cat sat on the mat", "a dog ate the hat"] * 20, trainer)
        self.hf = tok

    def save(self, directory) -> None:
        self.hf.save(f"{directory}/tokenizer.json")


def test_export_directory_loads_in_transformers(tmp_path):
    model, cfg = _model(seed=2)
    tok = _FakeTokenizer(cfg.vocab_size)
    out = tmp_path / "hf"
    written = export_hf(model, cfg, out, tokenizer=tok)
    names = {p.name for p in written}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    eos = tok.hf.token_to_id("<|endoftext|>")
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == eos
    assert config["num_key_value_heads"] == cfg.num_heads and config["max_position_embeddings"] == cfg.context_length

    llama = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(llama(input_ids=ids).logits, model(ids), rtol=1e-5, atol=1e-5)

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "the cat ate the hat<|endoftext|>a dog"
    assert hf_tok(text)["input_ids"] == tok.hf.encode(text).ids
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == eos


# ---------------------------------------------------------------- `scratchlm export`


def _run_dir(tmp_path, model, cfg, tokenizer=None):
    from scratchlm.config import config_to_toml
    from scratchlm.train.checkpoint import save_run_checkpoint
    from scratchlm.train.config import TrainConfig

    run = tmp_path / "run"
    save_run_checkpoint(run, 7, model_state=model.state_dict(), optimizer_state=None, state={"step": 7},
                        config_text=config_to_toml(TrainConfig(model=cfg)), keep=1)
    if tokenizer is not None:
        tokenizer.save(run / "tokenizer")
    return run


def _cli(args: list[str]) -> int:
    from scratchlm.cli import main

    return main(["export", *args])


def test_export_command_from_single_file_checkpoint(tmp_path):
    from scratchlm.train.checkpoint import save_checkpoint

    model, cfg = _model(seed=3, tie_embeddings=True)
    ckpt = tmp_path / "model.pt"
    save_checkpoint(model, torch.optim.SGD(model.parameters(), lr=0.1), 5, ckpt, model_config=cfg)
    out = tmp_path / "hf"
    assert _cli([str(ckpt), "--to", "hf", str(out)]) == 0
    llama = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert llama.config.tie_word_embeddings
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(llama(input_ids=ids).logits, model(ids), rtol=1e-5, atol=1e-5)


def test_export_command_refuses(tmp_path, capsys):
    model, cfg = _model(seed=4)
    run = _run_dir(tmp_path, model, cfg)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert _cli([str(run), "--to", "hf", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert _cli([str(run), "--to", "hf", str(out), "--overwrite"]) == 0
    assert (out / "keep.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
    assert _cli([str(tmp_path / "missing"), "--to", "hf", str(tmp_path / "x")]) == 2
    capsys.readouterr()
    post, post_cfg = _model(norm_position="post")
    post_run = _run_dir(tmp_path / "post", post, post_cfg)
    assert _cli([str(post_run), "--to", "hf", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scratchlm export: error: only the default Llama architecture") and "Traceback" not in err
    (tmp_path / "loop").symlink_to("loop")  # a link to itself: an OSError after the model had loaded
    for bad in (tmp_path / "loop", tmp_path / "loop" / "hf"):
        assert _cli([str(run), "--to", "hf", str(bad)]) == 2
        assert "Too many levels of symbolic links" in capsys.readouterr().err


def test_an_export_that_fails_midway_leaves_no_partial_files(tmp_path, capsys, monkeypatch):
    import errno

    import safetensors.torch

    model, cfg = _model(seed=4)
    run = _run_dir(tmp_path, model, cfg)

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    out = tmp_path / "hf"
    assert _cli([str(run), "--to", "hf", str(out)]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "\n" not in err.strip()
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "keep.txt").write_text("mine")
    assert _cli([str(run), "--to", "hf", str(kept), "--overwrite"]) == 1
    assert sorted(p.name for p in kept.iterdir()) == ["keep.txt"]


def test_export_command_refuses_to_write_into_a_checkpoint(tmp_path, capsys):
    from scratchlm.train.checkpoint import load_trained_model

    model, cfg = _model(seed=4)
    step = _run_dir(tmp_path, model, cfg) / "checkpoints" / "step_000007"
    weights = (step / "model.safetensors").read_bytes()
    # The step directory as both source and OUT: --overwrite would replace its weights with HF ones.
    assert _cli([str(step), "--to", "hf", str(step), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "is a scratchlm checkpoint" in err and "\n" not in err.strip()
    assert (step / "model.safetensors").read_bytes() == weights and not (step / "config.json").exists()
    load_trained_model(step)  # still intact


def test_export_command_refuses_to_write_into_a_run_directory(tmp_path, capsys):
    from scratchlm.train.checkpoint import load_trained_model

    model, cfg = _model(seed=4)
    run = _run_dir(tmp_path, model, cfg)
    # With --overwrite the HF weights landed in RUN/, which then read as a broken step directory.
    assert _cli([str(run), "--to", "hf", str(run), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "is a scratchlm run directory" in err and "\n" not in err.strip()
    assert not (run / "model.safetensors").exists() and not (run / "config.json").exists()
    load_trained_model(run)  # still the run's latest checkpoint


def test_export_command_run_dir_with_tokenizer(tmp_path):
    tokenizer_mod = pytest.importorskip("scratchlm.tokenizer.tokenizer")
    from scratchlm.tokenizer.train import train_bpe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a cat.<|endoftext|>The cat sat on a mat, happily!\n" * 30)
    vocab, merges = train_bpe(corpus, 300, ["<|endoftext|>"])
    tok = tokenizer_mod.Tokenizer(vocab, merges, ["<|endoftext|>"])
    model, cfg = _model_with_vocab(len(vocab))
    run = _run_dir(tmp_path, model, cfg, tokenizer=tok)
    out = tmp_path / "hf"
    assert _cli([str(run), "--to", "hf", str(out)]) == 0

    text = "Once upon a time, the cat sat.<|endoftext|>A mat! 123  spaces\n"
    ids = tok.encode(text)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids) == text
    eos = tok.encode("<|endoftext|>")
    assert [hf_tok.eos_token_id] == [hf_tok.bos_token_id] == eos
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    assert fast(text)["input_ids"] == ids

    llama = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert llama.generation_config.eos_token_id == eos[0]
    x = torch.tensor([ids[: cfg.context_length]])
    with torch.no_grad():
        torch.testing.assert_close(llama(input_ids=x).logits, model(x), rtol=1e-5, atol=1e-5)


def test_export_refuses_a_tokenizer_that_a_tokenizer_json_cannot_hold(tmp_path, capsys):
    # The special token "#" (the last id) has the text of the byte token "#" (id 35): Hugging Face
    # would map the special token to id 35.
    tokenizer_mod = pytest.importorskip("scratchlm.tokenizer.tokenizer")
    from scratchlm.tokenizer.train import train_bpe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a cat.#The cat sat on a mat, happily!\n" * 30)
    vocab, merges = train_bpe(corpus, 300, ["#"])
    tok = tokenizer_mod.Tokenizer(vocab, merges, ["#"])
    special_id = tok.special_token_ids["#"]
    assert special_id == max(tok.vocab) > 255
    model, cfg = _model_with_vocab(len(vocab))
    run = _run_dir(tmp_path, model, cfg, tokenizer=tok)
    out = tmp_path / "hf"
    assert _cli([str(run), "--to", "hf", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"scratchlm export: error: cannot export the tokenizer: the special token '#' (id {special_id}) has the "
        "text of token 35, which a Hugging Face tokenizer.json cannot hold apart\n")
    assert not out.exists()
    with pytest.raises(UserError, match="the tokenizer did not write a tokenizer.json"):
        export_hf(model, cfg, out, tokenizer=tok)


def _model_with_vocab(vocab_size: int):
    cfg = ModelConfig(**{**TINY, "vocab_size": vocab_size})
    torch.manual_seed(5)
    return build_model(cfg).eval(), cfg


# ---------------------------------------------------------------- GQA and Qwen2


def _randomize_hf(model, seed: int):
    # Hugging Face starts norms at one, biases at zero and weights small; make every parameter matter.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:  # far from the 0.02 init, so that attention moves the logits
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.eval()


def _from_hf(hf_model):
    cfg = model_config_from_hf(hf_model.config.to_dict())
    ours = build_model(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf_model.state_dict(), cfg))
    return ours, cfg


def test_gqa_logits_match_llama_both_ways():
    model, cfg = _model(seed=6, num_kv_heads=2)
    assert model.layers[0].attn.k_proj.weight.shape == (2 * 12, cfg.d_model)
    state = to_hf_state_dict(model.state_dict(), cfg)
    llama = _llama(cfg, state)
    assert llama.config.num_key_value_heads == 2
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.context_length))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), llama(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert model_config_from_hf(llama.config.to_dict()) == cfg
    back = from_hf_state_dict(state, cfg)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_gqa_llama_import_from_a_hugging_face_model():
    torch.manual_seed(7)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=40,
                                      rope_theta=1000.0, rms_norm_eps=1e-6)
    config._attn_implementation = "eager"
    llama = _randomize_hf(transformers.LlamaForCausalLM(config), 7)
    ours, cfg = _from_hf(llama)
    assert cfg.num_kv_heads == 2 and not cfg.qkv_bias
    ids = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def _qwen2(seed: int = 8, **kwargs):
    torch.manual_seed(seed)
    options = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, max_position_embeddings=48, rope_theta=1e6, rms_norm_eps=1e-6,
                   tie_word_embeddings=True)
    config = transformers.Qwen2Config(**{**options, **kwargs})
    config._attn_implementation = "eager"
    return _randomize_hf(transformers.Qwen2ForCausalLM(config), seed)


@pytest.mark.parametrize("tie", [True, False])
def test_qwen2_logits_match(tie):
    qwen = _qwen2(tie_word_embeddings=tie)
    ours, cfg = _from_hf(qwen)
    assert (cfg.qkv_bias, cfg.num_kv_heads, cfg.tie_embeddings, cfg.rope_theta, cfg.rmsnorm_eps) == (
        True, 2, tie, 1e6, 1e-6)
    assert cfg.sliding_window is None
    assert "layers.0.attn.k_proj.bias" in ours.state_dict()
    ids = torch.randint(0, 97, (3, 48))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), qwen(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_qwen2_sliding_window_matches_and_mixed_layers_are_refused():
    qwen = _qwen2(seed=9, use_sliding_window=True, sliding_window=6, max_window_layers=0)
    ours, cfg = _from_hf(qwen)
    assert cfg.sliding_window == 6
    ids = torch.randint(0, 97, (2, 30))
    with torch.no_grad():
        theirs = qwen(input_ids=ids).logits
        torch.testing.assert_close(ours(ids), theirs, rtol=1e-5, atol=1e-5)
        # the window matters at this length: without it the logits differ
        full = build_model(ModelConfig(**{**vars(cfg), "sliding_window": None})).eval()
        full.load_state_dict(ours.state_dict())
        assert (full(ids) - theirs).abs().max() > 1e-3
    mixed = _qwen2(seed=9, use_sliding_window=True, sliding_window=6, max_window_layers=1).config.to_dict()
    with pytest.raises(UserError, match="max_window_layers"):
        model_config_from_hf(mixed)
    # a window that no layer uses is no window
    unused = _qwen2(seed=9, use_sliding_window=True, sliding_window=6, max_window_layers=2).config.to_dict()
    assert model_config_from_hf(unused).sliding_window is None


@pytest.mark.parametrize("kwargs", [dict(qk_norm=True), dict(sliding_window=8), dict(qkv_bias=True)])
def test_attention_variants_llama_lacks_are_refused(kwargs):
    with pytest.raises(UserError, match="default Llama architecture"):
        check_exportable(ModelConfig(**TINY, **kwargs))


def test_rope_permutation_of_a_bias_follows_its_rows():
    w = torch.randn(2 * 6, 5)
    b = torch.randn(2 * 6)
    torch.testing.assert_close(interleaved_to_half(b, 2), interleaved_to_half(b[:, None], 2)[:, 0])
    torch.testing.assert_close(half_to_interleaved(interleaved_to_half(b, 2), 2), b)
    assert interleaved_to_half(w, 2).shape == w.shape
