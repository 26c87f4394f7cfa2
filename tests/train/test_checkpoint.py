import io

import numpy as np
import pytest
import torch

from scratchlm.errors import UserError
from scratchlm.model.config import ModelConfig
from scratchlm.optim.adamw import AdamW
from scratchlm.train import checkpoint as ckpt

TINY = ModelConfig(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)


def _trained(cfg: ModelConfig = TINY, steps: int = 3):
    from scratchlm.model.transformer import build_model

    torch.manual_seed(0)
    model = build_model(cfg)
    opt = AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (2, 8))
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("to_file_object", [False, True])
def test_single_file_round_trip(tmp_path, to_file_object):
    model, opt = _trained()
    target = io.BytesIO() if to_file_object else tmp_path / "ckpt.pt"
    ckpt.save_checkpoint(model, opt, 123, target, model_config=TINY)
    if to_file_object:
        target.seek(0)
    fresh, fresh_opt = _trained(steps=0)
    assert ckpt.load_checkpoint(target, fresh, fresh_opt) == 123
    assert _same_state(model.state_dict(), fresh.state_dict())
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"] == 3


def test_single_file_checkpoint_loads_into_a_compiled_style_wrapper(tmp_path):
    model, opt = _trained()
    wrapper = torch.nn.Module()
    wrapper._orig_mod = model  # what torch.compile's OptimizedModule exposes
    ckpt.save_checkpoint(wrapper, opt, 7, tmp_path / "c.pt")
    fresh, _ = _trained(steps=0)
    assert ckpt.load_checkpoint(tmp_path / "c.pt", fresh) == 7
    assert _same_state(model.state_dict(), fresh.state_dict())


def test_safetensors_stores_shared_tensors_once(tmp_path):
    w = torch.randn(5, 3)
    state = {"a.weight": w, "b.weight": w, "c": torch.arange(4.0), "view": torch.arange(4.0)}
    state["view_of_c"] = state["c"][1:]
    ckpt.save_weights(state, tmp_path / "w.safetensors")
    back = ckpt.load_weights(tmp_path / "w.safetensors")
    assert _same_state({k: v.contiguous() for k, v in state.items()}, back)
    assert back["a.weight"].data_ptr() == back["b.weight"].data_ptr()


def test_tied_model_weights_round_trip(tmp_path):
    from dataclasses import replace

    from scratchlm.model.transformer import build_model

    cfg = replace(TINY, tie_embeddings=True)
    model, _ = _trained(cfg)
    ckpt.save_weights(dict(model.named_parameters(remove_duplicate=False)), tmp_path / "w.safetensors")
    fresh = build_model(cfg)
    fresh.load_state_dict(ckpt.load_weights(tmp_path / "w.safetensors"))
    assert _same_state(model.state_dict(), fresh.state_dict())


def test_rng_state_round_trip_is_torch_loadable(tmp_path):
    import random

    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    state = ckpt.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    ckpt.write_torch(state, tmp_path / "rng.pt")
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.set_rng_state(ckpt.read_torch(tmp_path / "rng.pt"))  # weights_only=True
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def _save_step(run, step, model, opt, keep=2):
    return ckpt.save_run_checkpoint(run, step, model_state=model.state_dict(), optimizer_state=opt.state_dict(),
                                    state={"step": step}, config_text="[model]\n" + _model_toml(TINY), keep=keep)


def _model_toml(cfg):
    from scratchlm.config import config_to_toml

    return config_to_toml(cfg)


def test_run_checkpoints_latest_and_keep_last_n(tmp_path):
    model, opt = _trained()
    for step in (10, 20, 30):
        path = _save_step(tmp_path, step, model, opt, keep=2)
    assert path.name == "step_000030"
    assert [p.name for p in ckpt.list_steps(tmp_path)] == ["step_000020", "step_000030"]
    assert ckpt.latest_step_dir(tmp_path) == path
    assert sorted(p.name for p in path.iterdir()) == ["config.toml", "model.safetensors", "optimizer.pt", "state.pt"]
    assert not list((tmp_path / "checkpoints").glob(".staging*"))


def test_interrupted_save_leaves_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = _trained()
    _save_step(tmp_path, 10, model, opt)

    def power_cut(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_weights", power_cut)
    with pytest.raises(OSError):
        _save_step(tmp_path, 20, model, opt)
    assert ckpt.latest_step_dir(tmp_path).name == "step_000010"
    assert [p.name for p in ckpt.list_steps(tmp_path)] == ["step_000010"]


def test_resaving_a_step_replaces_it(tmp_path):
    model, opt = _trained()
    _save_step(tmp_path, 10, model, opt)
    _save_step(tmp_path, 10, model, opt)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000010"]


@pytest.mark.parametrize("which", ["run", "step", "weights_file", "single_file"])
def test_load_trained_model_from_every_kind_of_path(tmp_path, which):
    model, opt = _trained()
    step_dir = _save_step(tmp_path, 5, model, opt)
    (tmp_path / "config.toml").write_text("x")  # a run's own config is not what gets read
    paths = {"run": tmp_path, "step": step_dir, "weights_file": step_dir / "model.safetensors"}
    if which == "single_file":
        paths[which] = tmp_path / "single.pt"
        ckpt.save_checkpoint(model, opt, 5, paths[which], model_config=TINY)
    loaded, cfg, tokenizer = ckpt.load_trained_model(paths[which])
    assert cfg == TINY and tokenizer is None and not loaded.training
    assert _same_state(model.state_dict(), loaded.state_dict())


def test_load_trained_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckpt.load_trained_model(tmp_path / "nope")
    with pytest.raises(UserError, match="neither"):
        ckpt.load_trained_model(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(UserError, match="no checkpoint"):
        ckpt.load_trained_model(tmp_path)
    model, opt = _trained()
    del model.config  # a model built by hand, not by build_model, carries no config to store
    ckpt.save_checkpoint(model, opt, 1, tmp_path / "bare.pt")
    with pytest.raises(UserError, match="no model config"):
        ckpt.load_trained_model(tmp_path / "bare.pt")


def test_single_file_checkpoint_of_a_built_model_is_self_describing(tmp_path):
    model, opt = _trained()
    ckpt.save_checkpoint(model, opt, 2, tmp_path / "c.pt")  # build_model records the config
    _, cfg, _ = ckpt.load_trained_model(tmp_path / "c.pt")
    assert cfg == TINY
