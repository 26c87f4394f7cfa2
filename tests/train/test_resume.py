"""Resuming and recovering runs: a missing `latest`, damaged checkpoints, an explicit step to
resume from, and pruning that never removes checkpoints this run did not write."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from scratchlm.errors import UserError
from scratchlm.train import checkpoint as ckpt
from scratchlm.cli.train import run_training
from scratchlm.train.data_feed import TrainData
from scratchlm.train.metrics import read_metrics
from tests.train.small_runs import make_cfg

@pytest.fixture
def cfg(tmp_path):
    return make_cfg(tmp_path)


def with_out(cfg, out):
    return replace(cfg, trainer=replace(cfg.trainer, out_dir=str(out)))


def train_steps(run):
    return [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["event"] == "train"]


def train_losses(run):
    return [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl") if r["event"] == "train"]


def step_names(run):
    return [p.name for p in ckpt.list_steps(run)]


def stop_at(cfg, run, step):
    """Train `run` and lose the process right after the checkpoint at `step`."""
    calls = {"n": 0}
    real = TrainData.next_batch

    def crash(self, device):
        calls["n"] += 1
        if calls["n"] == step + 1:
            raise RuntimeError("node lost")
        return real(self, device)

    TrainData.next_batch = crash
    try:
        with pytest.raises(RuntimeError, match="node lost"):
            run_training(with_out(cfg, run))
    finally:
        TrainData.next_batch = real


# ---------------------------------------------------------------- resume without `latest`


def test_resume_without_latest_continues_from_the_newest_step_and_keeps_the_log(cfg, tmp_path, caplog):
    straight, run = tmp_path / "straight", tmp_path / "run"
    run_training(with_out(cfg, straight))
    stop_at(replace(cfg, trainer=replace(cfg.trainer, keep_checkpoints=5)), run, 8)
    (run / "checkpoints" / "latest").unlink()
    assert train_steps(run) == list(range(1, 9))
    with caplog.at_level(logging.WARNING, logger="scratchlm"):
        run_training(replace(cfg, trainer=replace(cfg.trainer, keep_checkpoints=5)), resume=True)
    assert "step_000008" in caplog.text
    assert train_losses(run) == train_losses(straight)  # continued at step 8: nothing retrained, nothing lost
    assert step_names(run) == ["step_000004", "step_000008", "step_000012"]


def test_resume_without_latest_refuses_a_damaged_newest_step_and_names_the_intact_one(cfg, tmp_path):
    run = tmp_path / "run"
    stop_at(replace(cfg, trainer=replace(cfg.trainer, keep_checkpoints=5)), run, 8)
    (run / "checkpoints" / "latest").unlink()
    weights = run / "checkpoints" / "step_000008" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    metrics_before, config_before = (run / "metrics.jsonl").read_text(), (run / "config.toml").read_text()
    with pytest.raises(UserError) as err:
        run_training(replace(cfg, trainer=replace(cfg.trainer, max_steps=20)), resume=True)
    message = str(err.value)
    assert "\n" not in message and str(weights) in message and "step_000004" in message
    assert (run / "metrics.jsonl").read_text() == metrics_before
    assert (run / "config.toml").read_text() == config_before  # a refused resume changes nothing
    assert step_names(run) == ["step_000004", "step_000008"]


def test_resume_of_a_run_killed_before_its_first_checkpoint_keeps_its_log(cfg, tmp_path):
    run = tmp_path / "run"
    stop_at(replace(cfg, trainer=replace(cfg.trainer, checkpoint_interval=10)), run, 3)
    assert not step_names(run)
    before = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in before if r["event"] == "train"] == [1, 2, 3]
    run_training(cfg, resume=True)
    assert train_steps(run) == list(range(1, 13))  # started over, as there was nothing to resume
    assert read_metrics(run / "metrics.dropped.jsonl") == before  # and the lost run's log is kept


def test_a_fresh_run_in_an_empty_resume_directory_starts_at_zero(cfg, tmp_path):
    run_training(cfg, resume=True)  # scripts that always pass --resume
    assert train_steps(tmp_path / "run") == list(range(1, 13))
    assert not (tmp_path / "run" / "metrics.dropped.jsonl").exists()


def test_resuming_a_finished_run_writes_nothing_and_says_so(cfg, tmp_path, caplog):
    run = tmp_path / "run"
    run_training(cfg)
    files = ("metrics.jsonl", "config.toml")
    before = {name: (run / name).read_text() for name in files}
    with caplog.at_level(logging.INFO, logger="scratchlm"):
        run_training(replace(cfg, trainer=replace(cfg.trainer, eval_interval=2)), resume=True)
    assert {name: (run / name).read_text() for name in files} == before  # no second "end" record
    assert "already finished at step 12" in caplog.text
    assert not (run / "metrics.dropped.jsonl").exists()
    # a larger max_steps is not finished: it trains on and ends once more, at its new end
    run_training(replace(cfg, trainer=replace(cfg.trainer, max_steps=16)), resume=True)
    ends = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["event"] == "end"]
    assert ends == [12, 16] and train_steps(run) == list(range(1, 17))


def test_resuming_an_unfinished_run_past_a_lowered_max_steps_is_refused(cfg, tmp_path):
    """It used to train nothing and log no end, after rewriting config.toml with the lower max_steps."""
    run = tmp_path / "run"
    stop_at(cfg, run, 8)
    files = ("metrics.jsonl", "config.toml")
    before = {name: (run / name).read_text() for name in files}
    with pytest.raises(UserError, match=r"step_000008 is at step 8, past trainer.max_steps=6: set trainer.max_steps "
                                        r"above 8"):
        run_training(replace(cfg, trainer=replace(cfg.trainer, max_steps=6)), resume=True)
    assert {name: (run / name).read_text() for name in files} == before
    run_training(cfg, resume=True)  # with its own max_steps it trains on and ends
    assert train_steps(run) == list(range(1, 13))


def test_resuming_a_run_directory_that_train_did_not_write_is_refused(cfg, tmp_path):
    """An sft/grpo/dpo output (weights and {"step"} only) was a KeyError: 'world_size'."""
    from scratchlm.config import config_to_toml
    from scratchlm.model.transformer import build_model

    run = tmp_path / "run"
    run.mkdir()
    config_text = "[model]\n" + config_to_toml(cfg.model)
    (run / "config.toml").write_text(config_text)
    ckpt.save_run_checkpoint(run, 4, model_state=build_model(cfg.model).state_dict(), optimizer_state=None,
                             state={"step": 4}, config_text=config_text, keep=1)
    with pytest.raises(UserError, match="step_000004 holds no training state .* cannot be resumed"):
        run_training(cfg, resume=True)
    assert (run / "config.toml").read_text() == config_text and not (run / "metrics.jsonl").exists()


# ---------------------------------------------------------------- pruning


def test_pruning_never_removes_steps_newer_than_the_one_committed(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (10, 20, 30):
        ckpt.save_run_checkpoint(tmp_path, step, model_state=model.state_dict(), optimizer_state=opt.state_dict(),
                                 state={"step": step}, config_text="", keep=5)
    ckpt.save_run_checkpoint(tmp_path, 5, model_state=model.state_dict(), optimizer_state=opt.state_dict(),
                             state={"step": 5}, config_text="", keep=1)
    assert step_names(tmp_path) == ["step_000005", "step_000010", "step_000020", "step_000030"]


# ---------------------------------------------------------------- damaged checkpoints


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # flip a few bytes in the middle, as a bad disk or copy does
        for i in range(len(data) // 2, len(data) // 2 + 8):
            data[i] ^= 0x5A
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "state.pt"])
@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_a_damaged_latest_checkpoint_is_refused_naming_the_file_and_the_intact_one(cfg, tmp_path, name, how):
    run = tmp_path / "run"
    stop_at(cfg, run, 8)
    damaged = run / "checkpoints" / "step_000008" / name
    _damage(damaged, how)
    metrics_before = (run / "metrics.jsonl").read_text()
    with pytest.raises(UserError) as err:
        run_training(cfg, resume=True)
    message = str(err.value)
    assert "\n" not in message and str(damaged) in message and "damaged" in message
    assert "step_000004" in message and "resume" in message
    assert (run / "metrics.jsonl").read_text() == metrics_before
    assert step_names(run) == ["step_000004", "step_000008"]


def test_resume_from_an_older_step_sets_newer_ones_aside_and_replays_bitwise(cfg, tmp_path):
    straight, run = tmp_path / "straight", tmp_path / "run"
    run_training(with_out(cfg, straight))
    stop_at(cfg, run, 8)
    _damage(run / "checkpoints" / "step_000008" / "optimizer.pt", "flip")
    dropped = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > 4]
    run_training(cfg, resume="step_000004")
    assert train_losses(run) == train_losses(straight)
    assert step_names(run) == ["step_000008", "step_000012"]
    aside = [p.name for p in (run / "checkpoints").iterdir() if "step_000008" in p.name and p.name != "step_000008"]
    assert len(aside) == 1 and (run / "checkpoints" / aside[0] / "optimizer.pt").is_file()  # kept, not deleted
    assert read_metrics(run / "metrics.dropped.jsonl") == dropped


def test_resume_from_a_step_that_does_not_exist(cfg, tmp_path):
    run = tmp_path / "run"
    stop_at(cfg, run, 8)
    with pytest.raises(UserError, match=r"step_000006.*step_000004, step_000008"):
        run_training(cfg, resume=6)


def test_a_checkpoint_without_checksums_still_resumes_with_one_warning(cfg, tmp_path, caplog):
    straight, run = tmp_path / "straight", tmp_path / "run"
    run_training(with_out(cfg, straight))
    stop_at(cfg, run, 8)
    for step in ("step_000004", "step_000008"):
        (run / "checkpoints" / step / ckpt.CHECKSUMS).unlink()  # as checkpoints written before them
    with caplog.at_level(logging.WARNING, logger="scratchlm"):
        run_training(cfg, resume=True)
    assert [r.name for r in caplog.records if ckpt.CHECKSUMS in r.getMessage()] == ["scratchlm.train"]  # once
    assert train_losses(run) == train_losses(straight)


def test_a_truncated_old_checkpoint_without_checksums_is_named(cfg, tmp_path):
    run = tmp_path / "run"
    stop_at(cfg, run, 8)
    step8 = run / "checkpoints" / "step_000008"
    (step8 / ckpt.CHECKSUMS).unlink()
    _damage(step8 / "optimizer.pt", "truncate")
    with pytest.raises(UserError, match=rf"{step8 / 'optimizer.pt'}.*damaged.*step_000004"):
        run_training(cfg, resume=True)


# ---------------------------------------------------------------- config keys added later


def test_a_run_written_before_newer_model_keys_existed_resumes(cfg, tmp_path):
    # A config.toml written before a model field existed does not name it; the field's default
    # is what that run trained with, so resuming it with today's defaults is the same model.
    run = tmp_path / "old"
    stop_at(cfg, run, 4)
    saved = run / "config.toml"
    later = ("qk_norm", "qkv_bias", "logit_softcap", "zero_init_output", "moe_aux_scope")
    lines = saved.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.split("=")[0].strip() not in later]
    assert len(lines) - len(kept) == len(later)
    saved.write_text("\n".join(kept) + "\n", encoding="utf-8")
    run_training(with_out(cfg, run), resume=True)
    assert train_steps(run)[-1] == cfg.trainer.max_steps
    # a field the saved config does name still has to match
    changed = replace(cfg, model=replace(cfg.model, qk_norm=True))
    with pytest.raises(UserError, match=r"differs from this config in model\.qk_norm$"):
        run_training(with_out(changed, run), resume=True)


# ---------------------------------------------------------------- optimizer settings changed on resume


@pytest.mark.parametrize("optim", [dict(weight_decay=0.5, beta1=0.5, beta2=0.9, eps=1e-6),
                                   dict(name="muon", muon_lr=0.05, muon_momentum=0.8)])
def test_a_resumed_run_steps_with_the_optimizer_settings_of_its_config(cfg, tmp_path, optim):
    # Loading the optimizer state put the checkpoint's betas, weight decay, eps and Muon rate back
    # into the parameter groups: the changed settings were recorded in config.toml but not used.
    from scratchlm.train.trainer import Trainer

    first = replace(cfg, optim=replace(cfg.optim, name=optim.get("name", "adamw")))
    run = tmp_path / "run"
    stop_at(first, run, 4)
    changed = replace(cfg, optim=replace(cfg.optim, **optim))
    resumed = Trainer(with_out(changed, run), run, resume=True)
    fresh = Trainer(with_out(changed, tmp_path / "fresh"), tmp_path / "fresh")
    try:
        assert resumed.step == 4
        for got, want in zip(resumed.optimizer.param_groups, fresh.optimizer.param_groups, strict=True):
            assert {k: v for k, v in got.items() if k != "params"} == {k: v for k, v in want.items() if k != "params"}
        assert resumed.optimizer.state  # the moments still come from the checkpoint
    finally:
        resumed.logger.close()
        fresh.logger.close()


def test_resuming_with_other_parameter_groups_is_one_line(cfg, tmp_path):
    # optim.decay_vectors moves the norm gains into the decayed group: loading the optimizer state
    # was a ValueError ("different number of parameter groups") reported as unexpected.
    run = tmp_path / "run"
    stop_at(cfg, run, 4)
    changed = with_out(replace(cfg, optim=replace(cfg.optim, decay_vectors=True)), run)
    with pytest.raises(UserError, match=r"trained with optim.decay_vectors=False, this config has True; .* "
                                        r"keep optim.decay_vectors=False$"):
        run_training(changed, resume=True)
    (run / "config.toml").unlink()  # nothing to compare with: the optimizer state itself refuses
    with pytest.raises(UserError, match=r"optimizer.pt does not fit this config's optimizer \(.*\); resume with "
                                        "the optim.name and optim.decay_vectors the run trained with"):
        run_training(changed, resume=True)
    assert train_steps(run) == [1, 2, 3, 4]


def test_resuming_with_another_seed_is_refused(cfg, tmp_path):
    # The sampler and RNG states come from the checkpoint: the new seed was written to config.toml
    # and ignored.
    run = tmp_path / "run"
    stop_at(cfg, run, 4)
    with pytest.raises(UserError, match=r"step_000004 trained with trainer.seed=0; .* keep trainer.seed=0"):
        run_training(with_out(replace(cfg, trainer=replace(cfg.trainer, seed=5)), run), resume=True)
    assert "seed = 0" in (run / "config.toml").read_text()
    assert train_steps(run) == [1, 2, 3, 4]


def _shorter_training_file(cfg, tmp_path):
    from tests.train.small_runs import write_tokens

    return replace(cfg, data=replace(cfg.data, train_path=write_tokens(tmp_path / "short.bin", 3000, 0)))


@pytest.mark.parametrize("change, message", [
    # was "sampler state has batch_size=4 but this run has 2", naming neither key that changed
    (lambda cfg, _: replace(cfg, trainer=replace(cfg.trainer, grad_accum_steps=2)),
     r"trained on micro-batches of 4 sequences \(trainer.batch_size / trainer.grad_accum_steps = 4 / 2 = 2 here\)"),
    (lambda cfg, _: replace(cfg, trainer=replace(cfg.trainer, batch_size=8)), "trained on micro-batches of 4 sequences"),
    # was "sampler state has num_tokens=4000 but this run has 3000", naming no file
    (_shorter_training_file, r"trained on a file of 4,000 tokens, but data.train_path .*short.bin holds 3,000: "
                             "resume with the training file the run started with"),
])
def test_resuming_a_data_stream_that_cannot_continue_names_the_setting(cfg, tmp_path, change, message):
    run = tmp_path / "run"
    stop_at(cfg, run, 4)
    with pytest.raises(UserError, match=message):
        run_training(with_out(change(cfg, tmp_path), run), resume=True)
    assert train_steps(run) == [1, 2, 3, 4]
