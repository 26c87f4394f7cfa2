"""`scratchlm train` (with --resume) and `scratchlm eval` on a tiny model; the training itself
is tested through `run_training` in tests/train/test_trainer.py, whose fixtures this reuses."""

import json

import pytest

from scratchlm.cli.train import eval_command, train_command
from scratchlm.errors import UserError
from tests.train.test_trainer import _losses, cfg  # noqa: F401 (cfg is a fixture)


def test_train_and_eval_commands(cfg, tmp_path, capsys):
    from scratchlm.config import save_config

    save_config(cfg, tmp_path / "c.toml")
    out = tmp_path / "cli"
    assert train_command([str(tmp_path / "c.toml"), f"--trainer.out_dir={out}", "--trainer.max_steps=4"]) == 0
    assert [s for s, _ in _losses(out)] == [1, 2, 3, 4]
    with pytest.raises(UserError, match="--resume"):
        train_command([str(tmp_path / "c.toml"), f"--trainer.out_dir={out}"])
    assert train_command([str(tmp_path / "c.toml"), f"--trainer.out_dir={out}", "--resume"]) == 0
    assert [s for s, _ in _losses(out)][-1] == 12
    capsys.readouterr()
    assert eval_command([str(out), "--data", cfg.data.val_path, "--batches", "2", "--batch-size", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 2 * 4 * 16 and result["checkpoint"].endswith("step_000012")
    assert result["val_loss"] == pytest.approx(_losses(out, "eval", "val_loss")[-1][1], rel=1e-5)


def test_eval_refuses_data_encoded_with_another_tokenizer(tmp_path, capsys):
    import numpy as np

    from scratchlm.config import config_to_toml
    from scratchlm.model.config import ModelConfig
    from scratchlm.model.transformer import build_model
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train import train_bpe
    from scratchlm.train.checkpoint import save_run_checkpoint
    from scratchlm.train.config import TrainConfig

    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat. " * 50, encoding="utf-8")
    tokenizer = Tokenizer(*train_bpe(corpus, 270, [], workers=1), [])
    model_cfg = ModelConfig(vocab_size=270, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    run = tmp_path / "run"
    save_run_checkpoint(run, 1, model_state=build_model(model_cfg).state_dict(), optimizer_state=None,
                        state={"step": 1}, config_text=config_to_toml(TrainConfig(model=model_cfg)), keep=1)
    tokenizer.save(run / "tokenizer")
    for name, hash_ in (("same", tokenizer.hash), ("other", "f" * 64)):
        np.arange(100, dtype=np.uint16).tofile(tmp_path / f"{name}.bin")
        (tmp_path / f"{name}.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 270,
                                                           "tokenizer_hash": hash_}))
    assert eval_command([str(run), "--data", str(tmp_path / "same.bin"), "--batches", "1", "--batch-size", "2"]) == 0
    with pytest.raises(UserError, match="was encoded with another tokenizer"):
        eval_command([str(run), "--data", str(tmp_path / "other.bin"), "--batches", "1", "--batch-size", "2"])


@pytest.mark.parametrize("override, message", [
    ("--trainer.sample_top_p=0", "trainer.sample_top_p must be in"),
    ("--trainer.sample_top_p=1.5", "trainer.sample_top_p must be in"),
    ("--trainer.sample_temperature=-1", "trainer.sample_temperature must be a finite number >= 0"),
    ("--trainer.sample_temperature=inf", "trainer.sample_temperature must be a finite number >= 0"),  # uniform samples
    ("--trainer.seed=-1", r"trainer.seed must be in \[0, 2\*\*32\)"),  # was numpy's ValueError
    ("--trainer.batch_size=100000000000000000000", r"trainer.batch_size must be at most 2\*\*31 - 1"),  # numpy's too
])
def test_train_refuses_bad_sampling_settings_before_training(tmp_path, override, message):
    # These failed only when the samples were drawn, after the whole run had trained.
    with pytest.raises(UserError, match=message):
        train_command([f"--trainer.out_dir={tmp_path / 'run'}", override])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["", "  "])
def test_train_refuses_an_empty_out_dir(cfg, tmp_path, monkeypatch, value):
    # --trainer.out_dir=$OUT with OUT unset trained into the current directory, among its files.
    from scratchlm.config import save_config

    save_config(cfg, tmp_path / "c.toml")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(UserError, match="trainer.out_dir is empty; name the run directory"):
        train_command([str(tmp_path / "c.toml"), f"--trainer.out_dir={value}", "--trainer.max_steps=1"])
    assert not any(work.iterdir())


@pytest.mark.parametrize("value", ["-5e14", "inf"])
def test_train_refuses_a_peak_flops_that_is_negative_or_infinite(tmp_path, value):
    # A negative peak was taken for 0 (look it up, n/a on a CPU), an infinite one logged MFU 0.
    with pytest.raises(UserError, match=r"trainer.peak_flops must be a finite number >= 0 \(0 = look it up\)"):
        train_command([f"--trainer.out_dir={tmp_path / 'run'}", f"--trainer.peak_flops={value}"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["", "  "])
def test_train_refuses_an_empty_resume_from(tmp_path, value):
    # --resume-from "" was taken for no resume at all: an existing run was refused with "pass --resume".
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="--resume-from is empty; give the step to continue from"):
        train_command([f"--trainer.out_dir={run}", "--trainer.device=cpu", "--resume-from", value])


@pytest.mark.parametrize("damage", [b"[model\n", b"\xff\xfe"])
def test_resume_names_a_damaged_run_config(tmp_path, damage):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_bytes(b"[model]\nd_model = 32\n" + damage)
    with pytest.raises(UserError, match=f"{run / 'config.toml'}: (invalid TOML|not a TOML config)"):
        train_command([f"--trainer.out_dir={run}", "--trainer.device=cpu", "--resume"])


@pytest.mark.parametrize("section", ["model", "optim"])
def test_resume_names_a_run_config_whose_section_is_not_a_table(tmp_path, section):
    """`model = 3` was a TypeError, `optim = 3` an AttributeError."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(f"{section} = 3\n")
    with pytest.raises(UserError, match=rf"{run / 'config.toml'}: \[{section}\] must be a table, got int"):
        train_command([f"--trainer.out_dir={run}", "--trainer.device=cpu", "--resume"])


def test_overwrite_refuses_to_delete_the_tokenizer_or_data_it_reads(tmp_path):
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (run / "tokenizer" / "vocab.json").write_text("{}")
    # The run's tokenizer copy named as data.tokenizer_dir: deleted with the run, then reported missing.
    with pytest.raises(UserError, match="would delete data.tokenizer_dir"):
        train_command([f"--trainer.out_dir={run}", "--trainer.device=cpu", "--overwrite",
                       f"--data.tokenizer_dir={run / 'tokenizer'}"])
    assert (run / "tokenizer" / "vocab.json").is_file()


def test_a_run_that_fails_to_start_leaves_no_run_directory(cfg, tmp_path):
    run = tmp_path / "runs" / "new"
    with pytest.raises(UserError, match="data.tokenizer_dir .* is not a directory"):
        train_command([f"--trainer.out_dir={run}", f"--data.train_path={cfg.data.train_path}",
                       f"--data.tokenizer_dir={tmp_path / 'typo'}", "--trainer.device=cpu"])
    assert not run.exists()
    # a directory the user made beforehand stays
    run.mkdir(parents=True)
    with pytest.raises(UserError, match="is not a directory"):
        train_command([f"--trainer.out_dir={run}", f"--data.train_path={cfg.data.train_path}",
                       f"--data.tokenizer_dir={tmp_path / 'typo'}", "--trainer.device=cpu"])
    assert run.is_dir() and not any(run.iterdir())


def test_overwrite_keeps_the_previous_run_until_the_new_one_starts(cfg, tmp_path):
    from scratchlm.config import save_config

    save_config(cfg, tmp_path / "c.toml")
    run = tmp_path / "run"
    args = [str(tmp_path / "c.toml"), f"--trainer.out_dir={run}", "--trainer.max_steps=2"]
    assert train_command(args) == 0
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    metrics = (run / "metrics.jsonl").read_text()
    # a typo in the new run's inputs: the old run is still there, whole
    with pytest.raises(UserError, match="is not a directory"):
        train_command(args + ["--overwrite", f"--data.tokenizer_dir={tmp_path / 'typo'}"])
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    assert (run / "metrics.jsonl").read_text() == metrics
    assert not any(p.name.endswith(".replaced") for p in tmp_path.iterdir())
    # a new run that starts replaces it, and nothing is left aside
    assert train_command(args + ["--overwrite", "--trainer.max_steps=3"]) == 0
    assert [s for s, _ in _losses(run)] == [1, 2, 3]
    assert not any(p.name.endswith(".replaced") for p in tmp_path.iterdir())


def test_a_resume_that_fails_keeps_the_run(cfg, tmp_path):
    from scratchlm.config import save_config

    save_config(cfg, tmp_path / "c.toml")
    run = tmp_path / "run"
    args = [str(tmp_path / "c.toml"), f"--trainer.out_dir={run}", "--trainer.max_steps=2"]
    assert train_command(args) == 0
    with pytest.raises(UserError, match="is not a directory"):
        train_command(args + ["--resume", f"--data.tokenizer_dir={tmp_path / 'typo'}"])
    assert [s for s, _ in _losses(run)] == [1, 2]
