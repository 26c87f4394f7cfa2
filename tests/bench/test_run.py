"""`scratchlm.bench.run`: the library side of `scratchlm bench` (command tests: tests/cli/test_bench.py)."""

import pytest

from scratchlm.bench.run import MODES, BenchOptions, run_bench
from scratchlm.errors import UserError

TINY = dict(size="tiny", batch_size=2, context_length=16, warmup=1, steps=2, device="cpu")


def test_run_bench_times_the_modes_asked_for():
    results = run_bench(BenchOptions(**TINY, mode="forward"), ["--model.vocab_size=128"])
    assert list(results["modes"]) == ["forward"] and results["modes"]["forward"]["tokens_per_s"] > 0
    assert results["model"]["vocab_size"] == 128 and results["model"]["d_model"] == 64
    assert results["batch_size"] == 2 and results["context_length"] == 16 and results["precision"] == "fp32"
    results = run_bench(BenchOptions(**TINY, vocab_size=96))
    assert tuple(results["modes"]) == MODES and results["model"]["vocab_size"] == 96


def test_run_bench_rejects_bad_options():
    with pytest.raises(UserError, match="--steps"):
        run_bench(BenchOptions(**{**TINY, "steps": 0}))
    with pytest.raises(UserError, match="only --model"):
        run_bench(BenchOptions(**TINY), ["--optim.lr=1"])


@pytest.mark.parametrize("length", [8, 32])
def test_a_model_context_length_override_other_than_the_timed_one_is_refused(length):
    """Shorter: a ValueError from the model at the first forward; longer: timed at 16 tokens, silently."""
    with pytest.raises(UserError, match=f"--model.context_length={length} differs from --context-length 16"):
        run_bench(BenchOptions(**TINY), [f"--model.context_length={length}"])
    run_bench(BenchOptions(**TINY, mode="forward"), ["--model.context_length=16"])


@pytest.mark.parametrize("mode, total_mib, weights_fit", [
    ("train_step", 8, False),  # 4 MiB of weights, 16 MiB with gradients and AdamW's moments
    ("train_step", 64, True),
    ("forward", 8, True),  # the weights alone: 4 MiB
])
def test_out_of_memory_message_says_whether_the_weights_fit(monkeypatch, mode, total_mib, weights_fit):
    import types

    import torch

    from scratchlm.bench.run import _out_of_memory_message

    model = torch.nn.Linear(1024, 1024, bias=False)  # 2**20 float32 weights
    props = types.SimpleNamespace(total_memory=total_mib * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    message = _out_of_memory_message(model, mode, 4, 512, torch.device("cuda"))
    assert message.startswith(f"out of GPU memory in {mode} with batch 4 x context 512 (1M parameters)")
    assert ("--activation-checkpointing 1" in message) == weights_fit
    assert ("alone need" in message) == (not weights_fit)


def test_torch_fused_optimizer_is_fused_on_cpu_too():
    """--optimizer torch_fused on CPU timed the unfused AdamW under the fused name."""
    import torch

    from scratchlm.bench.run import _build_optimizer

    model = torch.nn.Linear(4, 4)
    optimizer = _build_optimizer(model, BenchOptions(optimizer="torch_fused"), torch.device("cpu"))
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True


def test_memory_snapshot_path_problems_are_refused_before_the_timing(monkeypatch, tmp_path):
    import torch

    from scratchlm.bench.run import _check_output_file

    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a directory"):
        _check_output_file(str(tmp_path), "--memory-snapshot")
    with pytest.raises(UserError, match=r"file is a file, not a directory"):
        _check_output_file(str(tmp_path / "file" / "snap.pickle"), "--memory-snapshot")
    _check_output_file(str(tmp_path / "new" / "snap.pickle"), "--memory-snapshot")  # created when written
    monkeypatch.setattr("scratchlm.bench.run.timing_device", lambda name: torch.device("cuda"))
    with pytest.raises(UserError, match="is a directory"):
        run_bench(BenchOptions(**{**TINY, "memory_snapshot": str(tmp_path)}))


def test_options_that_change_nothing_timed_are_noted(caplog):
    with caplog.at_level("WARNING", logger="scratchlm.bench"):
        run_bench(BenchOptions(**TINY, mode="train_step", optimizer="scratchlm_fused"), ["--model.moe_top_k=1"])
    assert [m for m in caplog.messages if m.startswith("note:")] == [
        'note: model.moe_top_k=1 has no effect (the moe_* options apply to model.ffn="moe"; this model\'s ffn is '
        '"swiglu")',
        "note: --optimizer scratchlm_fused has no effect on cpu (its Triton kernel needs a CUDA device); the "
        "optimizer steps as with --optimizer scratchlm"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="scratchlm.bench"):
        run_bench(BenchOptions(**TINY, mode="train_step"), ["--model.ffn=moe", "--model.moe_top_k=1"])
    assert not [m for m in caplog.messages if m.startswith("note:")]
