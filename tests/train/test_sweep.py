import json
from dataclasses import replace

import pytest

from scratchlm.config import load_config, save_config
from scratchlm.errors import UserError
from scratchlm.train import sweep as sweep_mod
from scratchlm.train.config import TrainConfig
from scratchlm.train.metrics import read_metrics
from scratchlm.train.sweep import (
    GridAxis, grid_points, parse_grid, plan_sweep, point_name, run_sweep, summarize_run, write_summary,
)
from scratchlm.train.trainer import Trainer
from tests.train.small_runs import losses, make_cfg

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = ["optim.lr=1e-2,3e-3", "model.d_model=32,16"]
NAMES = ["optim.lr=1e-2__model.d_model=32", "optim.lr=1e-2__model.d_model=16",
         "optim.lr=3e-3__model.d_model=32", "optim.lr=3e-3__model.d_model=16"]


@pytest.fixture
def preset(tmp_path):
    """A tiny CPU config (4 steps, evaluations at 0, 2, 4) saved as a TOML preset."""
    cfg = make_cfg(tmp_path, max_steps=4, eval_interval=2, checkpoint_interval=2, log_interval=1)
    path = tmp_path / "tiny.toml"
    save_config(cfg, path)
    return path


def test_parse_grid_and_the_product_in_grid_order():
    axes = parse_grid(GRID)
    assert axes == [GridAxis("optim.lr", ("1e-2", "3e-3")), GridAxis("model.d_model", ("32", "16"))]
    assert [point_name(p) for p in grid_points(axes)] == NAMES
    assert point_name({"trainer.device": "cuda:1", "data.train_path": "a/b c"}) == \
        "trainer.device=cuda_1__data.train_path=a_b_c"


@pytest.mark.parametrize("spec, message", [
    ("optim.lr", "must look like section.key=v1,v2"),
    ("lr=1e-3", "not a dotted config key"),
    ("optim..lr=1", "not a dotted config key"),
    ("optim.lr=", "empty value"),
    ("optim.lr=1e-3,,3e-3", "empty value"),
    ("optim.lr=1e-3,1e-3", "lists a value twice"),
    ("trainer.out_dir=a,b", "cannot be swept"),
])
def test_bad_grid_syntax_is_one_line(spec, message):
    with pytest.raises(UserError, match=message) as err:
        parse_grid([spec])
    assert "\n" not in str(err.value)


def test_a_key_given_twice_and_no_grid_are_refused():
    with pytest.raises(UserError, match="names optim.lr twice"):
        parse_grid(["optim.lr=1e-3", "optim.lr=3e-3"])
    with pytest.raises(UserError, match="at least one --grid"):
        parse_grid([])


@pytest.mark.parametrize("spec, message", [
    ("optim.lrr=1e-3,3e-3", "unknown config key 'optim.lrr'"),
    ("optim.lr=1e-3,fast", "optim.lr must be a number"),
    ("optim.lr=1e-3,-1", "optim.lr must be > 0"),
    ("optim.lr=1e-3,0", "optim.lr must be > 0"),
    ("model.d_model=32,30", "d_model"),  # 30 is not divisible by 4 heads
    ("model.vocab_size=48,40", "vocab"),  # the token files hold ids up to 47
    ("model.context_length=16,1000", "context"),  # the validation file is shorter than one window
    ("parallel.strategy=none,ddp", "parallel.strategy must be none, not 'ddp'"),  # its point ran in one process
])
def test_unknown_keys_and_invalid_values_fail_before_any_run(preset, tmp_path, spec, message):
    out = tmp_path / "sweep"
    with pytest.raises(UserError, match=message) as err:
        plan_sweep(preset, [], parse_grid([spec]), out)
    assert "--grid point" in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


@pytest.mark.parametrize("overrides, spec, message", [
    (["--trainer.fused_lm_head=true"], "model.logit_softcap=0,30", "fused_lm_head"),
    (["--trainer.seq_len_warmup_steps=4"], "model.context_length=16,12", "divide by 8"),
    (["--trainer.time_budget_s=60"], "optim.cosine_steps=100,200", "cosine_steps"),
])
def test_options_the_trainer_refuses_together_fail_before_any_run(preset, tmp_path, overrides, spec, message):
    # the first point is fine; the second would fail only once the first had trained
    out = tmp_path / "sweep"
    with pytest.raises(UserError, match=message) as err:
        plan_sweep(preset, overrides, parse_grid([spec]), out)
    assert "--grid point" in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


@pytest.mark.parametrize("spec", ["optim.lr=1e-3,0.001", "trainer.compile=true,True"])
def test_one_value_spelled_two_ways_is_refused(preset, tmp_path, spec):
    # Two run directories would train the same config twice and list it twice in the summary.
    out = tmp_path / "sweep"
    with pytest.raises(UserError, match="are the same config values") as err:
        plan_sweep(preset, [], parse_grid([spec, "model.d_model=32,16"]), out)
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_a_key_both_overridden_and_swept_is_refused(preset, tmp_path):
    # The grid's values would silently replace the override's.
    out = tmp_path / "sweep"
    with pytest.raises(UserError, match="--optim.lr is both an override and a --grid key") as err:
        plan_sweep(preset, ["--optim.lr=1e-2"], parse_grid(GRID), out)
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_a_sweep_needs_validation_data_and_one_process(preset, tmp_path):
    with pytest.raises(UserError, match="data.val_path"):
        plan_sweep(preset, ["--data.val_path="], parse_grid(GRID), tmp_path / "s")
    with pytest.raises(UserError, match="does not exist"):
        plan_sweep(preset, [f"--data.train_path={tmp_path / 'missing.bin'}"], parse_grid(GRID), tmp_path / "s")
    with pytest.raises(UserError, match="parallel.strategy"):
        plan_sweep(preset, ["--parallel.strategy=ddp"], parse_grid(GRID), tmp_path / "s")


def test_a_sweep_over_the_training_file_as_validation_data_fails_before_any_run(preset, tmp_path):
    # Every point trained, then compared training losses under the name of validation losses.
    from scratchlm.config import read_toml

    train = read_toml(preset)["data"]["train_path"]
    with pytest.raises(UserError, match="is the training file data.train_path"):
        plan_sweep(preset, [f"--data.val_path={train}"], parse_grid(GRID), tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_the_sweep_folder_must_not_be_a_file_or_a_training_run(preset, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not a directory"):
        plan_sweep(preset, [], parse_grid(GRID), tmp_path / "notes.txt")
    # The points and the summary would land among a finished run's files (by default: trainer.out_dir).
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match="is the directory of a training run"):
        plan_sweep(preset, [], parse_grid(GRID), run)
    with pytest.raises(UserError, match="is the directory of a training run"):
        plan_sweep(preset, [f"--trainer.out_dir={run}"], parse_grid(GRID))
    assert [p.name for p in run.iterdir()] == ["checkpoints"]


def test_a_2x2_sweep_writes_four_runs_and_a_summary_that_matches_their_metrics(preset, tmp_path):
    out = tmp_path / "sweep"
    points = plan_sweep(preset, [], parse_grid(GRID), out)
    lines = []
    rows = run_sweep(points, out, echo=lines.append)

    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(NAMES)
    assert [line.split(":")[0] for line in lines] == [
        "point 1/4 optim.lr=1e-2 model.d_model=32", "point 2/4 optim.lr=1e-2 model.d_model=16",
        "point 3/4 optim.lr=3e-3 model.d_model=32", "point 4/4 optim.lr=3e-3 model.d_model=16"]
    assert all(" val " in line and line.endswith(" s)") for line in lines)
    base = load_config(TrainConfig, preset)
    for point, row in zip(points, rows):
        run = out / point.name
        cfg = load_config(TrainConfig, run / "config.toml")
        # Each point is the base config with its own values; all read the same token files.
        assert (cfg.optim.lr, cfg.model.d_model) == (float(point.values["optim.lr"]),
                                                     int(point.values["model.d_model"]))
        assert cfg.data == base.data and cfg.trainer.out_dir == str(run)
        assert replace(cfg, optim=base.optim, model=base.model, trainer=base.trainer) == base
        evals = [v for _, v in losses(run, "eval", "val_loss")]
        train = [r for r in read_metrics(run / "metrics.jsonl") if r["event"] == "train"]
        assert len(evals) == 3 and [r["step"] for r in train] == [1, 2, 3, 4]
        assert row["values"] == {"optim.lr": cfg.optim.lr, "model.d_model": cfg.model.d_model}
        assert row["final_val_loss"] == evals[-1] and row["best_val_loss"] == min(evals)
        assert row["steps"] == 4 and row["tokens"] == 4 * 4 * 16 and row["finished"]
        timed = [r["elapsed_s"] for r in read_metrics(run / "metrics.jsonl") if "elapsed_s" in r]
        wall = max(timed) if timed else sum(4 * 16 / r["tokens_per_s"] for r in train)
        assert row["wall_s"] == pytest.approx(wall) and row["tokens_per_s"] == pytest.approx(4 * 64 / wall)
    assert [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()] == rows
    table = (out / "summary.md").read_text().splitlines()
    assert table[0].startswith("| optim.lr | model.d_model | final val loss") and len(table) == 2 + 4 + 2
    best = min(rows, key=lambda r: r["final_val_loss"])
    assert f"**{best['final_val_loss']:.4f}**" in "\n".join(table) and best["name"] in table[-1]
    assert (out / "sweep.png").stat().st_size > 1000


def _killed_in_point_2(preset, out):
    """A two-point sweep into `out` killed during point 2, after its checkpoint at step 2."""
    points = plan_sweep(preset, [], parse_grid(["optim.lr=1e-2,3e-3"]), out)
    run_sweep(points[:1], out, echo=lambda line: None)
    killed = Trainer(points[1].cfg, points[1].run_dir)
    killed.fit(until=2)
    killed.logger.close()
    return points


def test_rerunning_skips_finished_points_and_resumes_an_unfinished_one(preset, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    points = _killed_in_point_2(preset, out)
    finished_log = (points[0].run_dir / "metrics.jsonl").read_text()

    started = []
    real_train = sweep_mod._train_point

    def recording(point, *, resume):
        started.append((point.name, resume))
        real_train(point, resume=resume)

    monkeypatch.setattr(sweep_mod, "_train_point", recording)
    lines = []
    rows = run_sweep(points, out, echo=lines.append)
    assert started == [(points[1].name, True)]
    assert "finished already" in lines[0] and "finished already" not in lines[1]
    assert (points[0].run_dir / "metrics.jsonl").read_text() == finished_log
    assert [r["finished"] for r in rows] == [True, True]

    # The resumed point logs what an uninterrupted run logs (deterministic runs, exact resume).
    fresh = replace(points[1].cfg, trainer=replace(points[1].cfg.trainer, out_dir=str(tmp_path / "whole")))
    whole = Trainer(fresh, tmp_path / "whole")
    whole.fit()
    whole.logger.close()
    assert losses(points[1].run_dir) == losses(tmp_path / "whole")
    assert losses(points[1].run_dir, "eval", "val_loss") == losses(tmp_path / "whole", "eval", "val_loss")

    started.clear()
    run_sweep(points, out, echo=lines.append)
    assert started == []


def test_a_failed_point_is_reported_and_the_sweep_goes_on(preset, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    points = plan_sweep(preset, [], parse_grid(["optim.lr=10,1e-2"]), out)
    real_train = sweep_mod._train_point

    def diverge_at_lr_10(point, *, resume):
        if point.cfg.optim.lr == 10:
            raise UserError("the training loss became nan at step 3; try a lower optim.lr")
        real_train(point, resume=resume)

    monkeypatch.setattr(sweep_mod, "_train_point", diverge_at_lr_10)
    lines = []
    rows = run_sweep(points, out, echo=lines.append)
    assert "failed" in lines[0] and "loss became nan" in lines[0] and " val " in lines[1]
    assert rows[0]["error"].startswith("the training loss became nan") and "error" not in rows[1]
    assert rows[1]["final_val_loss"] is not None
    assert "failed: the training loss became nan" in (out / "summary.md").read_text()


@pytest.mark.parametrize("error", [
    MemoryError("Unable to allocate 7.28 TiB for an array with shape (1000000000000,) and data type int64"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 204800000000 bytes. Error code 12 (Cannot allocate memory)"),
])
def test_a_point_the_host_memory_cannot_hold_is_reported_and_the_sweep_goes_on(preset, tmp_path, monkeypatch, error):
    # What numpy and torch's CPU allocator raise: the whole sweep stopped at that point, as a crash.
    out = tmp_path / "sweep"
    points = plan_sweep(preset, [], parse_grid(["model.d_model=32,16"]), out)
    real_train = sweep_mod._train_point

    def too_big(point, *, resume):
        if point.cfg.model.d_model == 32:
            raise error
        real_train(point, resume=resume)

    monkeypatch.setattr(sweep_mod, "_train_point", too_big)
    lines = []
    rows = run_sweep(points, out, echo=lines.append)
    assert "failed" in lines[0] and "out of memory" in lines[0] and " val " in lines[1]
    assert rows[0]["error"].startswith("out of memory: ") and rows[1]["finished"]


def test_a_changed_config_is_refused_before_any_point_runs(preset, tmp_path):
    out = tmp_path / "sweep"
    points = plan_sweep(preset, [], parse_grid(["optim.lr=1e-2"]), out)
    run_sweep(points, out, echo=lambda line: None)
    changed = plan_sweep(preset, ["--trainer.max_steps=6"], parse_grid(["optim.lr=1e-2"]), out)
    with pytest.raises(UserError, match="different config") as err:
        run_sweep(changed, out, echo=lambda line: None)
    assert "\n" not in str(err.value) and "(it differs in trainer.max_steps)" in str(err.value)


@pytest.mark.parametrize("damage", [b"[model\n", b"\xff\xfe"])
def test_a_damaged_point_config_is_refused_before_any_point_runs(preset, tmp_path, damage):
    """Bytes that are not UTF-8 were a UnicodeDecodeError."""
    out = tmp_path / "sweep"
    (out / "optim.lr=1e-2").mkdir(parents=True)
    (out / "optim.lr=1e-2" / "config.toml").write_bytes(b"[model]\nd_model = 32\n" + damage)
    points = plan_sweep(preset, [], parse_grid(["optim.lr=1e-2"]), out)
    with pytest.raises(UserError, match="config.toml is not valid TOML"):
        run_sweep(points, out, echo=lambda line: None)


def _reformatted(text):
    """The same config as other TOML: keys in reverse order, floats spelled out, a comment, and
    without model.qk_norm (as a version from before the key existed wrote it)."""
    sections, current = [], None
    for line in text.splitlines():
        if line.startswith("["):
            current = [line]
            sections.append(current)
        elif "=" in line and not line.startswith("qk_norm"):
            key, value = (part.strip() for part in line.split("=", 1))
            if "." in value and not value.startswith(("\"", "[")):
                value = "%.17e" % float(value)
            current.append(f"{key}   =   {value}  # written by hand")
    return "\n\n".join("\n".join([lines[0], *reversed(lines[1:])]) for lines in sections) + "\n"


def test_a_config_that_differs_only_in_formatting_is_the_same_point(preset, tmp_path):
    out = tmp_path / "sweep"
    points = plan_sweep(preset, [], parse_grid(["optim.lr=1e-2"]), out)
    run_sweep(points, out, echo=lambda line: None)
    saved = points[0].run_dir / "config.toml"
    saved.write_text(_reformatted(saved.read_text()))
    assert load_config(TrainConfig, saved) == points[0].cfg
    lines = []
    run_sweep(points, out, echo=lines.append)
    assert "finished already" in lines[0]


def test_a_sweep_folder_moved_or_spelled_otherwise_is_the_same_sweep(preset, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    _killed_in_point_2(preset, out)
    out.rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    for where in ("moved", tmp_path / "moved"):  # a relative --out, then the absolute one
        moved = plan_sweep(preset, [], parse_grid(["optim.lr=1e-2,3e-3"]), where)
        lines = []
        rows = run_sweep(moved, where, echo=lines.append)
        assert "finished already" in lines[0]
        assert [r["finished"] for r in rows] == [True, True]
    assert "finished already" in lines[1]


def test_summary_prefers_the_elapsed_seconds_a_trainer_logs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[model]\ncontext_length = 16\n\n[trainer]\nbatch_size = 4\n")
    records = [{"event": "train", "step": 5, "loss": 3.0, "tokens_per_s": 100.0},
               {"event": "eval", "step": 5, "val_loss": 3.2}, {"event": "end", "step": 5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert summarize_run(run)["wall_s"] == pytest.approx(5 * 64 / 100.0)
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "elapsed_s": 2.0 + i}) + "\n"
                                               for i, r in enumerate(records)))
    row = summarize_run(run)
    assert row["wall_s"] == 4.0 and row["tokens_per_s"] == 5 * 64 / 4.0 and row["finished"]
    assert row["steady_tokens_per_s"] == 100.0  # one log window: its own rate


def test_summary_steady_rate_leaves_out_the_first_window_that_holds_compilation(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[model]\ncontext_length = 16\n\n[trainer]\nbatch_size = 4\n")
    rates = [10.0, 300.0, 200.0, 250.0]
    records = [{"event": "train", "step": 5 * (i + 1), "loss": 3.0, "tokens_per_s": v} for i, v in enumerate(rates)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = summarize_run(run)
    assert row["steady_tokens_per_s"] == 250.0 and row["tokens_per_s"] < 100
    write_summary([{**row, "name": "a", "values": {"optim.lr": 1e-3}}], tmp_path)
    assert (tmp_path / "summary.md").read_text().splitlines()[2].endswith("| 250 |")


def test_a_failed_point_is_not_named_the_best_whatever_its_last_loss(tmp_path):
    """A point that diverged after a low early evaluation was bolded and named the lowest final loss."""
    row = {"best_val_loss": None, "steps": 10, "tokens": 640, "wall_s": 1.0, "tokens_per_s": 640.0,
           "steady_tokens_per_s": 640.0, "finished": False}
    failed = {**row, "name": "optim.lr=1", "values": {"optim.lr": 1.0}, "final_val_loss": 2.0,
              "error": "the training loss became nan at step 10; try a lower optim.lr"}
    done = {**row, "name": "optim.lr=1e-3", "values": {"optim.lr": 1e-3}, "final_val_loss": 3.0, "finished": True}
    write_summary([failed, done], tmp_path)
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert lines[-1] == "Lowest final validation loss: optim.lr=1e-3 (3.0000)."
    assert "**" not in lines[2] and "**3.0000**" in lines[3]
    write_summary([failed], tmp_path)
    assert "Lowest" not in (tmp_path / "summary.md").read_text()


def test_summary_of_a_run_that_has_not_started():
    row = summarize_run("/nonexistent/run")
    assert row["final_val_loss"] is None and row["steps"] == 0 and not row["finished"]


def test_log_x_for_learning_rates_and_wide_numeric_axes():
    assert sweep_mod._is_lr_like("optim.lr", [1e-3, 3e-3])
    assert sweep_mod._is_lr_like("optim.min_lr", [1e-4, 1e-3])
    assert sweep_mod._is_lr_like("trainer.batch_size", [1, 100])
    assert not sweep_mod._is_lr_like("model.d_model", [256, 512])
    assert not sweep_mod._is_lr_like("optim.schedule", ["cosine", "linear"])


def test_the_plot_takes_non_numeric_values_and_three_keys(tmp_path):
    rows = [{"name": f"p{i}", "values": {"optim.schedule": s, "model.d_model": d, "optim.lr": 1e-3},
             "final_val_loss": 3.0 + i / 10} for i, (s, d) in enumerate(
                 [("cosine", 16), ("cosine", 32), ("linear", 16), ("linear", 32)])]
    path = sweep_mod.plot_sweep(rows, tmp_path / "sweep.png")
    assert path.stat().st_size > 1000


def test_the_plot_takes_list_valued_settings(tmp_path):
    # --grid trainer.sample_prompts=a,b: the plot failed with "unhashable type: 'list'".
    rows = [{"name": f"p{i}", "values": {"trainer.sample_prompts": p, "data.extra": e},
             "final_val_loss": 3.0 + i / 10} for i, (p, e) in enumerate(
                 [(["a"], ["x"]), (["b"], ["x"]), (["a"], ["y", "z"]), (["b"], ["y", "z"])])]
    path = sweep_mod.plot_sweep(rows, tmp_path / "sweep.png")
    assert path.stat().st_size > 1000
