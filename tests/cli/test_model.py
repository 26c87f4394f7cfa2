"""`scratchlm account` against hand-checked GPT-2-XL figures, its presets and its errors
(`scratchlm export` is tested with the exporter, in tests/model/test_hf.py)."""

from __future__ import annotations

import json

import pytest

from scratchlm.cli.model import account_command
from scratchlm.config import ConfigError
from scratchlm.errors import UserError
from scratchlm.model.accounting import param_count
from scratchlm.model.config import ModelConfig

GPT2_XL = dict(vocab_size=50257, context_length=1024, d_model=1600, num_layers=48, num_heads=25, d_ff=6400)


def _gpt2_xl_args() -> list[str]:
    return [f"--model.{k}={v}" for k, v in GPT2_XL.items()]


def test_account_command_json(capsys):
    assert account_command([*_gpt2_xl_args(), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("params", "forward_flops", "forward_flops_breakdown", "train_memory_bytes"):
        assert key in out
    assert out["params"] == 2_127_057_600
    assert out["forward_flops"] == 4_513_336_524_800
    assert set(out["forward_flops_breakdown"]) == {"qkvo", "attention", "ffn", "lm_head"}
    assert out["train_memory_bytes"]["static"] == 34_032_921_600


def test_account_command_table(capsys):
    assert account_command([*_gpt2_xl_args(), "--memory-gib=80"]) == 0
    out = capsys.readouterr().out
    assert "2,127,057,600" in out and "4,513,336,524,800" in out and "max batch in 80 GiB" in out


def test_account_command_presets(tmp_path, capsys):
    full = tmp_path / "train.toml"
    full.write_text("[model]\nd_model = 128\nnum_heads = 4\n[trainer]\nmax_steps = 3\n")
    bare = tmp_path / "model.toml"
    bare.write_text("d_model = 128\nnum_heads = 4\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(full.read_text())
    expected = param_count(ModelConfig(d_model=128, num_heads=4, num_layers=6))
    # a run's checkpoints/latest names its newest step directory, which holds the run's config
    step = run / "checkpoints" / "step_000003"
    step.mkdir(parents=True)
    (step / "config.toml").write_text(full.read_text())
    (step / "model.safetensors").write_bytes(b"")  # (account reads the config only)
    (run / "checkpoints" / "latest").write_text("step_000003\n")
    for source in (full, bare, run, run / "checkpoints" / "latest"):
        assert account_command([str(source), "--model.num_layers=6", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["params"] == expected


def test_account_command_errors(tmp_path):
    with pytest.raises(ConfigError):
        account_command(["--model.no_such_key=1"])
    with pytest.raises(UserError):
        account_command(["--trainer.max_steps=1"])
    with pytest.raises(UserError):
        account_command([str(tmp_path / "missing.toml")])
    with pytest.raises(UserError):
        account_command([str(tmp_path)])  # a directory without config.toml
    with pytest.raises(ConfigError, match="head size must be even"):
        # Was counted, though no such model can be built (RoPE needs pairs of dimensions).
        account_command(["--model.d_model=96", "--model.num_heads=32"])


def test_account_command_counts_the_optimizers_state(tmp_path, capsys):
    from scratchlm.model.accounting import train_memory_bytes

    cfg = ModelConfig(**GPT2_XL)
    assert account_command([*_gpt2_xl_args(), "--optim.name=muon", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer"] == "muon"
    assert out["train_memory_bytes"]["static"] == train_memory_bytes(cfg, "muon")["static"] < 34_032_921_600
    # A train config's optim.name, for a full config and a run directory; a bare [model] table is AdamW's.
    full = tmp_path / "train.toml"
    full.write_text("[model]\nd_model = 128\nnum_heads = 4\n[optim]\nname = \"muon\"\n")
    bare = tmp_path / "model.toml"
    bare.write_text("d_model = 128\nnum_heads = 4\n")
    small = ModelConfig(d_model=128, num_heads=4)
    for source, name in ((full, "muon"), (bare, "adamw")):
        assert account_command([str(source), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["optimizer"] == name
        assert out["train_memory_bytes"]["static"] == train_memory_bytes(small, name)["static"]
    assert account_command([str(bare), "--optim.name=muon", "--memory-gib=1"]) == 0
    assert "static memory (muon," in capsys.readouterr().out
    with pytest.raises(UserError, match="optim.name"):
        account_command([str(bare), "--optim.name=sgd"])
    with pytest.raises(ConfigError):
        account_command(["--optim.lr=1e-3"])


def test_account_command_config_that_is_not_utf8(tmp_path, capsys):
    from scratchlm.cli import main

    latin1 = tmp_path / "model.toml"
    latin1.write_bytes("# café\n[model]\nd_model = 64\n".encode("latin-1"))
    assert main(["account", str(latin1)]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.toml: not a TOML config" in err and "\n" not in err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "1e300"])  # 1e300 GiB overflowed counting its bytes
def test_account_memory_gib_must_be_positive(value):
    with pytest.raises(UserError, match="--memory-gib must be a positive number"):
        account_command(["--memory-gib", value])


def test_export_refuses_a_tokenizer_larger_than_the_model(tmp_path, capsys):
    # The export went through: its tokenizer.json gave ids past the 300 rows of the embedding.
    torch = pytest.importorskip("torch")
    from scratchlm.cli import main
    from scratchlm.model.transformer import build_model
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.train.checkpoint import save_checkpoint

    vocab = {i: bytes([i]) for i in range(256)}
    Tokenizer({**vocab, **{256 + i: bytes([97, i]) for i in range(244)}},
              [(b"a", bytes([i])) for i in range(244)], ["<|endoftext|>"]).save(tmp_path / "tokenizer")
    model = build_model(ModelConfig(vocab_size=300, context_length=16, d_model=32, num_layers=1, num_heads=4,
                                    d_ff=64))
    save_checkpoint(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, tmp_path / "model.pt")
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "model.pt"), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "has 501 tokens, more than the model's vocab_size=300" in err and "\n" not in err
    assert not out.exists()


def test_account_refuses_an_infinite_moe_capacity_factor(capsys):
    # Was an OverflowError reported as unexpected ("rerun with --debug").
    from scratchlm.cli import main

    assert main(["account", "--model.ffn=moe", "--model.moe_capacity_factor=inf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.moe_capacity_factor must be a positive finite number or none" in err and "\n" not in err
