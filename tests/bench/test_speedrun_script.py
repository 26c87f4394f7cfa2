"""benchmarks/speedrun.py and the time-budget mode of benchmarks/reference_trainer.py, on CPU with a
tiny shape and budgets of a few seconds."""

import json
import math

import numpy as np
import pytest
import torch

from scratchlm.config import load_config, split_overrides
from scratchlm.train.config import TrainConfig
from tests.bench.test_scripts import load
from tests.train.small_runs import VOCAB, write_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tokens(tmp_path):
    return {"train_bin": write_tokens(tmp_path / "train.bin", 20_000, 0),
            "val_bin": write_tokens(tmp_path / "val.bin", 3_000, 1), "tokenizer": "", "vocab_size": VOCAB}


def test_lr_at_time_is_a_warm_up_in_updates_scaling_a_cosine_over_the_budget():
    lr_at_time = load("reference_trainer").lr_at_time
    cosine = lambda p: 1e-3 + 0.5 * (1 + math.cos(math.pi * p)) * 9e-3  # noqa: E731
    assert lr_at_time(1, 0.0, 1e-2, 1e-3, 10) == pytest.approx(1e-3)  # update 1 of 10 warm-up updates
    assert lr_at_time(5, 0.3, 1e-2, 1e-3, 10) == pytest.approx(0.5 * cosine(0.3))
    assert lr_at_time(50, 0.5, 1e-2, 1e-3, 10) == pytest.approx(cosine(0.5))
    assert lr_at_time(99, 1.2, 1e-2, 1e-3, 10) == pytest.approx(1e-3)  # past the budget: min_lr
    assert lr_at_time(1, 0.0, 1e-2, 1e-3, 0) == pytest.approx(1e-2)  # no warm-up


@pytest.mark.parametrize("max_windows", [None, 8, 5])
def test_reference_evaluation_reads_the_windows_scratchlm_eval_reads(tokens, max_windows):
    from scratchlm.bench.reference_model import ReferenceLM
    from scratchlm.data.batch import iterate_eval_batches
    from scratchlm.train.data_feed import evaluate

    torch.manual_seed(0)
    model = ReferenceLM(VOCAB, 16, 32, 1, 4, 48)
    val = np.memmap(tokens["val_bin"], dtype=np.uint16, mode="r")
    ours = load("reference_trainer").evaluate_windows(model, val, 4, 16, "cpu", max_windows)
    with torch.no_grad():
        expected = evaluate(model, iterate_eval_batches(val, 4, 16, max_windows=max_windows))
    assert ours == pytest.approx(expected, rel=1e-6)


def test_reference_time_budget_run_stops_on_time_and_evaluates_the_whole_file(tokens, tmp_path):
    reference_trainer = load("reference_trainer")
    out, budget = tmp_path / "ref", 1.5
    reference_trainer.main([
        "--train-bin", tokens["train_bin"], "--val-bin", tokens["val_bin"], "--out", str(out),
        "--vocab-size", str(VOCAB), "--context-length", "16", "--d-model", "32", "--num-layers", "1",
        "--num-heads", "4", "--d-ff", "48", "--batch-size", "4", "--warmup", "5", "--eval-interval", "20",
        "--eval-batches", "2", "--log-interval", "1", "--lr", "1e-2", "--min-lr", "1e-3",
        "--time-budget-s", str(budget)])
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert budget <= summary["train_seconds"] < 2 * budget and summary["steps"] > 20
    assert summary["tokens"] == summary["steps"] * 4 * 16
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals[:-2]] == list(range(20, summary["steps"] + 1, 20))  # none at step 0
    assert [r.get("full_validation") for r in evals[-2:]] == [False, True]
    assert evals[-1]["val_loss"] == summary["final_val_loss"]
    assert evals[-2]["val_loss"] == summary["final_window_val_loss"]
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[-1] == summary["train_seconds"]
    # Each update's rate is the schedule at the clock the previous record read.
    clock, train = 0.0, [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == list(range(1, summary["steps"] + 1))
    for r in records[:-2]:
        if r["event"] == "train":
            assert r["lr"] == pytest.approx(reference_trainer.lr_at_time(r["step"], clock / budget, 1e-2, 1e-3, 5))
        clock = r["elapsed_s"]
    assert train[0]["lr"] == pytest.approx(2e-3) and train[-1]["lr"] < 2e-3


def test_scratchlm_command_line_carries_the_budget_the_data_and_the_recipe_last(tokens, tmp_path):
    speedrun = load("speedrun")
    shape = speedrun.SHAPES["tiny"]
    cmd = speedrun.scratchlm_train_command(shape, budget_s=60, out=tmp_path / "run", data=tokens, eval_interval=50,
                                           recipe=["model.use_rope=false", "--trainer.eval_interval=7"], cuda=True)
    assert cmd[1:5] == ["-m", "scratchlm", "train", "tiny-cpu"]
    assert "--trainer.time_budget_s=60" in cmd and f"--trainer.out_dir={tmp_path / 'run'}" in cmd
    assert cmd.index("--trainer.compile=true") < cmd.index("--model.use_rope=false")
    # Every option but the time budget (a trainer option not every version has) is a real config key,
    # and the recipe's overrides win over the command's own.
    positional, overrides = split_overrides(cmd[4:])
    assert positional == ["tiny-cpu", "--overwrite"]
    known = [o for o in overrides if not o.startswith("--trainer.time_budget_s=")]
    cfg = load_config(TrainConfig, "tiny-cpu", known)
    assert (cfg.data.train_path, cfg.data.val_path) == (tokens["train_bin"], tokens["val_bin"])
    assert cfg.model.vocab_size == VOCAB
    assert (cfg.model.d_model, cfg.trainer.batch_size, cfg.trainer.eval_interval) == (32, 4, 7)
    assert not cfg.model.use_rope and cfg.trainer.compile and not cfg.trainer.eval_at_start
    assert cfg.trainer.checkpoint_interval == 0 and cfg.trainer.sample_tokens == 0
    cpu = speedrun.scratchlm_train_command(shape, budget_s=5, out=tmp_path / "r", data=tokens, eval_interval=50,
                                           recipe=[], cuda=False)
    assert "--trainer.compile=true" not in cpu and "--trainer.time_budget_s=5" in cpu


def test_the_reference_command_line_has_the_shape_and_recipe_of_the_config(tokens, tmp_path):
    speedrun = load("speedrun")
    cfg = load_config(TrainConfig, "tinystories-17m", ["--model.vocab_size=48"])
    cmd = speedrun.reference_command(cfg, budget_s=60, lr=3e-3, out=tmp_path / "ref", data=tokens, eval_interval=500,
                                     cuda=True)
    args = load("reference_trainer").build_parser().parse_args(cmd[2:])
    assert (args.d_model, args.num_layers, args.num_heads, args.d_ff, args.context_length) == (512, 4, 16, 1344, 256)
    assert (args.batch_size, args.warmup, args.eval_batches, args.time_budget_s) == (32, 200, 20, 60.0)
    assert args.lr == 3e-3 and args.min_lr == pytest.approx(3e-4) and args.compile  # the preset's min_lr / lr


def test_a_seed_reaches_both_sides(tokens, tmp_path):
    speedrun = load("speedrun")
    shape = speedrun.seeded(speedrun.SHAPES["tiny"], 7)
    assert speedrun.seeded(speedrun.SHAPES["tiny"], None) == speedrun.SHAPES["tiny"]
    cmd = speedrun.scratchlm_train_command(shape, budget_s=5, out=tmp_path / "r", data=tokens, eval_interval=50,
                                           recipe=[], cuda=False)
    known = [o for o in split_overrides(cmd[4:])[1] if not o.startswith("--trainer.time_budget_s=")]
    assert load_config(TrainConfig, "tiny-cpu", known).trainer.seed == 7
    cfg = load_config(TrainConfig, shape.preset, [*shape.overrides, f"--model.vocab_size={VOCAB}"])
    ref = speedrun.reference_command(cfg, budget_s=5, lr=1e-3, out=tmp_path / "ref", data=tokens, eval_interval=50,
                                     cuda=False)
    assert load("reference_trainer").build_parser().parse_args(ref[2:]).seed == 7


def _write_run(run, records, batch_size=4, context_length=16):
    run.mkdir(parents=True)
    (run / "config.toml").write_text(
        f"[model]\ncontext_length = {context_length}\n\n[trainer]\nbatch_size = {batch_size}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_scratchlm_run_is_read_from_its_metrics(tmp_path):
    speedrun = load("speedrun")
    records = [{"event": "start", "step": 0},
               {"event": "train", "step": 10, "loss": 3.0, "tokens_per_s": 640.0},
               {"event": "train", "step": 20, "loss": 2.5, "tokens_per_s": 320.0},
               {"event": "eval", "step": 20, "val_loss": 2.6},
               {"event": "train", "step": 25, "loss": 2.4, "tokens_per_s": 160.0},
               {"event": "eval", "step": 25, "val_loss": 2.45}, {"event": "end", "step": 25}]
    _write_run(tmp_path / "a", records)
    run = speedrun.scratchlm_result(tmp_path / "a")
    # 10 steps x 64 tokens at 640 tok/s = 1 s, then 2 s, then 5 x 64 / 160 = 2 s.
    assert run["steps"] == 25 and run["tokens"] == 25 * 64 and run["seconds"] == pytest.approx(5.0)
    assert run["curve"] == [(pytest.approx(3.0), 2.6)] and run["val_loss"] == 2.45  # the last-step eval is left out

    timed = [{**r, "elapsed_s": s} for r, s in zip(records, [0.0, 1.5, 2.5, 2.7, 4.0, 4.2, 4.2])]
    _write_run(tmp_path / "b", timed)
    run = speedrun.scratchlm_result(tmp_path / "b")
    assert run["seconds"] == 4.2 and run["curve"] == [(2.7, 2.6)]


def test_time_to_reach_interpolates_between_evaluations():
    time_to_reach = load("speedrun").time_to_reach
    curve = [(10.0, 4.0), (20.0, 3.0), (30.0, 2.5)]
    assert time_to_reach(curve, 3.5) == 15.0 and time_to_reach(curve, 2.5) == 30.0
    assert time_to_reach(curve, 5.0) == 10.0 and time_to_reach(curve, 2.0) is None
    assert time_to_reach([], 3.0) is None


def test_recipe_items_must_be_dotted_assignments():
    speedrun = load("speedrun")
    assert speedrun.recipe_overrides(["optim.name=muon", "--model.qk_norm=true"]) == [
        "--optim.name=muon", "--model.qk_norm=true"]
    with pytest.raises(SystemExit, match="section.key=value"):
        speedrun.recipe_overrides(["muon"])


@pytest.mark.slow  # three reference runs in their own processes: about 30 s on two busy cores
def test_reference_side_end_to_end_writes_the_lr_sweep_the_table_and_the_json(tokens, tmp_path, capsys):
    speedrun = load("speedrun")
    out = tmp_path / "speedrun.json"
    assert speedrun.main(["--shape", "tiny", "--budgets", "1.5", "2", "--ref-lrs", "1e-2", "1e-3",
                          "--ref-lr-budget", "1.5", "--sides", "reference", "--train-bin", tokens["train_bin"],
                          "--val-bin", tokens["val_bin"], "--tokenizer", "", "--work", str(tmp_path / "work"),
                          "--eval-interval", "20", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    sweep = results["ref_lr_sweep"]
    assert [r["lr"] for r in sweep["runs"]] == [1e-2, 1e-3]
    assert sweep["best_lr"] == min(sweep["runs"], key=lambda r: r["val_loss"])["lr"]
    assert [r["budget_s"] for r in results["rows"]] == [1.5, 2.0]
    for row in results["rows"]:
        ref = row["reference"]
        assert row["ref_lr"] == sweep["best_lr"] and row["scratchlm"] is None and row["diff_nats"] is None
        assert ref["seconds"] >= row["budget_s"] and ref["tokens"] == ref["steps"] * 64
        assert ref["seconds_to_ref_loss"] is not None and ref["seconds_to_ref_loss"] <= ref["seconds"]
    # The 1.5 s row reuses the sweep's run at the best lr; the 2 s row ran its own.
    first = results["rows"][0]["reference"]
    assert first["val_loss"] == next(r["val_loss"] for r in sweep["runs"] if r["lr"] == sweep["best_lr"])
    assert (tmp_path / "work" / "2s" / "reference" / "summary.json").is_file()
    assert not (tmp_path / "work" / "1.5s").exists()
    table = capsys.readouterr().out.split("| budget s |")[-1].splitlines()
    assert table[2].startswith("| 1.5 | ") and table[3].startswith("| 2 | ") and "n/a" in table[3]


def test_compare_reports_the_difference_and_both_times(tmp_path):
    speedrun = load("speedrun")
    reference = {"val_loss": 3.50, "window_val_loss": 3.40, "curve": [(10.0, 3.8), (20.0, 3.4)]}
    ours = {"val_loss": 3.45, "curve": [(8.0, 3.6), (16.0, 3.2), (20.0, 3.1)]}
    row = speedrun.compare(reference, ours)
    assert row["diff_nats"] == pytest.approx(-0.05)
    assert reference["seconds_to_ref_loss"] == 20.0 and ours["seconds_to_ref_loss"] == pytest.approx(12.0)


def _earlier_json(path, *, shape="tiny", vocab=VOCAB, budgets=(60.0,)):
    rows = [{"budget_s": b, "ref_lr": 2e-3, "scratchlm": None, "diff_nats": None,
             "reference": {"steps": 100, "tokens": 6400, "seconds": b, "val_loss": 3.80, "window_val_loss": 3.70,
                           "curve": [[b / 2, 4.0], [b, 3.70]]}} for b in budgets]
    path.write_text(json.dumps({"shape": shape, "data": {"vocab_size": vocab}, "rows": rows}))
    return path


def test_reference_json_compares_a_scratchlm_run_with_a_stored_reference(tokens, tmp_path, monkeypatch):
    speedrun = load("speedrun")
    ran = []
    monkeypatch.setattr(speedrun, "run_logged", lambda cmd, log, env=None: ran.append(cmd))
    monkeypatch.setattr(speedrun, "scratchlm_result", lambda run: {
        "steps": 120, "tokens": 7680, "seconds": 60.0, "val_loss": 3.6, "curve": [(20.0, 3.9), (40.0, 3.6)]})
    monkeypatch.setattr(speedrun, "evaluate_run", lambda run, data, **kw: 3.75 if kw["batches"] == 0 else 3.55)
    out = tmp_path / "sweep.json"
    earlier = _earlier_json(tmp_path / "earlier.json", budgets=(60.0, 180.0))
    assert speedrun.main(["--shape", "tiny", "--budgets", "60", "--reference-json", str(earlier),
                          "--train-bin", tokens["train_bin"], "--val-bin", tokens["val_bin"], "--tokenizer", "",
                          "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    assert len(ran) == 1 and "train" in ran[0]  # the reference was read, not run; scratchlm ran
    results = json.loads(out.read_text())
    (row,) = results["rows"]
    assert results["reference_from"] == str(earlier) and row["ref_lr"] == 2e-3
    assert row["diff_nats"] == pytest.approx(3.75 - 3.80)
    # the reference's loss on the windows (3.70) is reached between 20 s (3.9) and 40 s (3.6)
    assert row["scratchlm"]["seconds_to_ref_loss"] == pytest.approx(20 + 20 * (0.2 / 0.3))


@pytest.mark.parametrize("earlier_kwargs, message", [
    ({"budgets": (180.0,)}, "no reference run for the budget(s) 60 s"),
    ({"shape": "17m"}, "is of shape '17m'"),
    ({"vocab": VOCAB + 1}, f"vocabulary {VOCAB + 1}"),
])
def test_reference_json_that_does_not_fit_is_refused(tokens, tmp_path, monkeypatch, earlier_kwargs, message):
    speedrun = load("speedrun")
    monkeypatch.setattr(speedrun, "run_logged", lambda cmd, log, env=None: pytest.fail("nothing may run"))
    earlier = _earlier_json(tmp_path / "earlier.json", **earlier_kwargs)
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        speedrun.main(["--shape", "tiny", "--budgets", "60", "--reference-json", str(earlier),
                       "--train-bin", tokens["train_bin"], "--val-bin", tokens["val_bin"], "--tokenizer", "",
                       "--work", str(tmp_path / "work")])


def test_cold_and_warm_compile_caches_are_alike_for_both_sides(tmp_path, monkeypatch):
    speedrun = load("speedrun")
    calls = []
    monkeypatch.setattr(speedrun, "run_logged", lambda cmd, log, env=None: calls.append((cmd, log, env)))
    cache = tmp_path / "run.compile-cache"
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "entry").write_text("from an earlier run")
    cmd = ["py", "train", "--trainer.time_budget_s=60", f"--trainer.out_dir={tmp_path / 'run'}"]
    speedrun.timed_run(cmd, tmp_path / "log.txt", mode="cold", cache=cache,
                       warm_cmd=speedrun.with_budget(cmd, 1.0, tmp_path / "run.warmup"))
    (ran, _, env), = calls  # cold: no warm-up, an emptied cache of its own
    assert ran == cmd and not any(cache.rglob("entry")) and cache.is_dir()
    assert env == {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
    calls.clear()
    speedrun.timed_run(cmd, tmp_path / "log.txt", mode="warm", cache=cache,
                       warm_cmd=speedrun.with_budget(cmd, 1.0, tmp_path / "run.warmup"))
    (warm, warm_log, warm_env), (ran, log, env) = calls  # warm: the same command for 1 s first, same cache
    assert warm == ["py", "train", "--trainer.time_budget_s=1", f"--trainer.out_dir={tmp_path / 'run.warmup'}"]
    assert warm_env == env and warm_log == tmp_path / "log-warmup.log" and ran == cmd
    calls.clear()
    speedrun.timed_run(cmd, tmp_path / "log.txt", mode="machine", cache=cache)
    assert calls == [(cmd, tmp_path / "log.txt", None)]


def test_the_reference_command_gets_its_warm_up_budget_and_folder(tokens, tmp_path):
    speedrun = load("speedrun")
    cfg = load_config(TrainConfig, "tiny-cpu", [f"--model.vocab_size={VOCAB}"])
    data = {"train_bin": tokens["train_bin"], "val_bin": tokens["val_bin"], "vocab_size": VOCAB, "tokenizer": ""}
    cmd = speedrun.reference_command(cfg, budget_s=60, lr=1e-3, out=tmp_path / "ref", data=data,
                                     eval_interval=10, cuda=False)
    warm = speedrun.with_budget(cmd, 1.0, tmp_path / "ref.warmup")
    assert warm[warm.index("--time-budget-s") + 1] == "1" and warm[warm.index("--out") + 1] == str(tmp_path / "ref.warmup")
    assert len(warm) == len(cmd) and [a for a in warm if a.startswith("--")] == [a for a in cmd if a.startswith("--")]


@pytest.mark.slow  # two reference runs in their own processes
def test_ref_tokens_runs_the_reference_for_fixed_tokens_and_gives_the_time_ratio(tokens, tmp_path, monkeypatch):
    speedrun = load("speedrun")
    real = speedrun.run_logged

    def reference_only(cmd, log, env=None):  # the scratchlm side is faked below
        if cmd[1:3] == ["-m", "scratchlm"]:
            return None
        return real(cmd, log, env)

    monkeypatch.setattr(speedrun, "run_logged", reference_only)
    monkeypatch.setattr(speedrun, "scratchlm_result", lambda run: {
        "steps": 50, "tokens": 3200, "seconds": 1.5, "val_loss": 1.0, "curve": [(0.5, 99.0), (1.0, 0.0)]})
    monkeypatch.setattr(speedrun, "evaluate_run", lambda run, data, **kw: 0.0)
    out = tmp_path / "speedrun.json"
    assert speedrun.main(["--shape", "tiny", "--budgets", "1.5", "--ref-lrs", "1e-2", "--ref-tokens", "6400",
                          "--train-bin", tokens["train_bin"], "--val-bin", tokens["val_bin"], "--tokenizer", "",
                          "--work", str(tmp_path / "work"), "--eval-interval", "20", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    run = results["ref_tokens_run"]
    assert run["tokens"] == 6400 and run["steps"] == 100 and run["lr"] == 1e-2  # 64 tokens a step
    assert 0 < run["seconds"] and len(run["curve"]) == 5 and run["curve"][-1][1] == run["window_val_loss"]
    (row,) = results["rows"]
    reached = 0.5 + 0.5 * (99.0 - run["window_val_loss"]) / 99.0  # on the faked curve
    assert row["scratchlm"]["seconds_to_ref_tokens_loss"] == pytest.approx(reached)
    assert row["ref_tokens_time_ratio"] == pytest.approx(reached / run["seconds"])
    summary = json.loads((tmp_path / "work" / "ref_tokens_6400" / "summary.json").read_text())
    assert summary["tokens"] == 6400  # trained for its tokens, not for a time budget


def test_the_fixed_steps_reference_command_has_no_time_budget(tokens, tmp_path):
    speedrun = load("speedrun")
    cfg = load_config(TrainConfig, "tiny-cpu", [f"--model.vocab_size={VOCAB}"])
    data = {"train_bin": tokens["train_bin"], "val_bin": tokens["val_bin"], "vocab_size": VOCAB}
    cmd = speedrun.reference_steps_command(cfg, steps=123, lr=1e-3, out=tmp_path / "r", data=data,
                                           eval_interval=10, cuda=False)
    assert "--time-budget-s" not in cmd and cmd[cmd.index("--steps") + 1] == "123"
