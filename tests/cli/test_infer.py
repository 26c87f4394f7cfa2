import re

import pytest
import torch

from scratchlm.errors import UserError
from scratchlm.cli.infer import generate_command
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import build_model

checkpoint = pytest.importorskip("scratchlm.train.checkpoint")
tokenizer_mod = pytest.importorskip("scratchlm.tokenizer.tokenizer")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    tok = tokenizer_mod.Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tok.save(tmp_path / "tokenizer")
    cfg = ModelConfig(vocab_size=257, context_length=32, d_model=32, num_layers=2, num_heads=4, d_ff=64)
    model = build_model(cfg)
    path = tmp_path / "model.pt"
    checkpoint.save_checkpoint(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, path)
    return path


def test_generate_command_prints_completions(ckpt, capsys):
    rc = generate_command([str(ckpt), "--prompt", "ab", "--prompt", "hello", "--max-new-tokens", "5",
                           "--temperature", "0", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "sample 1/2" in out and "sample 2/2" in out and "tokens/s" in out
    lines = out.splitlines()
    assert lines[1].startswith("ab") and lines[3].startswith("hello")
    assert "fp32" in lines[-1]  # dtypes are printed by their canonical names


@pytest.mark.parametrize("spelling", ["bfloat16", "bf16"])
def test_generate_command_bfloat16(ckpt, capsys, spelling):
    assert generate_command([str(ckpt), "--max-new-tokens", "4", "--dtype", spelling, "--device", "cpu"]) == 0
    assert "bf16, batch" in capsys.readouterr().out


def test_generate_command_rejects_an_unknown_dtype(ckpt, capsys):
    with pytest.raises(SystemExit):
        generate_command([str(ckpt), "--dtype", "int8", "--device", "cpu"])
    assert "unknown dtype 'int8'" in capsys.readouterr().err


def test_cached_and_uncached_commands_agree(ckpt, capsys):
    base = [str(ckpt), "--prompt", "xyz", "--max-new-tokens", "6", "--seed", "3", "--device", "cpu"]
    generate_command(base)
    cached = capsys.readouterr().out.splitlines()[:2]
    generate_command(base + ["--no-kv-cache"])
    uncached = capsys.readouterr().out.splitlines()[:2]
    assert cached == uncached


def test_fused_blocks_reach_the_engine_and_keep_the_completions(ckpt, capsys, monkeypatch):
    from scratchlm.infer import engine as engine_module

    built = []
    init = engine_module.DecodeEngine.__init__

    def recording(self, *args, **kwargs):
        built.append(kwargs.get("fused_blocks"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(engine_module.DecodeEngine, "__init__", recording)
    base = [str(ckpt), "--prompt", "xyz", "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"]
    generate_command(base)
    plain = capsys.readouterr().out.splitlines()[:2]
    generate_command(base + ["--fused-blocks"])
    captured = capsys.readouterr()
    assert captured.out.splitlines()[:2] == plain  # on the CPU the blocks run module by module
    assert built == ["auto", True]  # the engine's default unless asked for
    assert "note: --fused-blocks has no effect here (it needs a CUDA device)" in captured.err
    generate_command(base + ["--no-fused-blocks"])
    assert capsys.readouterr().out.splitlines()[:2] == plain
    assert built[-1] is False


def test_pdl_is_refused_in_one_line_where_it_cannot_run(ckpt):
    base = [str(ckpt), "--prompt", "xyz", "--max-new-tokens", "2", "--device", "cpu"]
    with pytest.raises(UserError, match="--pdl needs --compile"):
        generate_command(base + ["--pdl", "--fused-blocks"])
    with pytest.raises(UserError, match="--pdl needs the fused blocks: drop --no-fused-blocks"):
        generate_command(base + ["--pdl", "--no-fused-blocks", "--compile"])
    with pytest.raises(UserError, match=r"--pdl needs a CUDA GPU of compute capability 9 or more .* on cpu"):
        generate_command(base + ["--pdl", "--compile"])


def test_generate_command_errors(ckpt):
    with pytest.raises(UserError, match="top-p"):
        generate_command([str(ckpt), "--top-p", "0"])
    with pytest.raises(UserError, match="context_length"):
        generate_command([str(ckpt), "--prompt", "x" * 40, "--device", "cpu"])
    with pytest.raises((UserError, FileNotFoundError)):
        generate_command([str(ckpt.parent / "missing.pt"), "--device", "cpu"])
    # a byte of another encoding, as Python reads it from argv (was UnicodeEncodeError)
    with pytest.raises(UserError, match=r"--prompt 'caf\\udce9' is not valid UTF-8 text"):
        generate_command([str(ckpt), "--prompt", "caf\udce9", "--device", "cpu"])


def test_generate_command_refuses_a_tokenizer_larger_than_the_model(ckpt):
    vocab = {**{i: bytes([i]) for i in range(256)}, 256: b"ab"}
    bigger = tokenizer_mod.Tokenizer(vocab, [(b"a", b"b")], ["<|endoftext|>"])
    bigger.save(ckpt.parent / "tokenizer")  # 258 tokens beside a model of 257
    with pytest.raises(UserError, match="has 258 tokens, more than the model's vocab_size=257"):
        generate_command([str(ckpt), "--prompt", "ab", "--device", "cpu"])


def test_generate_command_shows_ids_of_a_padded_vocabulary_as_replacement_characters(tmp_path, capsys):
    # vocab_size padded above the tokenizer's 257 tokens: an untrained model samples ids 257..511
    # about half the time, which made decoding raise "token id ... is not in the vocabulary".
    torch.manual_seed(0)
    tokenizer_mod.Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(tmp_path / "tokenizer")
    model = build_model(ModelConfig(vocab_size=512, context_length=32, d_model=32, num_layers=2, num_heads=4,
                                    d_ff=64))
    path = tmp_path / "model.pt"
    checkpoint.save_checkpoint(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, path)
    assert generate_command([str(path), "--prompt", "ab", "--max-new-tokens", "20", "--temperature", "1",
                             "--top-k", "0", "--top-p", "1", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"note: \d+ sampled token\(s\) are ids the tokenizer \(257 tokens\) does not have "
                     r"\(the model's vocab_size is 512\)", captured.err)
    assert "\ufffd" in captured.out.splitlines()[1]


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_generate_command_rejects_bad_temperature(ckpt, value):
    with pytest.raises(UserError, match="--temperature must be a number >= 0"):
        generate_command([str(ckpt), "--temperature", value, "--device", "cpu"])


@pytest.mark.parametrize("value", ["-1", str(2**64)])
def test_generate_command_rejects_a_seed_out_of_range(ckpt, value):
    with pytest.raises(UserError, match=r"--seed must be in \[0, 2\*\*32\)"):
        generate_command([str(ckpt), "--seed", value, "--device", "cpu"])


def test_generate_command_says_when_the_context_cuts_samples(ckpt, capsys):
    # context_length 32, a 2-token prompt: at most 30 new tokens fit.
    assert generate_command([str(ckpt), "--prompt", "ab", "--max-new-tokens", "500", "--temperature", "0",
                             "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert "samples stop after 30 new tokens" in captured.err
    assert int(re.search(r"sample 1/1 \((\d+) tokens\)", captured.out).group(1)) <= 30
    assert generate_command([str(ckpt), "--prompt", "ab", "--max-new-tokens", "5", "--device", "cpu"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_compile_says_why_it_cannot_take_effect(capsys):
    from types import SimpleNamespace

    from scratchlm.cli.infer import _note_if_not_compiled

    _note_if_not_compiled(SimpleNamespace(no_kv_cache=False), torch.device("cpu"))
    assert "--compile has no effect here (it needs a CUDA device)" in capsys.readouterr().err
    _note_if_not_compiled(SimpleNamespace(no_kv_cache=True), torch.device("cuda"))
    assert "needs the KV cache" in capsys.readouterr().err
    _note_if_not_compiled(SimpleNamespace(no_kv_cache=False), torch.device("cuda"))
    assert capsys.readouterr().err == ""  # where it compiles: no note


def test_fused_blocks_say_why_they_cannot_take_effect(monkeypatch, capsys):
    from types import SimpleNamespace

    from scratchlm.cli.infer import _note_if_blocks_unfused
    from scratchlm.kernels import triton_support

    cuda = torch.device("cuda")
    monkeypatch.setattr(triton_support, "triton_available", lambda: True)
    _note_if_blocks_unfused(SimpleNamespace(no_kv_cache=False), cuda, 9)
    assert "at most 8 prompts at once, not 9" in capsys.readouterr().err
    _note_if_blocks_unfused(SimpleNamespace(no_kv_cache=True), cuda, 1)
    assert "needs the KV cache" in capsys.readouterr().err
    _note_if_blocks_unfused(SimpleNamespace(no_kv_cache=False), cuda, 8)
    assert capsys.readouterr().err == ""  # where they run: no note
    monkeypatch.setattr(triton_support, "triton_available", lambda: False)
    _note_if_blocks_unfused(SimpleNamespace(no_kv_cache=False), cuda, 1)
    assert "needs triton" in capsys.readouterr().err


def test_sampling_options_say_they_have_no_effect_under_greedy_decoding(ckpt, capsys):
    base = [str(ckpt), "--prompt", "ab", "--max-new-tokens", "3", "--device", "cpu"]
    assert generate_command(base + ["--temperature", "0", "--top-k", "5", "--top-p", "0.5"]) == 0
    assert ("note: --top-k, --top-p have no effect here (--temperature 0 decodes greedily: the most likely token "
            "every step)") in capsys.readouterr().err
    assert generate_command(base + ["--temperature", "0", "--seed", "3"]) == 0
    assert "note: --seed has no effect here (--temperature 0" in capsys.readouterr().err
    for sampling in (["--temperature", "0"], ["--temperature", "0.7", "--top-k", "5", "--top-p", "0.5", "--seed", "3"]):
        assert generate_command(base + sampling) == 0
        assert "note:" not in capsys.readouterr().err
