"""trainer.fp8: the blocks' matmuls in FP8 train like the full-precision run."""

from dataclasses import replace

import pytest

from scratchlm.cli.train import run_training
from scratchlm.errors import UserError
from scratchlm.train.trainer import check_combinations
from tests.train.small_runs import losses, make_cfg


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_run_learns_like_the_full_precision_run(tmp_path, recipe):
    cfg = make_cfg(tmp_path)
    runs = {}
    for fp8 in (False, True):
        out = tmp_path / f"fp8_{fp8}"
        run_training(replace(cfg, trainer=replace(cfg.trainer, fp8=fp8, fp8_recipe=recipe, out_dir=str(out))))
        runs[fp8] = losses(out)
    full, fp8 = [v for _, v in runs[False]], [v for _, v in runs[True]]
    assert fp8[-1] < fp8[0] - 0.5  # it learned
    assert fp8 != full  # the FP8 path ran: quantisation changes the numbers
    assert abs(fp8[-1] - full[-1]) < 0.1 * full[-1]
    evals = [v for _, v in losses(tmp_path / "fp8_True", "eval", "val_loss")]
    assert evals and evals[-1] < evals[0]


@pytest.mark.parametrize("strategy", ["fsdp", "torch_fsdp2"])
def test_fp8_refuses_sharded_weights(tmp_path, strategy):
    cfg = make_cfg(tmp_path, fp8=True)
    cfg = replace(cfg, parallel=replace(cfg.parallel, strategy=strategy))
    with pytest.raises(UserError, match="trainer.fp8"):
        check_combinations(cfg)
