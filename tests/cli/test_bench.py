"""`scratchlm bench` on CPU: every mode, the options, JSON and table output, bad input."""

import json

import pytest

from scratchlm.cli.bench import bench_command
from scratchlm.errors import UserError

TINY = ["--size", "tiny", "--batch-size", "2", "--context-length", "16", "--warmup", "1", "--steps", "2",
        "--model.vocab_size=128", "--device", "cpu"]


def test_all_modes_json_on_cpu(capsys):
    assert bench_command([*TINY, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == {"forward", "forward_backward", "train_step"}
    for r in out["modes"].values():
        assert len(r["times"]) == 2 and r["tokens_per_s"] > 0
    assert out["model"]["vocab_size"] == 128 and out["model"]["d_model"] == 64


def test_fused_head_checkpointing_and_flash_torch_table(capsys):
    argv = [*TINY, "--mode", "train_step", "--fused-lm-head", "--activation-checkpointing", "1",
            "--attention-backend", "flash_torch"]
    assert bench_command(argv) == 0
    out = capsys.readouterr().out
    assert "train_step" in out and "flash_torch" in out


def test_compiled_step_with_the_fused_optimizer_option_runs_on_cpu(capsys):
    # On CPU the Triton AdamW does not qualify and the optimizer takes its multi-tensor path.
    argv = [*TINY, "--mode", "train_step", "--compile", "--optimizer", "scratchlm_fused", "--json"]
    assert bench_command(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer"] == "scratchlm_fused" and out["compile"]
    assert out["modes"]["train_step"]["tokens_per_s"] > 0


def test_bad_input_is_a_user_error():
    with pytest.raises(UserError):
        bench_command([*TINY, "--model.d_model=63"])
    with pytest.raises(UserError):
        bench_command([*TINY, "--optim.lr=1"])
    with pytest.raises(UserError):
        bench_command([*TINY, "--steps", "0"])


@pytest.mark.parametrize("extra, message", [
    (["--vocab-size", "0"], "--vocab-size must be >= 1"),  # was taken as "not given": 10000
    (["--vocab-size", "-5"], "--vocab-size must be >= 1"),
    (["--activation-checkpointing", "-1"], "--activation-checkpointing must be >= 0"),
    # past int64: torch's TypeError or OverflowError building the batch
    (["--batch-size", str(10**20)], r"--batch-size 10+ x --context-length 16 x vocab_size \d+ = .* logits, more than "
                                    r"a tensor holds \(2\*\*63 - 1\)"),
    (["--context-length", str(10**20)], r"model.context_length must be at most 2\*\*31 - 1"),
])
def test_out_of_range_sizes_are_user_errors(extra, message):
    with pytest.raises(UserError, match=message):
        bench_command([*TINY, *extra])


def test_a_backend_that_cannot_run_on_the_device_is_refused(capsys):
    """flash_triton on CPU attends with 'math': the table and JSON named flash_triton for math's timings."""
    with pytest.raises(UserError, match=r"'flash_triton' does not run on cpu .*math or flash_torch"):
        bench_command([*TINY, "--mode", "forward", "--attention-backend", "flash_triton"])
    with pytest.raises(UserError, match="'flash_triton' does not run on cpu"):
        bench_command([*TINY, "--mode", "forward", "--model.attention_backend=flash_triton"])


def test_memory_snapshot_off_cuda_is_refused_before_the_timing(monkeypatch, tmp_path):
    """--device cpu --memory-snapshot on a GPU machine recorded the CUDA allocator of a CPU step."""
    import torch

    import scratchlm.bench.run as bench_run

    def not_timed(*args, **kwargs):
        raise AssertionError("timed before refusing")

    monkeypatch.setattr(bench_run, "benchmark", not_timed)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UserError, match="--memory-snapshot records the CUDA allocator: it needs a CUDA device, not cpu"):
        bench_command([*TINY, "--memory-snapshot", str(tmp_path / "snap.pickle")])


def test_a_shape_too_large_for_the_cpu_is_a_user_error(capsys):
    # The allocator's RuntimeError was reported as an unexpected error ("rerun with --debug").
    from scratchlm.cli import main

    assert main(["bench", *TINY, "--batch-size", "100000000000", "--mode", "forward"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("scratchlm bench: error: out of memory: the CPU allocator refused 11,920.9 GiB for "
                          "batch 100000000000 x context 16") and "--debug" not in err


@pytest.mark.parametrize("value", ["-1", str(2**64)])  # 2**64 was a ValueError from torch.manual_seed
def test_a_seed_out_of_range_is_a_user_error(value):
    with pytest.raises(UserError, match=r"--seed must be in \[0, 2\*\*64\)"):
        bench_command([*TINY, "--seed", value])


def test_the_fused_head_with_a_logit_softcap_is_refused():
    # The fused loss skips the cap: a model without it was timed under the softcapped model's name.
    with pytest.raises(UserError, match=r"--fused-lm-head computes the loss from uncapped logits: it would time a "
                                        r"model without model.logit_softcap=5"):
        bench_command([*TINY, "--mode", "train_step", "--fused-lm-head", "--model.logit_softcap=5"])
