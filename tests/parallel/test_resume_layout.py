"""Resuming a checkpoint whose optimizer state is saved per rank (`parallel.optimizer_state =
"sharded"`) needs the strategy, layout and number of ranks that wrote it; another is refused
with a message naming them (it used to fail with a KeyError or a size mismatch)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from scratchlm.config import load_config
from scratchlm.errors import UserError
from scratchlm.train.config import TrainConfig

SETTINGS = ["--model.vocab_size=64", "--model.context_length=16", "--model.d_model=32", "--model.num_layers=1",
            "--model.num_heads=2", "--model.d_ff=64", "--trainer.batch_size=2", "--trainer.log_interval=1",
            "--trainer.checkpoint_interval=1", "--trainer.eval_at_start=false", "--trainer.device=cpu",
            "--trainer.progress=false", "--trainer.sample_tokens=0", "--parallel.backend=gloo"]


def _config(tmp_path: Path, *overrides: str) -> TrainConfig:
    train = tmp_path / "train.bin"
    if not train.exists():
        np.random.default_rng(0).integers(0, 64, size=2000).astype(np.uint16).tofile(train)
        train.with_suffix(".json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 64, "num_tokens": 2000}))
    return load_config(TrainConfig, None, [*SETTINGS, f"--data.train_path={train}",
                                           f"--trainer.out_dir={tmp_path / 'run'}", *overrides])


@pytest.mark.parametrize("other", [["--parallel.strategy=zero1", "--parallel.optimizer_state=full"],
                                   ["--parallel.strategy=fsdp", "--parallel.optimizer_state=sharded"]])
def test_sharded_optimizer_state_resumes_only_with_its_strategy_and_layout(tmp_path, other):
    from scratchlm.cli.train import run_training

    sharded = ["--parallel.strategy=zero1", "--parallel.optimizer_state=sharded"]
    run_training(_config(tmp_path, *sharded, "--trainer.max_steps=1"))
    with pytest.raises(UserError, match=r"parallel.strategy='zero1' on 1 ranks; resume it with "
                                        r"--parallel.strategy=zero1 --parallel.optimizer_state=sharded"):
        run_training(_config(tmp_path, *other, "--trainer.max_steps=2"), resume=True)
    # the same settings continue it
    run_training(_config(tmp_path, *sharded, "--trainer.max_steps=2"), resume=True)
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()


@pytest.mark.parametrize("sharded", [["--parallel.strategy=zero1", "--parallel.optimizer_state=sharded"],
                                     ["--parallel.strategy=fsdp", "--parallel.optimizer_state=sharded"]])
def test_full_layout_optimizer_state_resumes_into_a_per_rank_layout(tmp_path, sharded):
    """One optimizer.pt in the single-process layout loads into any strategy: a run that saves
    per rank picks it up through the full path, and continues as the uninterrupted run does."""
    import torch

    from scratchlm.cli.train import run_training

    full = ["--parallel.strategy=zero1", "--parallel.optimizer_state=full"]
    run_training(_config(tmp_path, *full, "--trainer.max_steps=1"))
    run_training(_config(tmp_path, *sharded, "--trainer.max_steps=2"), resume=True)
    straight = tmp_path / "straight"
    straight.mkdir()
    run_training(_config(straight, *full, "--trainer.max_steps=2"))
    from safetensors.torch import load_file

    resumed = load_file(tmp_path / "run" / "checkpoints" / "step_000002" / "model.safetensors")
    uninterrupted = load_file(straight / "run" / "checkpoints" / "step_000002" / "model.safetensors")
    # the second update reads the first's moments: starting them from zero moves the weights elsewhere
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value)
