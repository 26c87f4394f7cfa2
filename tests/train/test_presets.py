from pathlib import Path

import pytest

from scratchlm.config import config_to_toml, load_config
from scratchlm.model.accounting import param_count
from scratchlm.train.config import TrainConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# align-*.toml and dpo.toml are post-training configs (scratchlm.align.config), checked by tests/align and tests/cli.
PRESETS = sorted(p.stem for p in CONFIGS.glob("*.toml") if not p.stem.startswith("align-") and p.stem != "dpo")


def test_every_expected_preset_exists():
    expected = {"quickstart", "tiny-cpu", "tinystories-17m", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"}
    assert expected <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_round_trips(name, tmp_path):
    cfg = load_config(TrainConfig, name)
    again = tmp_path / "resolved.toml"
    again.write_text(config_to_toml(cfg))
    assert load_config(TrainConfig, again) == cfg
    assert cfg.trainer.batch_size % cfg.trainer.grad_accum_steps == 0


def test_preset_shapes():
    shapes = {  # d_model, d_ff, layers, heads
        "gpt2-small": (768, 3072, 12, 12), "gpt2-medium": (1024, 4096, 24, 16),
        "gpt2-large": (1280, 5120, 36, 20), "gpt2-xl": (1600, 6400, 48, 25),
        "tinystories-17m": (512, 1344, 4, 16),
    }
    for name, shape in shapes.items():
        m = load_config(TrainConfig, name).model
        assert (m.d_model, m.d_ff, m.num_layers, m.num_heads) == shape, name
    ts = load_config(TrainConfig, "tinystories-17m")
    assert (ts.model.context_length, ts.model.vocab_size, ts.model.rope_theta) == (256, 10000, 10000.0)
    assert (ts.trainer.batch_size, ts.trainer.max_steps, ts.optim.schedule) == (32, 5000, "cosine")


def test_small_presets_build_a_model_of_the_accounted_size():
    from scratchlm.model.transformer import build_model

    for name in ("quickstart", "tiny-cpu"):
        cfg = load_config(TrainConfig, name).model
        model = build_model(cfg, device="meta")
        assert sum(p.numel() for p in model.parameters()) == param_count(cfg)


@pytest.mark.parametrize("name", ["quickstart", "tiny-cpu"])
def test_cpu_presets_train_in_minutes(name):
    # Two CPU cores ran the 4-layer d_model-256 preset at about 70 GFLOP/s (2,000 steps in 68 min):
    # 15 TFLOP of training is about 3.5 minutes at that rate.
    from scratchlm.model.accounting import forward_flops

    cfg = load_config(TrainConfig, name)
    train_flops = 3 * forward_flops(cfg.model)["total"] * cfg.trainer.batch_size * cfg.trainer.max_steps
    assert train_flops <= 15e12, f"{name}: {train_flops / 1e12:.1f} TFLOP of training"
