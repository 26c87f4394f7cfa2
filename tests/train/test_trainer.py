import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from scratchlm.cli.train import run_training
from scratchlm.config import load_config
from scratchlm.errors import UserError
from scratchlm.train import trainer as trainer_mod
from scratchlm.train.config import TrainConfig, TrainerConfig
from scratchlm.train.data_feed import TrainData
from scratchlm.train.metrics import read_metrics
from tests.train.small_runs import VOCAB, crash_at_step_7_then_resume, losses, make_cfg

@pytest.fixture
def cfg(tmp_path):
    return make_cfg(tmp_path)


def _with_out(cfg, out):
    return replace(cfg, trainer=replace(cfg.trainer, out_dir=str(out)))


_losses = losses


def _weights(run_dir):
    from scratchlm.train.checkpoint import latest_step_dir, load_weights

    return load_weights(latest_step_dir(run_dir) / "model.safetensors")


def test_training_logs_checkpoints_evaluates_and_plots(cfg, tmp_path, capsys):
    run_training(cfg)
    run = tmp_path / "run"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["event"] for r in records][:2] == ["start", "eval"] and records[-1]["event"] == "end"
    assert [s for s, _ in _losses(run)] == list(range(1, 13))
    evals = _losses(run, "eval", "val_loss")
    assert [s for s, _ in evals] == [0, 4, 8, 12]
    assert evals[-1][1] < evals[0][1] - 0.5  # it learns the counter
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000008", "step_000012"]
    assert (run / "loss.png").stat().st_size > 1000 and (run / "lr.png").is_file()
    assert (run / "config.toml").is_file() and load_config(TrainConfig, run / "config.toml") == cfg
    start = records[0]
    assert start["versions"]["torch"] == torch.__version__ and "git_revision" in start
    train = records[2]
    assert train["mfu"] is None and train["tokens_per_s"] > 0 and train["lr"] == pytest.approx(5e-3)
    out = capsys.readouterr().out
    assert "step      0 | val loss" in out and "mfu n/a" in out


def test_a_deterministic_run_holds_the_deterministic_mode_only_while_it_trains(cfg, tmp_path, monkeypatch):
    cfg = replace(cfg, trainer=replace(cfg.trainer, deterministic=True, max_steps=2))
    seen = []
    step = trainer_mod.Trainer._train_step

    def spy(self):
        seen.append(torch.are_deterministic_algorithms_enabled())
        step(self)

    monkeypatch.setattr(trainer_mod.Trainer, "_train_step", spy)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        run_training(_with_out(cfg, tmp_path / "run"))
        assert seen == [True, True]
        assert not torch.are_deterministic_algorithms_enabled()  # as found, for the code after the run
        torch.use_deterministic_algorithms(True, warn_only=True)
        run_training(_with_out(cfg, tmp_path / "again"))
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("deterministic", [True, False])
def test_interrupted_and_resumed_run_logs_the_same_losses_bitwise(cfg, tmp_path, monkeypatch, deterministic):
    # On CPU this holds without deterministic mode too (README's resume note says so).
    cfg = replace(cfg, trainer=replace(cfg.trainer, deterministic=deterministic))
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    run_training(_with_out(cfg, straight))

    def steps_5_and_6_logged_then_lost():
        assert [s for s, _ in _losses(broken)] == list(range(1, 7))

    crash_at_step_7_then_resume(cfg, broken, monkeypatch, after_crash=steps_5_and_6_logged_then_lost)

    assert _losses(broken) == _losses(straight)  # exact floats, truncated steps replaced
    assert _losses(broken, "eval", "val_loss") == _losses(straight, "eval", "val_loss")
    a, b = _weights(straight), _weights(broken)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_a_partial_log_window(cfg, tmp_path):
    cfg = replace(cfg, trainer=replace(cfg.trainer, log_interval=3, checkpoint_interval=4, eval_interval=0))
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_training(_with_out(cfg, straight))
    trainer = trainer_mod.Trainer(_with_out(cfg, split), split)
    trainer.fit(until=4)  # stops mid-window (logs at 3, 6, ...)
    trainer.logger.close()
    run_training(_with_out(cfg, split), resume=True)
    assert _losses(split) == _losses(straight)


def test_a_crash_in_evaluation_keeps_the_checkpoint_and_resume_redoes_the_eval(cfg, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real = trainer_mod.evaluation_totals
    calls = {"n": 0}

    def failing_eval(model, batches):
        calls["n"] += 1
        if calls["n"] == 3:  # the eval at step 8
            raise RuntimeError("eval OOM")
        return real(model, batches)

    monkeypatch.setattr(trainer_mod, "evaluation_totals", failing_eval)
    with pytest.raises(RuntimeError, match="eval OOM"):
        run_training(cfg)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000008"
    monkeypatch.setattr(trainer_mod, "evaluation_totals", real)
    run_training(cfg, resume=True)
    assert [s for s, _ in _losses(run, "eval", "val_loss")] == [0, 4, 8, 12]


@pytest.mark.parametrize("poison_grad, message", [(True, "gradient norm became nan at step 4"),
                                                    (False, "loss became nan at step 6")])
def test_a_diverged_run_stops_before_it_saves_nan_weights(cfg, tmp_path, monkeypatch, poison_grad, message):
    """An update with a NaN gradient norm (logged at step 4), or NaN weights whose loss is not
    logged before the checkpoint at step 6, stop the run: `latest` stays the finite step 3."""
    run = tmp_path / "run"
    cfg = replace(cfg, trainer=replace(cfg.trainer, log_interval=4, checkpoint_interval=3))
    real = trainer_mod.Trainer._train_step

    def step(self):
        real(self)
        if self.step == (4 if poison_grad else 5):
            with torch.no_grad():
                for p in self.raw_model.parameters():
                    p.fill_(math.nan)
            if poison_grad:
                self._grad_norm = torch.tensor(math.nan)

    monkeypatch.setattr(trainer_mod.Trainer, "_train_step", step)
    with pytest.raises(UserError, match=message):
        run_training(cfg)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert all(torch.isfinite(w).all() for w in _weights(run).values())


def test_existing_run_dir_needs_resume_or_overwrite(cfg, tmp_path):
    run_training(cfg)
    with pytest.raises(UserError, match="already exists"):
        run_training(cfg)
    before = _losses(tmp_path / "run")
    run_training(cfg, overwrite=True)
    assert _losses(tmp_path / "run") == before  # deterministic, and the old log was replaced
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "thesis.tex").write_text("precious")
    with pytest.raises(UserError, match="does not look like a run"):
        run_training(_with_out(cfg, tmp_path / "other"), overwrite=True)
    assert (tmp_path / "other" / "thesis.tex").read_text() == "precious"


def test_resume_refuses_a_different_model(cfg, tmp_path):
    run_training(cfg)
    other = replace(cfg, model=replace(cfg.model, d_ff=64))
    with pytest.raises(UserError, match="model.d_ff"):
        run_training(other, resume=True)


def test_resume_without_the_run_config_refuses_weights_of_another_shape(cfg, tmp_path):
    # Without RUN/config.toml to compare, this was torch's RuntimeError from load_state_dict.
    run_training(cfg)
    run = tmp_path / "run"
    (run / "config.toml").unlink()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    other = replace(cfg, model=replace(cfg.model, d_ff=64))
    with pytest.raises(UserError, match=r"step_000012/model.safetensors do not fit this config's model: "
                                        r"\S+ has shape"):
        run_training(other, resume=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert [s for s, _ in _losses(run)][-1] == 12


# fields that do not change the trained weights' meaning: one picks the initialisation (the
# weights come from the checkpoint), the other how the same maths runs
@pytest.mark.parametrize("line, change", [('qkv_init = "fused"', dict(qkv_init="separate")),
                                          ("fused_projections = true", dict(fused_projections=False))])
def test_resume_accepts_a_run_written_before_a_field_existed_and_a_change_of_it(cfg, tmp_path, line, change):
    run_training(replace(cfg, trainer=replace(cfg.trainer, max_steps=8)))
    saved = tmp_path / "run" / "config.toml"
    text = saved.read_text()
    assert line in text
    saved.write_text(text.replace(line + "\n", ""))  # as an older run wrote it
    run_training(replace(cfg, model=replace(cfg.model, **change)), resume=True)
    assert [s for s, _ in _losses(tmp_path / "run")][-1] == 12


def test_gradient_accumulation_matches_one_big_batch(cfg, tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (4, 16), generator=gen)
    y = torch.randint(0, VOCAB, (4, 16), generator=gen)
    params = []
    for accum in (1, 2):
        c = replace(cfg, trainer=replace(cfg.trainer, grad_accum_steps=accum, out_dir=str(tmp_path / f"a{accum}")))
        trainer = trainer_mod.Trainer(c, tmp_path / f"a{accum}", logger=_Quiet())
        chunks = iter(zip(x.chunk(accum), y.chunk(accum)))
        monkeypatch.setattr(trainer.data, "next_batch", lambda device: next(chunks))
        trainer._train_step()
        params.append([p.detach().clone() for p in trainer.raw_model.parameters()])
    for a, b in zip(*params):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tie", [False, True])
def test_fused_lm_head_trains_like_the_plain_head(cfg, tmp_path, tie):
    # Same seed, same batches: the chunked head + loss must give the plain path's losses and weights.
    runs = {}
    for fused in (False, True):
        out = tmp_path / f"f{fused}"
        c = replace(cfg, model=replace(cfg.model, tie_embeddings=tie),
                    trainer=replace(cfg.trainer, fused_lm_head=fused, out_dir=str(out)))
        run_training(c)
        runs[fused] = (_losses(out), _weights(out))
    (plain_losses, plain_w), (fused_losses, fused_w) = runs[False], runs[True]
    assert [s for s, _ in fused_losses] == [s for s, _ in plain_losses]
    torch.testing.assert_close([v for _, v in fused_losses], [v for _, v in plain_losses], rtol=1e-4, atol=1e-5)
    assert plain_losses[-1][1] < plain_losses[0][1] - 0.5  # it learned: the comparison is not of two no-ops
    for name in plain_w:
        torch.testing.assert_close(fused_w[name], plain_w[name], rtol=1e-3, atol=1e-4)


class _Quiet:
    def log(self, record):
        pass

    def close(self):
        pass


def test_bad_inputs_are_user_errors(cfg, tmp_path):
    with pytest.raises(UserError, match="train_path is not set"):
        run_training(replace(cfg, data=replace(cfg.data, train_path="")))
    small_vocab = replace(cfg, model=replace(cfg.model, vocab_size=32))
    with pytest.raises(UserError, match="larger than model.vocab_size"):
        run_training(_with_out(small_vocab, tmp_path / "v"))
    with pytest.raises(ValueError, match="divisible"):
        TrainerConfig(batch_size=5, grad_accum_steps=2)


def test_a_warmup_longer_than_the_run_is_warned_about(cfg, tmp_path, caplog):
    import logging

    short = replace(cfg, optim=replace(cfg.optim, warmup_steps=30), trainer=replace(cfg.trainer, max_steps=3))
    with caplog.at_level(logging.WARNING, logger="scratchlm"):
        run_training(short)
    assert ("optim.warmup_steps=30 is not below trainer.max_steps=3: the learning rate rises for the whole run "
            "(to 10% of optim.lr=0.01) and never decays") in caplog.text
    assert [r["lr"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["event"] == "train"][-1] \
        == pytest.approx(1e-3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="scratchlm"):
        run_training(_with_out(cfg, tmp_path / "normal"))  # warmup_steps=2 of 12
    assert "warmup_steps" not in caplog.text


def test_options_the_run_never_reads_are_noted(cfg, tmp_path, caplog):
    import logging

    note = ('note: model.moe_top_k=4 has no effect (the moe_* options apply to model.ffn="moe"; this model\'s ffn '
            'is "swiglu")')
    moe_options = replace(cfg, model=replace(cfg.model, moe_top_k=4), trainer=replace(cfg.trainer, max_steps=1))
    with caplog.at_level(logging.WARNING, logger="scratchlm"):
        run_training(moe_options)
    assert note in caplog.messages
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="scratchlm"):
        run_training(_with_out(replace(cfg, trainer=replace(cfg.trainer, max_steps=1)), tmp_path / "normal"))
    assert not [m for m in caplog.messages if m.startswith("note:")]


@pytest.mark.parametrize("trainer, data, note", [
    ({"activation_checkpointing_every": 2}, {},
     "trainer.activation_checkpointing_every=2 has no effect (trainer.activation_checkpointing=false: no block is "
     "checkpointed)"),
    ({"sample_prompts": ["Once"], "sample_top_p": 0.5}, {},
     'trainer.sample_prompts=["Once"], trainer.sample_top_p=0.5 have no effect (trainer.sample_tokens=0: the run '
     'draws no samples)'),
    ({"sample_tokens": 8, "sample_temperature": 0.0, "sample_top_p": 0.5}, {},
     "trainer.sample_top_p=0.5 has no effect (trainer.sample_temperature=0 samples greedily)"),
    ({"fp8_recipe": "rowwise"}, {},
     'trainer.fp8_recipe="rowwise" has no effect (trainer.fp8=false: the matmuls run in the compute dtype)'),
    ({"final_eval_full": True}, {"val_path": ""},
     "trainer.eval_interval=4, trainer.eval_batches=2, trainer.final_eval_full=true have no effect (data.val_path "
     "is empty: the run never evaluates)"),
])
def test_trainer_options_without_effect_are_noted(cfg, trainer, data, note):
    cfg = replace(cfg, trainer=replace(cfg.trainer, **trainer), data=replace(cfg.data, **data))
    assert trainer_mod.ignored_options(cfg, torch.device("cpu")) == [note]


@pytest.mark.parametrize("trainer", [
    {"activation_checkpointing": True, "activation_checkpointing_every": 2},
    {"sample_tokens": 8, "sample_prompts": ["Once"], "sample_top_p": 0.5},
    {"sample_tokens": 8, "sample_temperature": 0.0},
    {"fp8": True, "fp8_recipe": "rowwise"},
    {"final_eval_full": True, "eval_at_start": False},
])
def test_trainer_options_with_effect_are_not_noted(cfg, trainer):
    cfg = replace(cfg, trainer=replace(cfg.trainer, **trainer))
    assert trainer_mod.ignored_options(cfg, torch.device("cpu")) == []


def test_optimizer_options_without_effect_are_noted(cfg):
    assert trainer_mod.ignored_options(replace(cfg, optim=replace(cfg.optim, muon_momentum=0.9)), torch.device("cpu")) \
        == ['optim.muon_momentum=0.9 has no effect (the muon_* options apply to optim.name="muon"; this run\'s '
            'optimizer is "adamw")']


def test_parallel_options_without_effect_are_noted(cfg):
    # (the single-process strategy starts no process group: its backend and timeout were never read)
    single = replace(cfg, parallel=replace(cfg.parallel, backend="gloo", timeout_s=60.0))
    assert trainer_mod.ignored_options(single, torch.device("cpu")) \
        == ['parallel.backend="gloo", parallel.timeout_s=60.0 have no effect (parallel.strategy="none" trains in '
            'one process: no process group, no gradient communication)']
    assert trainer_mod.ignored_options(cfg, torch.device("cpu")) == []


@pytest.mark.parametrize("trainer, device, note", [
    ({"compile_mode": "max-autotune"}, "cpu",
     'trainer.compile_mode="max-autotune" has no effect (trainer.compile=false: the model runs eagerly)'),
    ({"compile_scope": "blocks", "compile_eval": True}, "cuda",
     'trainer.compile_scope="blocks", trainer.compile_eval=true have no effect (trainer.compile=false: the model '
     'runs eagerly)'),
    ({"compile": True, "compile_mode": "reduce-overhead"}, "cpu",
     'trainer.compile_mode="reduce-overhead" has no effect on cpu (its CUDA graphs need a CUDA device); the model '
     'compiles as with "default"'),
    ({"compile_backend": "cudagraphs"}, "cuda",
     'trainer.compile_backend="cudagraphs" has no effect (trainer.compile=false: the model runs eagerly)'),
    ({"compile": True, "compile_backend": "cudagraphs"}, "cpu",
     'trainer.compile_backend="cudagraphs" has no effect on cpu (it replays CUDA graphs); the model runs eagerly'),
    ({"compile": True, "compile_backend": "cudagraphs", "compile_mode": "max-autotune"}, "cuda",
     'trainer.compile_mode="max-autotune" has no effect (compile_mode is Inductor\'s; trainer.compile_backend='
     '"cudagraphs" generates no code)'),
])
def test_compile_options_without_effect_are_noted(cfg, trainer, device, note):
    cfg = replace(cfg, trainer=replace(cfg.trainer, **trainer))
    assert trainer_mod.ignored_options(cfg, torch.device(device)) == [note]


@pytest.mark.parametrize("trainer, device", [
    ({}, "cpu"), ({"compile": True, "compile_mode": "max-autotune", "compile_eval": True}, "cpu"),
    ({"compile": True, "compile_mode": "reduce-overhead"}, "cuda"),
    ({"compile": True, "compile_scope": "blocks"}, "cpu"),
    ({"compile": True, "compile_backend": "cudagraphs"}, "cuda"),
])
def test_compile_options_with_effect_are_not_noted(cfg, trainer, device):
    cfg = replace(cfg, trainer=replace(cfg.trainer, **trainer))
    assert trainer_mod.ignored_options(cfg, torch.device(device)) == []


def test_a_time_budget_stops_with_checkpoint_eval_and_end(cfg, tmp_path):
    import time

    trainer = trainer_mod.Trainer(cfg, tmp_path / "run")
    trainer.fit(deadline=time.monotonic())  # already past: one step, then wrap up
    trainer.logger.close()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["event"], r["step"]) for r in records[1:]] == [("eval", 0), ("train", 1), ("eval", 1), ("end", 1)]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert (tmp_path / "run" / "loss.png").is_file()


# ---------------------------------------------------------------- mixture of experts


def _moe(cfg, **trainer):
    """cfg with a 4-expert top-2 MoE FFN whose capacity drops some assignments."""
    model = replace(cfg.model, ffn="moe", moe_num_experts=4, moe_top_k=2, moe_capacity_factor=1.0,
                    moe_aux_coef=0.5, moe_z_coef=0.25)  # large, so a missing term shows in the gradients
    return replace(cfg, model=model, trainer=replace(cfg.trainer, **trainer))


def _first_step_grads(cfg, tmp_path, monkeypatch, name):
    """(gradients of the first update, the trainer) with clipping off."""
    cfg = replace(_with_out(cfg, tmp_path / name), optim=replace(cfg.optim, grad_clip=0.0))
    trainer = trainer_mod.Trainer(cfg, tmp_path / name)
    grads = {}

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.raw_model.named_parameters()})

    monkeypatch.setattr(trainer.optimizer, "step", capture)
    trainer.fit(until=1)
    trainer.logger.close()
    return grads, trainer


def _reference_grads(cfg):
    """Gradients of cross-entropy (+ coefficient-weighted aux losses of an MoE), summed over micro-batches / accum."""
    from scratchlm.model.moe import moe_aux_loss
    from scratchlm.model.transformer import build_model
    from scratchlm.train.trainer import seed_everything

    tc, mc = cfg.trainer, cfg.model
    seed_everything(tc.seed, tc.deterministic)
    data = TrainData(cfg.data, mc, batch_size=tc.batch_size // tc.grad_accum_steps, seed=tc.seed)
    model = build_model(mc)
    for _ in range(tc.grad_accum_steps):
        x, y = data.next_batch(torch.device("cpu"))
        logits = model(x)
        from scratchlm.model.functional import cross_entropy

        aux = moe_aux_loss(model, mc.moe_aux_coef, mc.moe_z_coef) if mc.ffn == "moe" else 0.0
        loss = cross_entropy(logits, y) + aux
        (loss / tc.grad_accum_steps).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("every, checkpointed", [(1, [True, True]), (2, [True, False])])
def test_activation_checkpointing_every_kth_block(cfg, tmp_path, every, checkpointed):
    tc = replace(cfg.trainer, activation_checkpointing=True, activation_checkpointing_every=every)
    trainer = trainer_mod.Trainer(replace(cfg, trainer=tc), tmp_path / "run", logger=_Quiet())
    from scratchlm.train.activation_checkpoint import _ORIGINAL_FORWARD

    assert [_ORIGINAL_FORWARD in b.__dict__ for b in trainer.raw_model.layers] == checkpointed
    with pytest.raises(UserError, match="activation_checkpointing_every"):
        load_config(TrainConfig, None, ["--trainer.activation_checkpointing_every=0"])


@pytest.mark.parametrize("options", [dict(), dict(grad_accum_steps=2), dict(activation_checkpointing=True)],
                         ids=["plain", "accum", "checkpointing"])
def test_moe_training_backpropagates_the_aux_losses_once(cfg, tmp_path, monkeypatch, options):
    cfg = _moe(cfg, eval_at_start=False, **options)
    grads, _ = _first_step_grads(cfg, tmp_path, monkeypatch, "run")
    expected = _reference_grads(cfg)
    assert grads.keys() == expected.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)
    # Without the aux terms the router gradients differ: the comparison above can fail.
    no_aux = replace(cfg, model=replace(cfg.model, moe_aux_coef=0.0, moe_z_coef=0.0))
    plain, _ = _first_step_grads(no_aux, tmp_path, monkeypatch, "no_aux")
    router = "layers.0.ffn.router.weight"
    assert not torch.allclose(plain[router], expected[router], rtol=1e-3, atol=1e-6)


def test_moe_training_logs_router_stats(cfg, tmp_path, capsys):
    cfg = _moe(cfg, log_interval=3)
    run_training(cfg)
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["event"] == "train"]
    assert [r["step"] for r in records] == [3, 6, 9, 12]
    for r in records:
        assert r["moe_aux_loss"] >= 1.0 - 1e-6  # E·Σ f·P is at least 1 (equality: uniform routing)
        assert r["moe_z_loss"] > 0 and 0 < r["moe_router_entropy"] <= math.log(4) + 1e-6
        assert 0 < r["moe_dropped_fraction"] < 1  # capacity factor 1 with uneven routing drops some
        util = r["moe_expert_util"]
        assert len(util) == 2 and all(len(row) == 4 and sum(row) == pytest.approx(1.0) for row in util)
        assert r["moe_max_expert_util"] == max(max(row) for row in util)
    out = capsys.readouterr().out
    assert "| aux " in out and "| drop " in out and "| util " in out


def test_moe_logged_loss_is_the_cross_entropy(cfg, tmp_path):
    cfg = _moe(cfg, max_steps=1, eval_at_start=False)
    run_training(cfg)
    no_aux = replace(cfg, model=replace(cfg.model, moe_aux_coef=0.0, moe_z_coef=0.0))
    run_training(_with_out(no_aux, tmp_path / "no_aux"))
    # Same weights and batch at step 1: the cross-entropy is the same whatever the coefficients.
    assert _losses(tmp_path / "run") == _losses(tmp_path / "no_aux")


def test_moe_interrupted_and_resumed_run_logs_the_same_bitwise(cfg, tmp_path, monkeypatch):
    cfg = _moe(cfg, log_interval=3)  # the log window straddles the checkpoints at 4 and 8
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    run_training(_with_out(cfg, straight))
    crash_at_step_7_then_resume(cfg, broken, monkeypatch)

    def train_records(run):
        return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "memory_gb", "mfu", "elapsed_s")}
                for r in read_metrics(run / "metrics.jsonl") if r["event"] == "train"]

    assert train_records(broken) == train_records(straight)  # router stats included
    assert _losses(broken, "eval", "val_loss") == _losses(straight, "eval", "val_loss")
    a, b = _weights(straight), _weights(broken)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_moe_training_under_torch_compile(cfg, tmp_path, monkeypatch):
    """last_aux set inside a compiled forward holds the compiled graph's real outputs.

    aot_eager runs Dynamo's capture (where module attribute writes become side effects) and
    AOTAutograd's joint graph, as Inductor would, without a C++ build per test; CUDA runs use
    Inductor.
    """
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="aot_eager", **kw))
    cfg = _moe(cfg, eval_at_start=False, compile=True)
    compiled, trainer = _first_step_grads(cfg, tmp_path, monkeypatch, "compiled")
    assert trainer.model is not trainer.raw_model  # it did compile
    aux = trainer.raw_model.layers[0].ffn.last_aux
    assert aux["load_balance"].grad_fn is not None
    expected = _reference_grads(cfg)
    for name in expected:
        torch.testing.assert_close(compiled[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("compile_eval", [False, True])
def test_evaluation_runs_the_eager_model_unless_compile_eval(cfg, tmp_path, monkeypatch, compile_eval):
    """Evaluating through the compiled model would compile a second (no_grad) graph."""
    calls = []

    class Compiled(torch.nn.Module):  # stands for what torch.compile returns; records grad mode
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            calls.append(torch.is_grad_enabled())
            return self.module(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: Compiled(fn) if isinstance(fn, torch.nn.Module) else fn)
    cfg = _with_out(cfg, tmp_path / "run")
    cfg = replace(cfg, trainer=replace(cfg.trainer, compile=True, compile_eval=compile_eval, max_steps=4,
                                       checkpoint_interval=0, sample_tokens=0))
    trainer = trainer_mod.Trainer(cfg, tmp_path / "run")
    trainer.fit()
    trainer.logger.close()
    assert calls.count(True) == 4  # every training step goes through the compiled model
    assert (calls.count(False) > 0) == compile_eval
    assert len(_losses(tmp_path / "run", "eval", "val_loss")) >= 1


def test_steps_match_a_plain_torch_recipe_given_the_same_weights_and_batches(cfg, tmp_path):
    """Differential check of the optimisation recipe against torch's own pieces: F.cross_entropy,
    clip_grad_norm_, torch.optim.AdamW (β 0.9/0.95, ε 1e-8, decay on matrices only, decoupled
    lr·λ) and warm-up + cosine written out here; update s (1-based) uses the lr of step s."""
    import copy

    cfg = replace(cfg, optim=replace(cfg.optim, grad_clip=0.5), trainer=replace(cfg.trainer, deterministic=False))
    trainer = trainer_mod.Trainer(cfg, tmp_path / "run")
    model = copy.deepcopy(trainer.raw_model)
    oc, steps = cfg.optim, cfg.trainer.max_steps
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": oc.weight_decay},
                             {"params": vectors, "weight_decay": 0.0}],
                            lr=oc.lr, betas=(oc.beta1, oc.beta2), eps=oc.eps, foreach=False)

    def lr_of(s):
        if s < oc.warmup_steps:
            return oc.lr * s / oc.warmup_steps
        cos = 0.5 * (1 + math.cos(math.pi * (s - oc.warmup_steps) / (steps - oc.warmup_steps)))
        return oc.min_lr + cos * (oc.lr - oc.min_lr)

    rng = np.random.default_rng(0)
    tokens = trainer.data.train_tokens
    T, B = cfg.model.context_length, cfg.trainer.batch_size
    for s in range(1, 6):
        rows = torch.from_numpy(np.stack([tokens[i:i + T + 1] for i in rng.integers(0, len(tokens) - T - 1, B)])
                                .astype(np.int64))
        x, y = rows[:, :-1], rows[:, 1:]
        trainer.data.next_batch = lambda device, batch=(x, y): batch
        trainer._train_step()
        for group in opt.param_groups:
            group["lr"] = lr_of(s)
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert trainer._lr == pytest.approx(lr_of(s))
        # Adam divides each gradient by its own magnitude: where a gradient is near zero (~1e-7
        # here) the rounding differences between scratchlm's loss/clip and torch's move that
        # element's update by ~1e-3 of the lr. A recipe error (lr, betas, eps, decay, clipping)
        # moves nearly every weight by ~1e-1 of the lr, far outside atol.
        for (name, a), b in zip(trainer.raw_model.named_parameters(), model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{name} after update {s}")
    assert trainer._lr > 0 and lr_of(steps) == pytest.approx(oc.min_lr)


def test_the_trainer_always_holds_a_strategy(cfg, tmp_path):
    """'none' is the single-process strategy; a strategy passed in is the one used."""
    from scratchlm.parallel.strategies.single import SingleProcess
    from scratchlm.parallel.strategy import init_strategy

    trainer = trainer_mod.Trainer(cfg, tmp_path / "a")
    assert type(trainer.strategy) is SingleProcess and trainer.strategy.device == torch.device("cpu")
    mine = init_strategy(cfg.parallel, device="cpu")
    assert trainer_mod.Trainer(cfg, tmp_path / "b", strategy=mine).strategy is mine
    assert trainer_mod.Trainer(cfg, tmp_path / "c", engine=mine).engine is mine  # the older keyword


def test_validation_loss_does_not_depend_on_the_micro_batch(cfg, tmp_path):
    # Same seed, same weights: 1 micro-batch of 4 or 4 micro-batches of 1 score the same windows.
    losses = []
    for accum in (1, 4):
        c = replace(cfg, trainer=replace(cfg.trainer, grad_accum_steps=accum, out_dir=str(tmp_path / f"a{accum}")))
        trainer = trainer_mod.Trainer(c, c.trainer.out_dir)
        try:
            losses.append(trainer._evaluate()["val_loss"])
        finally:
            trainer.logger.close()
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=0)


def test_fused_lm_head_with_a_logit_softcap_is_refused(cfg, tmp_path):
    cfg = replace(cfg, model=replace(cfg.model, logit_softcap=15.0),
                  trainer=replace(cfg.trainer, fused_lm_head=True))
    with pytest.raises(UserError, match="fused_lm_head.*logit_softcap"):
        run_training(cfg)


def test_speedrun_model_switches_train(cfg, tmp_path):
    cfg = replace(cfg, model=replace(cfg.model, ffn="relu2", logit_softcap=15.0, zero_init_output=True))
    run_training(cfg)
    evals = _losses(tmp_path / "run", "eval", "val_loss")
    assert evals[-1][1] < evals[0][1] - 0.5


@pytest.mark.parametrize("ffn", ["swiglu", "moe"])
def test_blocks_compile_scope_trains_as_the_eager_model(cfg, tmp_path, monkeypatch, ffn):
    """trainer.compile_scope="blocks": one compiled block call serves every block, and the
    first update's gradients (MoE auxiliary losses included) are those of the eager model."""
    real_compile = torch.compile
    compiled_fns = []

    def aot_eager(fn, **kw):
        compiled_fns.append(fn)
        return real_compile(fn, backend="aot_eager", **kw)

    monkeypatch.setattr(torch, "compile", aot_eager)
    cfg = _moe(cfg, eval_at_start=False) if ffn == "moe" else replace(cfg, trainer=replace(cfg.trainer, eval_at_start=False))
    cfg = replace(cfg, trainer=replace(cfg.trainer, compile=True, compile_scope="blocks"))
    grads, trainer = _first_step_grads(cfg, tmp_path, monkeypatch, "blocks")
    assert trainer.model is trainer.raw_model and trainer.raw_model.block_runner is not None
    assert [getattr(f, "__name__", "") for f in compiled_fns] == ["run_block", "cross_entropy"]
    expected = _reference_grads(cfg)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("backend_options", [{"compile_backend": "cudagraphs"},
                                             {"compile_backend": "cudagraphs", "fused_lm_head": True}])
def test_cudagraphs_backend_trains_like_eager_on_cuda(tmp_path, backend_options):
    base = make_cfg(tmp_path, device="cuda", deterministic=False, max_steps=6, checkpoint_interval=0)
    base = replace(base, model=replace(base.model, attention_backend="flash_triton"))
    run_training(_with_out(base, tmp_path / "eager"))
    graphed = replace(base, trainer=replace(base.trainer, compile=True, **backend_options))
    run_training(_with_out(graphed, tmp_path / "graphed"))
    eager, got = _losses(tmp_path / "eager"), _losses(tmp_path / "graphed")
    assert [s for s, _ in got] == [s for s, _ in eager]
    for (_, a), (_, b) in zip(got, eager):
        assert a == pytest.approx(b, rel=2e-2, abs=2e-2)
