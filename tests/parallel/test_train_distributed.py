"""End to end: `torchrun --nproc_per_node=2 -m scratchlm train` on CPU gloo equals one process.

Two ranks with one micro-batch each see the rows that one process sees as two accumulated
micro-batches (the sampler draws the global batch and gives rank r the r-th slice), and
(g_a + g_b) / 2 equals g_a / 2 + g_b / 2 bit for bit, so the final weights must be identical.
Each run also resumes: training to step 2, then `--resume` to step 4, must end where an
uninterrupted run ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from scratchlm.parallel.process_group import find_free_port

CONFIG = """
[model]
vocab_size = 64
context_length = 16
d_model = 32
num_layers = 2
num_heads = 2
d_ff = 64

[data]
train_path = "{train}"

[optim]
lr = 1e-2
warmup_steps = 1

[trainer]
out_dir = "{out}"
batch_size = 4
max_steps = 4
log_interval = 1
checkpoint_interval = 2
eval_at_start = false
device = "cpu"
deterministic = true
progress = false
"""


def _write_tokens(path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 64, size=4000).astype(np.uint16)
    tokens.tofile(path)
    path.with_suffix(".json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 64,
                                                     "num_tokens": int(tokens.size)}))


def _run(cmd: list[str], cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        # torchrun's summary hides the worker's error: put every line naming one first.
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
        pytest.fail("\n".join(errors[:20]) + "\n--- stderr tail ---\n" + proc.stderr[-4000:])


def _train(tmp_path: Path, name: str, launcher: list[str], overrides: list[str]) -> Path:
    train = tmp_path / "train.bin"
    if not train.exists():
        _write_tokens(train)
    out = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(CONFIG.format(train=train, out=out))
    _run([*launcher, "-m", "scratchlm", "train", str(cfg), *overrides, "--trainer.max_steps=2"], tmp_path)
    _run([*launcher, "-m", "scratchlm", "train", str(cfg), *overrides, "--resume"], tmp_path)
    return out


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    step_dirs = sorted((run / "checkpoints").glob("step_*"))
    return load_file(step_dirs[-1] / "model.safetensors")


def _train_losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if r.get("event") == "train"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def single(workdir) -> Path:
    """The one-process run: two accumulated micro-batches of 2 rows per step."""
    return _train(workdir, "single", [sys.executable], ["--trainer.grad_accum_steps=2"])


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_torchrun_two_ranks_equal_one_process(workdir, single, strategy):
    tmp_path = workdir
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                f"--master_port={find_free_port()}"]
    multi = _train(tmp_path, strategy, torchrun, [f"--parallel.strategy={strategy}", "--parallel.backend=gloo"])
    assert len(_train_losses(multi)) == 4
    np.testing.assert_allclose(_train_losses(multi), _train_losses(single), rtol=1e-6)
    expected, got = _final_weights(single), _final_weights(multi)
    assert expected.keys() == got.keys()
    for name in expected:
        if strategy == "ddp":
            assert torch.equal(expected[name], got[name]), name
        else:  # the FSDP global-norm for clipping is summed in another order
            torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=0)


MOE = ["--model.ffn=moe", "--model.moe_num_experts=4", "--model.moe_top_k=2", "--model.moe_capacity_factor=1.0",
       "--model.moe_aux_coef=0.1", "--model.moe_z_coef=0.01"]


@pytest.mark.distributed
def test_torchrun_two_ranks_equal_one_process_with_moe(workdir):
    """Experts replicated under DDP: each rank adds its micro-batch's aux losses, as one process
    adds each accumulated micro-batch's, and the router statistics are averaged over ranks."""
    single = _train(workdir, "single_moe", [sys.executable], ["--trainer.grad_accum_steps=2", *MOE])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                f"--master_port={find_free_port()}"]
    multi = _train(workdir, "ddp_moe", torchrun, ["--parallel.strategy=ddp", "--parallel.backend=gloo", *MOE])
    np.testing.assert_allclose(_train_losses(multi), _train_losses(single), rtol=1e-6)
    expected, got = _final_weights(single), _final_weights(multi)
    assert any(".ffn.w1" in name for name in expected)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    records = [json.loads(line) for line in (multi / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("event") == "train"]
    assert len(train) == 4 and all(len(r["moe_expert_util"]) == 2 and "moe_aux_loss" in r for r in train)
