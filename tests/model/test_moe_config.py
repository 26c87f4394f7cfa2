"""The MoE gating and loss-scope config keys: validation, defaults, and that they reach MoEFFN."""

from __future__ import annotations

import tomllib

import pytest
import torch

from scratchlm.config import ConfigError, config_to_toml, from_dict, load_config
from scratchlm.model.config import ModelConfig
from scratchlm.model.moe import moe_aux_loss, moe_layers
from scratchlm.model.transformer import build_model
from scratchlm.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = ["--model.ffn=moe", "--model.d_model=32", "--model.num_heads=2", "--model.d_ff=32", "--model.num_layers=2",
         "--model.vocab_size=64", "--model.context_length=16", "--model.moe_num_experts=4"]


def _model(*overrides: str):
    cfg = load_config(TrainConfig, None, [*SHAPE, *overrides]).model
    torch.manual_seed(0)
    return build_model(cfg), cfg


@pytest.mark.parametrize(
    "overrides, renormalize",
    [
        (["--model.moe_top_k=2"], True),  # the default: renormalise for top-k > 1 ...
        (["--model.moe_top_k=1"], False),  # ... and not for top-1 (as before the key existed)
        (["--model.moe_top_k=2", "--model.moe_renormalize=false"], False),
        (["--model.moe_top_k=1", "--model.moe_renormalize=true"], True),
        (["--model.moe_top_k=2", "--model.moe_renormalize=none"], True),
    ],
)
def test_moe_renormalize_reaches_every_layer(overrides, renormalize):
    model, cfg = _model(*overrides)
    assert all(m.renormalize is renormalize for m in moe_layers(model)) and len(moe_layers(model)) == 2


def test_moe_renormalize_changes_the_gates():
    x = torch.randint(0, 64, (2, 16))
    on, _ = _model("--model.moe_top_k=2")
    off, _ = _model("--model.moe_top_k=2", "--model.moe_renormalize=false")
    off.load_state_dict(on.state_dict())
    with torch.no_grad():
        assert (on(x) - off(x)).abs().max() > 1e-4


def test_moe_aux_scope_reaches_every_layer_and_the_loss():
    model, cfg = _model("--model.moe_aux_scope=model")
    assert cfg.moe_aux_scope == "model" and {m.aux_scope for m in moe_layers(model)} == {"model"}
    model(torch.randint(0, 64, (2, 16)))
    layers = moe_layers(model)
    z = sum(m.last_aux["z_loss"] for m in layers)
    f = torch.stack([m.last_aux["expert_fraction"] for m in layers]).mean(0)
    p = torch.stack([m.last_aux["router_prob"] for m in layers]).mean(0)
    torch.testing.assert_close(moe_aux_loss(model, 0.5, 0.25), 0.5 * 4 * (f * p).sum() + 0.25 * z)
    default, cfg = _model()
    assert cfg.moe_aux_scope == "layer" and {m.aux_scope for m in moe_layers(default)} == {"layer"}


@pytest.mark.parametrize(
    "override, match",
    [("--model.moe_aux_scope=global", "moe_aux_scope"), ("--model.moe_renormalize=maybe", "moe_renormalize"),
     # -1 was taken: `scratchlm account` counted a shared expert's parameters and FLOPs negatively.
     ("--model.moe_shared_experts=-1", "moe_shared_experts must be >= 0")],
)
def test_bad_values_are_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TrainConfig, None, [*SHAPE, override])


def test_model_config_validates_direct_construction():
    with pytest.raises(ValueError, match="moe_aux_scope"):
        ModelConfig(ffn="moe", moe_aux_scope="Layer")
    with pytest.raises(ValueError, match="moe_renormalize"):
        ModelConfig(ffn="moe", moe_renormalize=1)


def test_saved_configs_without_the_keys_still_load_and_new_ones_round_trip():
    cfg = load_config(TrainConfig, None, [*SHAPE, "--model.moe_renormalize=false", "--model.moe_aux_scope=model"])
    data = tomllib.loads(config_to_toml(cfg))
    assert data["model"]["moe_renormalize"] is False and data["model"]["moe_aux_scope"] == "model"
    assert from_dict(TrainConfig, data) == cfg
    for key in ("moe_renormalize", "moe_aux_scope"):
        del data["model"][key]
    old = from_dict(TrainConfig, data).model
    assert old.moe_renormalize is None and old.moe_aux_scope == "layer"
    # None is left out of the TOML and reads back as None.
    default = load_config(TrainConfig, None, SHAPE)
    assert "moe_renormalize" not in tomllib.loads(config_to_toml(default))["model"]
    assert from_dict(TrainConfig, tomllib.loads(config_to_toml(default))) == default
