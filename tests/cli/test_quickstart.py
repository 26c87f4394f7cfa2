import json

import pytest

from scratchlm.cli import quickstart as qs
from scratchlm.errors import UserError
from scratchlm.train.metrics import read_metrics

TINY = ["--model.d_model=32", "--model.num_heads=2", "--model.d_ff=64", "--model.num_layers=1",
        "--model.context_length=32", "--trainer.batch_size=4", "--trainer.eval_batches=1",
        "--trainer.sample_tokens=8"]


def test_quickstart_pipeline_end_to_end_with_a_tiny_budget(tmp_path, capsys):
    out = tmp_path / "qs"
    assert qs.quickstart_command(["--out", str(out), "--steps", "4", "--corpus-mb", "0.05",
                                  "--vocab-size", "300", *TINY]) == 0
    result = json.loads((out / qs.MARKER).read_text())
    assert result["steps"] == 4 and result["vocab_size"] == 300 and result["train_tokens"] > 1000
    records = read_metrics(out / "metrics.jsonl")
    evals = [r for r in records if r["event"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 4
    for name in ("loss.png", "lr.png", "samples.txt", "tokenizer/vocab.json", "data/train.bin", "data/valid.json"):
        assert (out / name).is_file(), name
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000004"
    printed = capsys.readouterr().out
    assert "[4/4] training: 4 steps" in printed and "validation loss" in printed
    # A second quickstart replaces the first; the run directory loads like any other.
    assert qs.quickstart_command(["--out", str(out), "--steps", "2", "--corpus-mb", "0.05",
                                  "--vocab-size", "300", *TINY]) == 0
    from scratchlm.train.checkpoint import load_trained_model

    model, cfg, tokenizer = load_trained_model(out)
    assert cfg.d_model == 32 and tokenizer is not None and tokenizer.vocab_size == 300


def test_refuses_to_replace_a_directory_that_is_not_a_quickstart(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a quickstart run"):
        qs.prepare_out_dir(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_plan_steps_fits_the_budget():
    from scratchlm.config import load_config
    from scratchlm.train.config import TrainConfig

    cfg = load_config(TrainConfig, "quickstart")
    assert qs.plan_steps(0.5, 150, cfg, cap=1000) == int(150 / 0.5 - 5 * cfg.trainer.eval_batches / 3)
    assert qs.plan_steps(100.0, 150, cfg, cap=1000) == 20
    assert qs.plan_steps(0.001, 150, cfg, cap=1000) == 1000


@pytest.mark.parametrize("flags, message", [
    (["--minutes", "nan"], "--minutes must be a positive number, got nan"),  # was a ValueError after encoding
    (["--minutes", "inf"], "--minutes must be a positive number, got inf"),  # was an OverflowError
    (["--corpus-mb", "nan"], "--corpus-mb must be a positive number, got nan"),
    # (a text file was then reported as "empty, blank or only separators")
    (["--corpus-mb", "1e-9"], "--corpus-mb 1e-09 is less than one byte, so no text would be read"),
    (["--steps", "0"], "--steps must be a positive number, got 0"),
    (["--vocab-size", "256"], "--vocab-size must be at least 257"),
])
def test_bad_numbers_are_refused_before_anything_is_written(tmp_path, flags, message):
    with pytest.raises(UserError, match=message):
        qs.quickstart_command(["--out", str(tmp_path / "qs"), *flags])
    assert not (tmp_path / "qs").exists()



def test_an_empty_out_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    # --out $OUT with OUT unset: "ValueError: PosixPath('.') has an empty name" in an empty directory.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="--out is empty; name the run directory"):
        qs.quickstart_command(["--out", "", "--steps", "1"])
    assert not any(tmp_path.iterdir())


def test_a_token_file_as_the_data_is_refused_before_anything_is_written(tmp_path):
    import numpy as np

    np.arange(1000, dtype="<u2").tofile(tmp_path / "train.bin")
    (tmp_path / "train.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 1000,
                                                     "tokenizer_hash": "abc", "num_tokens": 1000}))
    with pytest.raises(UserError, match="is a token file"):
        qs.quickstart_command(["--data", str(tmp_path / "train.bin"), "--out", str(tmp_path / "qs"), "--steps", "1"])
    assert not (tmp_path / "qs").exists()


def test_a_bad_data_file_keeps_the_previous_run(tmp_path):
    out = tmp_path / "qs"
    qs.prepare_out_dir(out)
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="neither a text file nor a dataset name"):
        qs.quickstart_command(["--out", str(out), "--data", str(tmp_path / "typo.txt"), "--steps", "1"])
    assert (out / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize("override, message", [
    ("--optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("--model.d_model=0", "model.d_model must be positive"),
    ("--optim.lr=abc", "optim.lr must be a number"),
    # an IndexError after the whole run had trained (no validation), or ignored
    ("--data.val_path=", "the quickstart sets data.val_path itself"),
    ("--data.tokenizer_dir=tok", "the quickstart sets data.tokenizer_dir itself"),
    ("--trainer.out_dir=elsewhere", "the quickstart sets trainer.out_dir itself"),
    # trained 100 steps with --steps 1, evaluating and logging every step as planned for 1
    ("--trainer.max_steps=100", "the quickstart sets trainer.max_steps itself, from --steps or --minutes"),
])
def test_a_bad_override_keeps_the_previous_run_and_trains_no_tokenizer(tmp_path, monkeypatch, override, message):
    # The overrides were read only after the corpus, the tokenizer and the token files: the
    # previous quickstart in --out was deleted by then.
    out = tmp_path / "qs"
    qs.prepare_out_dir(out)
    (out / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setattr(qs, "build_corpus", lambda *a: pytest.fail("the corpus was built before the overrides were read"))
    with pytest.raises(UserError, match=message):
        qs.quickstart_command(["--out", str(out), "--steps", "1", override])
    assert (out / "metrics.jsonl").read_text() == "{}\n"


def test_a_corpus_write_that_fails_leaves_no_cut_file(tmp_path, cut_writes):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a small corpus\n" for i in range(2000)), encoding="utf-8")
    out = tmp_path / "qs"
    cut_writes(after=1)  # the marker is written, the training text is cut short by a full disk
    with pytest.raises(OSError, match="No space left"):
        qs.quickstart_command(["--out", str(out), "--data", str(corpus), "--steps", "1", *TINY])
    assert not out.exists()  # what the run had built is gone: no cut train.txt, no temporary file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


def _previous_run(out):
    qs.prepare_out_dir(out)
    (out / "metrics.jsonl").write_text("{}\n")


def test_a_corpus_too_small_for_one_window_keeps_the_previous_run(tmp_path):
    # The window check came from the trainer, after the previous run in --out was deleted.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a few words\n" * 40, encoding="utf-8")
    out = tmp_path / "qs"
    _previous_run(out)
    with pytest.raises(UserError, match="encodes to .* tokens, too few for one window of context_length 32"):
        qs.quickstart_command(["--out", str(out), "--data", str(corpus), "--steps", "1", "--vocab-size", "300", *TINY])
    assert (out / "metrics.jsonl").read_text() == "{}\n" and not (out / "tokenizer").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "qs"]  # nothing set aside is left


def test_an_interrupt_while_building_the_data_keeps_the_previous_run(tmp_path, monkeypatch):
    out = tmp_path / "qs"
    _previous_run(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("scratchlm.tokenizer.train.train_bpe", interrupted)
    with pytest.raises(KeyboardInterrupt):
        qs.quickstart_command(["--out", str(out), "--steps", "1", "--corpus-mb", "0.05", "--vocab-size", "300", *TINY])
    assert (out / "metrics.jsonl").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qs"]


def test_a_run_killed_while_the_previous_one_was_set_aside_is_tidied_by_the_next(tmp_path):
    out = tmp_path / "qs"
    _previous_run(out)
    stale = out.with_name(".qs.previous")
    stale.mkdir()  # what a killed run leaves beside --out
    previous = qs.prepare_out_dir(out)
    assert previous == stale and (stale / "metrics.jsonl").is_file()  # the latest run, not the stale one
    qs.drop_previous(previous)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qs"]


def test_a_model_the_new_data_does_not_fit_keeps_the_previous_run(tmp_path):
    # The trainer refused the model only after the previous run in --out had been deleted.
    out = tmp_path / "qs"
    _previous_run(out)
    with pytest.raises(UserError, match="larger than model.vocab_size=100"):
        qs.quickstart_command(["--out", str(out), "--steps", "1", "--corpus-mb", "0.05", "--vocab-size", "300",
                               *TINY, "--model.vocab_size=100"])
    assert (out / "metrics.jsonl").read_text() == "{}\n" and not (out / "tokenizer").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qs"]


def test_options_the_trainer_refuses_together_fail_before_the_tokenizer_trains(tmp_path, monkeypatch):
    out = tmp_path / "qs"
    _previous_run(out)
    monkeypatch.setattr(qs, "build_corpus", lambda *a: pytest.fail("the corpus was built before the options were checked"))
    with pytest.raises(UserError, match="leave optim.cosine_steps unset"):
        qs.quickstart_command(["--out", str(out), "--steps", "1", "--trainer.time_budget_s=10", "--optim.cosine_steps=5"])
    assert (out / "metrics.jsonl").read_text() == "{}\n"
