import contextlib
import io
import os

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
    assert sorted(p.name for p in path.iterdir()) == ["checksums.json", "config.toml", "model.safetensors",
                                                      "optimizer.pt", "state.pt"]
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


def test_resaving_a_step_leaves_one_whole_copy_at_every_moment(tmp_path, monkeypatch):
    from pathlib import Path

    from scratchlm.fileio import exchange_paths

    model, opt = _trained()
    _save_step(tmp_path, 10, model, opt)
    probe = tmp_path / "probe"
    (probe / "a").mkdir(parents=True), (probe / "b").mkdir()
    if not exchange_paths(probe / "a", probe / "b"):
        pytest.skip("no atomic exchange of two paths here")
    real_rename = Path.rename

    def killed_after_moving_the_old_copy_aside(self, target):
        real_rename(self, target)
        if self.name == "step_000010":
            raise Killed  # between moving the old copy aside and renaming the new one in

    class Killed(Exception):
        pass

    monkeypatch.setattr(Path, "rename", killed_after_moving_the_old_copy_aside)
    with contextlib.suppress(Killed):
        _save_step(tmp_path, 10, model, opt)
    monkeypatch.undo()
    assert ckpt.find_resume_checkpoint(tmp_path).name == "step_000010"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000010"]


@pytest.mark.parametrize("which", ["run", "step", "weights_file", "single_file", "optimizer_file",
                                   "state_file", "latest_file"])
def test_load_trained_model_from_every_kind_of_path(tmp_path, which):
    model, opt = _trained()
    step_dir = _save_step(tmp_path, 5, model, opt)
    (tmp_path / "config.toml").write_text("x")  # a run's own config is not what gets read
    paths = {"run": tmp_path, "step": step_dir, "weights_file": step_dir / "model.safetensors",
             # other files of a step directory or of checkpoints/ name the same checkpoint
             "optimizer_file": step_dir / "optimizer.pt", "state_file": step_dir / "state.pt",
             "latest_file": tmp_path / "checkpoints" / "latest"}
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


# ---------------------------------------------------------------- checksums and damage


def test_checksums_cover_every_file_of_a_step_and_catch_one_flipped_bit(tmp_path):
    import hashlib
    import json

    model, opt = _trained()
    step_dir = _save_step(tmp_path, 5, model, opt)
    recorded = json.loads((step_dir / ckpt.CHECKSUMS).read_text())
    assert recorded["algorithm"] == "sha256"
    assert recorded["files"] == {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                 for p in step_dir.iterdir() if p.name != ckpt.CHECKSUMS}
    ckpt.verify_step_dir(step_dir)
    data = bytearray((step_dir / "model.safetensors").read_bytes())
    data[-3] ^= 1  # one bit of one weight: loads without complaint, only the checksum sees it
    (step_dir / "model.safetensors").write_bytes(bytes(data))
    ckpt.load_weights(step_dir / "model.safetensors")
    with pytest.raises(ckpt.DamagedCheckpoint, match=r"model\.safetensors is damaged.*sha256"):
        ckpt.verify_step_dir(step_dir)
    with pytest.raises(UserError, match=r"model\.safetensors is damaged"):
        ckpt.load_trained_model(step_dir)


def test_truncated_files_are_named_even_without_checksums(tmp_path):
    model, opt = _trained()
    step_dir = _save_step(tmp_path, 5, model, opt)
    (step_dir / ckpt.CHECKSUMS).unlink()
    ckpt.verify_step_dir(step_dir)  # an intact old-format directory passes
    for name in ("model.safetensors", "optimizer.pt"):
        path = step_dir / name
        intact = path.read_bytes()
        path.write_bytes(intact[: len(intact) // 2])
        with pytest.raises(ckpt.DamagedCheckpoint, match=rf"{path}.*damaged"):
            ckpt.verify_step_dir(step_dir)
        with pytest.raises(ckpt.DamagedCheckpoint, match=rf"{path}.*damaged"):
            ckpt.load_weights(path) if name.endswith("safetensors") else ckpt.read_torch(path)
        path.write_bytes(intact)


def test_a_truncated_single_file_checkpoint_names_the_file(tmp_path):
    model, opt = _trained()
    path = tmp_path / "c.pt"
    ckpt.save_checkpoint(model, opt, 3, path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(UserError, match=rf"{path}.*damaged"):
        ckpt.load_checkpoint(path, _trained(steps=0)[0])


def test_a_single_file_save_cut_off_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = _trained()
    path = tmp_path / "c.pt"
    ckpt.save_checkpoint(model, opt, 3, path)
    before = path.read_bytes()
    real_save = torch.save

    def cut_off(obj, f, *args, **kwargs):  # half the bytes reach the file, then Ctrl-C
        buffer = io.BytesIO()
        real_save(obj, buffer)
        with open(f, "wb") if isinstance(f, (str, os.PathLike)) else contextlib.nullcontext(f) as sink:
            sink.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", cut_off)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(model, opt, 4, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # (no temporary file left)
    monkeypatch.undo()
    assert ckpt.load_checkpoint(path, _trained(steps=0)[0]) == 3


def test_a_run_without_latest_loads_its_newest_step(tmp_path):
    model, opt = _trained()
    _save_step(tmp_path, 5, model, opt)
    newest = _save_step(tmp_path, 9, model, opt)
    (tmp_path / "checkpoints" / "latest").unlink()
    assert ckpt.resolve_checkpoint(tmp_path) == newest
    assert ckpt.find_resume_checkpoint(tmp_path) == newest


def test_a_torch_file_without_model_weights_is_not_a_checkpoint(tmp_path):
    torch.save({"step": 3}, tmp_path / "state.pt")  # e.g. a file copied out of its step directory
    torch.save(torch.zeros(2), tmp_path / "tensor.pt")
    for name in ("state.pt", "tensor.pt"):
        with pytest.raises(UserError, match="is not a model checkpoint"):
            ckpt.load_trained_model(tmp_path / name)


def test_a_file_torch_did_not_write_is_not_a_checkpoint_rather_than_damaged(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")  # e.g. a config or text file given by mistake
    (tmp_path / "empty.pt").write_bytes(b"")
    for name in ("notes.txt", "empty.pt"):
        with pytest.raises(UserError, match="is not a model checkpoint \\(not a file torch.save wrote\\)"):
            ckpt.load_trained_model(tmp_path / name)


@pytest.mark.parametrize("edit, message", [
    (lambda text: text.replace("d_model = 32", "d_model = 16"),
     r"do not fit the model its config describes: \S+ has shape"),
    (lambda text: text.replace("num_layers = 2", "num_layers = 3"), r"do not fit .* are missing, e\.g\. layers\.2\."),
    (lambda text: text.replace("num_layers = 2", "num_layers = 1"), r"do not fit .* not in the config's model"),
    (lambda text: "[[[\n", r"config\.toml is not a valid TOML config"),
    (lambda text: "model = 3\n", r"\[model\] must be a table"),
])
def test_a_config_that_does_not_describe_the_weights_is_a_user_error(tmp_path, edit, message):
    # Without checksums (an older checkpoint, or one assembled by hand) nothing else catches a
    # config edited or copied from another run: torch's RuntimeError or a TOMLDecodeError came out.
    model, opt = _trained()
    step_dir = _save_step(tmp_path, 5, model, opt)
    (step_dir / ckpt.CHECKSUMS).unlink()
    config = step_dir / "config.toml"
    config.write_text(edit(config.read_text()))
    with pytest.raises(UserError, match=message):
        ckpt.load_trained_model(step_dir)


def test_single_file_weights_of_another_model_are_a_user_error(tmp_path):
    model, opt = _trained()
    ckpt.save_checkpoint(model, opt, 2, tmp_path / "c.pt",
                         model_config=ModelConfig(**{**TINY.__dict__, "d_ff": 64}))
    with pytest.raises(UserError, match=r"c\.pt do not fit the model its config describes"):
        ckpt.load_trained_model(tmp_path / "c.pt")


def test_a_run_that_has_not_saved_a_checkpoint_yet_is_named_as_a_run(tmp_path):
    """A run killed before its first checkpoint (or of max_steps=0) has no checkpoints/ folder:
    it was called neither a run directory, a step directory nor a checkpoint file."""
    (tmp_path / "config.toml").write_text("[model]\n")
    (tmp_path / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n')
    with pytest.raises(UserError, match=f"run directory {tmp_path} has no checkpoint yet"):
        ckpt.resolve_checkpoint(tmp_path)


def test_a_hugging_face_directory_is_named_as_such(tmp_path):
    # An exported model given to generate/eval/export was reported as a damaged checkpoint.
    from scratchlm.errors import UserError
    from scratchlm.train.checkpoint import resolve_checkpoint

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="is a Hugging Face model directory .*not a scratchlm run"):
        resolve_checkpoint(tmp_path)


def test_a_latest_that_is_not_text_is_named_as_damaged(tmp_path):
    model, opt = _trained()
    _save_step(tmp_path, 5, model, opt)
    (tmp_path / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00step")
    for read in (ckpt.resolve_checkpoint, ckpt.find_resume_checkpoint, ckpt.latest_step_dir):
        with pytest.raises(UserError, match="latest is not a step directory name .* damaged"):
            read(tmp_path)


@pytest.mark.parametrize("name", ["²", "step_²", "step_000²"])
def test_a_step_named_with_digits_other_than_ascii_ones_is_no_checkpoint(tmp_path, name):
    # "²".isdigit() is True but int("²") fails: --resume-from ² ended in a ValueError.
    model, opt = _trained()
    _save_step(tmp_path, 5, model, opt)
    (tmp_path / "checkpoints" / "step_²").mkdir()  # a directory that is no step, left among the steps
    assert [p.name for p in ckpt.list_steps(tmp_path)] == ["step_000005"]
    with pytest.raises(UserError, match=f"there is no checkpoint {name} in .*step_000005"):
        ckpt.find_resume_checkpoint(tmp_path, name)


def test_resume_from_the_path_of_another_runs_step_is_refused(tmp_path):
    # Only the path's last name was read: another run's step_000005 resumed this run's step_000005.
    model, opt = _trained()
    run, other = tmp_path / "run", tmp_path / "other"
    own = _save_step(run, 5, model, opt)
    _save_step(other, 5, model, opt)
    with pytest.raises(UserError, match=f"{other}/checkpoints/step_000005 is not a checkpoint of the run {run}"):
        ckpt.find_resume_checkpoint(run, other / "checkpoints" / "step_000005")
    assert ckpt.find_resume_checkpoint(run, own) == own  # its own step, by path
    assert ckpt.find_resume_checkpoint(run, "step_000005") == own


def test_an_empty_latest_is_named_as_empty(tmp_path):
    # It was reported as naming "checkpoints", which is missing or incomplete.
    model, opt = _trained()
    _save_step(tmp_path, 5, model, opt)
    (tmp_path / "checkpoints" / "latest").write_text("\n")
    for read in (ckpt.resolve_checkpoint, ckpt.find_resume_checkpoint, ckpt.latest_step_dir):
        with pytest.raises(UserError, match=r"latest is empty: .*step_000005 is the newest step directory"):
            read(tmp_path)
