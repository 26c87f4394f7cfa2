from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from scratchlm.config import (
    ConfigError,
    config_to_toml,
    load_config,
    split_overrides,
)
from scratchlm.train.config import TrainConfig


@dataclass
class Inner:
    width: int = 4
    rate: float = 0.5
    name: str = "x"
    flag: bool = False
    maybe: int | None = None
    sizes: list[int] = field(default_factory=lambda: [1, 2])


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    seed: int = 0


def test_defaults_preset_then_overrides(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text("seed = 3\n[inner]\nwidth = 8\nrate = 1\n")
    cfg = load_config(Outer, preset, ["--inner.name=abc", "--inner.flag=true", "--inner.maybe=7"])
    assert cfg.seed == 3
    assert cfg.inner.width == 8 and cfg.inner.rate == 1.0 and isinstance(cfg.inner.rate, float)
    assert cfg.inner.name == "abc" and cfg.inner.flag is True and cfg.inner.maybe == 7


def test_override_lists_and_none():
    cfg = load_config(Outer, None, ["--inner.sizes=[3, 4, 5]", "--inner.maybe=none"])
    assert cfg.inner.sizes == [3, 4, 5] and cfg.inner.maybe is None
    cfg = load_config(Outer, None, ["--inner.sizes=6,7"])
    assert cfg.inner.sizes == [6, 7]


@pytest.mark.parametrize(
    "override, message",
    [
        ("--inner.widht=3", "unknown config key 'inner.widht'"),
        ("--inner.width=3.5", "inner.width must be an integer"),
        ("--inner.flag=maybe", "inner.flag must be true or false"),
        ("--inner.rate=fast", "inner.rate must be a number"),
        ("--nosuch.key=1", "unknown config key 'nosuch'"),
        ("--seed.x=1", "seed"),
        # a byte of another encoding, as Python reads it from argv; was UnicodeEncodeError saving config.toml
        ("--inner.name=caf\udce9", r"override --inner.name: not valid UTF-8 text ('caf\udce9')"),
    ],
)
def test_bad_overrides_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(Outer, None, [override])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_wrong_type_in_toml(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('[inner]\nwidth = "wide"\n')
    with pytest.raises(ConfigError, match="inner.width must be an integer"):
        load_config(Outer, preset)
    preset.write_text("[inner]\nwidth = true\n")
    with pytest.raises(ConfigError, match="inner.width must be an integer"):
        load_config(Outer, preset)


def test_invalid_toml_and_missing_preset(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[inner\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(Outer, bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(Outer, tmp_path / "missing.toml")
    # A run directory given for its config: it exists, so "not found" misled.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("")
    with pytest.raises(ConfigError, match=r"is a directory, not a TOML file; its config is .*run/config\.toml"):
        load_config(Outer, tmp_path / "run")


def test_toml_round_trip():
    cfg = load_config(TrainConfig, None, ["--optim.lr=3e-4", "--model.use_rope=false", "--trainer.out_dir=r/x"])
    text = config_to_toml(cfg)
    import tomllib

    again = load_config(TrainConfig, None, [])
    from scratchlm.config import from_dict

    again = from_dict(TrainConfig, tomllib.loads(text))
    assert again == cfg


def test_validation_in_post_init_becomes_config_error():
    with pytest.raises(ConfigError, match="divisible"):
        load_config(TrainConfig, None, ["--model.d_model=100", "--model.num_heads=3"])
    with pytest.raises(ConfigError, match="parallel.strategy"):
        load_config(TrainConfig, None, ["--parallel.strategy=magic"])
    with pytest.raises(ConfigError, match="moe_gemm"):
        load_config(TrainConfig, None, ["--model.ffn=moe", "--model.moe_gemm=cutlass"])
    moe = load_config(TrainConfig, None, ["--model.ffn=moe", "--model.moe_gemm=portable"])
    from scratchlm.model.transformer import build_model

    tiny = moe.model.__class__(**{**moe.model.__dict__, "d_model": 32, "num_heads": 2, "d_ff": 32, "num_layers": 1})
    assert build_model(tiny).layers[0].ffn.gemm == "portable"


def test_split_overrides():
    pos, ov = split_overrides(["cfg.toml", "--optim.lr=1", "--resume", "--model.d_model", "64"])
    assert pos == ["cfg.toml", "--resume"]
    assert ov == ["--optim.lr=1", "--model.d_model=64"]


@pytest.mark.parametrize("text", ["nan", "NaN", "-nan"])
def test_nan_is_not_a_number_setting(tmp_path, text):
    # NaN slips through every range check (`lr < 0` is false) and trains a NaN model without a word.
    with pytest.raises(ConfigError, match="inner.rate must be a number"):
        load_config(Outer, None, [f"--inner.rate={text}"])
    preset = tmp_path / "p.toml"
    preset.write_text("[inner]\nrate = nan\n")
    with pytest.raises(ConfigError, match="inner.rate must be a number"):
        load_config(Outer, preset)
    with pytest.raises(ConfigError, match="optim.lr must be a number"):
        load_config(TrainConfig, None, [f"--optim.lr={text}"])
    assert load_config(Outer, None, ["--inner.rate=inf"]).inner.rate == float("inf")


def test_an_integer_past_the_float_range_reads_as_infinite(tmp_path):
    # float(10**400) raised OverflowError, reported as unexpected; 1e400 already read as inf.
    preset = tmp_path / "p.toml"
    preset.write_text("[inner]\nrate = -1" + "0" * 400 + "\n")
    assert load_config(Outer, preset).inner.rate == float("-inf")
    preset.write_text("[optim]\nlr = 1" + "0" * 400 + "\n")
    with pytest.raises(ConfigError, match="optim.lr must be a finite number, got inf"):
        load_config(TrainConfig, preset)


def test_config_file_that_is_not_utf8_text(tmp_path):
    # A token file or a Latin-1 file given where a TOML config belongs.
    binary = tmp_path / "train.bin"
    binary.write_bytes(b"\x9d\x00\x01\x02[model]\n")
    with pytest.raises(ConfigError, match=r"train.bin: not a TOML config \(byte 0x9d at offset 0"):
        load_config(TrainConfig, binary)


@pytest.mark.parametrize("override, message", [
    ("--model.rope_theta=inf", "model.rope_theta must be a positive finite number, got inf"),
    ("--model.rope_theta=0", "model.rope_theta must be a positive finite number, got 0.0"),
    ("--model.logit_softcap=inf", "model.logit_softcap must be >= 0"),
    ("--optim.lr=inf", "optim.lr must be a finite number, got inf"),
    ("--optim.muon_lr=inf", "optim.muon_lr must be a finite number"),
    ("--optim.weight_decay=inf", "optim.weight_decay must be a finite number"),
])
def test_infinite_rates_and_bases_are_refused(tmp_path, override, message):
    # inf passes the `>= 0` checks; an infinite rate or RoPE base trains garbage without a word
    from scratchlm.train.config import TrainConfig

    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, "tiny-cpu", [override])
    preset = tmp_path / "p.toml"  # the same from a config file
    section, key = override[2:].split("=")[0].split(".")
    preset.write_text(f"[{section}]\n{key} = {override.split('=')[1]}\n")
    with pytest.raises(ConfigError, match=message.split(", got")[0]):
        load_config(TrainConfig, preset)


def test_home_is_expanded_in_path_fields(tmp_path, monkeypatch):
    # No shell expands `~` after `=` in --data.train_path=~/..., and TOML never does.
    monkeypatch.setenv("HOME", str(tmp_path))
    preset = tmp_path / "p.toml"
    preset.write_text('[trainer]\nout_dir = "~/runs/x"\nwandb_project = "~proj"\n'
                      '[data]\ntokenizer_dir = "~/tok"\nval_path = "data/~/valid.bin"\n')
    cfg = load_config(TrainConfig, "~/p.toml", ["--data.train_path=~/data/train.bin", "--trainer.compile_cache_dir=~",
                                                 "--trainer.sample_prompts=~/a"])
    assert cfg.trainer.out_dir == f"{tmp_path}/runs/x"
    assert cfg.data.tokenizer_dir == f"{tmp_path}/tok"
    assert cfg.data.train_path == f"{tmp_path}/data/train.bin"
    assert cfg.trainer.compile_cache_dir == str(tmp_path)
    # only a leading `~` of a path field: other strings are left as written
    assert cfg.data.val_path == "data/~/valid.bin"
    assert cfg.trainer.wandb_project == "~proj"
    assert cfg.trainer.sample_prompts == ["~/a"]
    assert f'out_dir = "{tmp_path}/runs/x"' in config_to_toml(cfg)


def test_home_is_expanded_in_align_path_fields(tmp_path, monkeypatch):
    from scratchlm.align.config import DPORunConfig, GRPORunConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(GRPORunConfig, None, ["--policy.path=~/runs/base", "--data.dataset=~/q.jsonl",
                                            "--data.eval_dataset=gsm8k", "--data.data_dir=~/data", "--run.out_dir=~/o"])
    assert (cfg.policy.path, cfg.data.dataset, cfg.data.eval_dataset, cfg.data.data_dir, cfg.run.out_dir) == (
        f"{tmp_path}/runs/base", f"{tmp_path}/q.jsonl", "gsm8k", f"{tmp_path}/data", f"{tmp_path}/o")
    dpo = load_config(DPORunConfig, None, ["--data.train_path=~/pairs.jsonl", "--data.eval_path=~/eval.jsonl"])
    assert (dpo.data.train_path, dpo.data.eval_path) == (f"{tmp_path}/pairs.jsonl", f"{tmp_path}/eval.jsonl")
