import pytest

from scratchlm.config import ConfigError, load_config
from scratchlm.optim.config import OptimConfig
from scratchlm.train.config import TrainConfig


@pytest.mark.parametrize("overrides, message", [
    # min_lr above lr: the "decay" raised the rate to min_lr, e.g. a sweep point below the preset's min_lr
    (["--optim.lr=1e-5"], r"optim.min_lr \(0.0003\) is above optim.lr \(1e-05\): the cosine decay"),
    # lr 0 or below: every step runs and no weight moves (or they climb the loss)
    (["--optim.lr=0"], r"optim.lr must be > 0 \(a rate of 0 trains nothing\), got 0$"),
    (["--optim.lr=0", "--optim.min_lr=0"], r"optim.lr must be > 0"),
    (["--optim.lr=-1e-3", "--optim.name=muon"], r"optim.lr must be > 0 .*got -0.001$"),
    (["--optim.name=muon", "--optim.muon_lr=0"], r"optim.muon_lr must be > 0 or none \(= optim.lr\), got 0$"),
    (["--optim.muon_lr=-0.02"], r"optim.muon_lr must be > 0"),
    (["--optim.min_lr=1e-2", "--optim.schedule=wsd"], r"optim.min_lr \(0.01\) is above optim.lr \(0.003\): the wsd"),
    # eps 0: AdamW's 0 / 0 for an embedding row no batch had used, then a NaN loss
    (["--optim.eps=0"], "optim.eps must be > 0"),
    # a decay that ends before step 1: the rate sat at min_lr for the whole run
    (["--optim.cosine_steps=-5"], r"optim.cosine_steps must be > 0 or none \(= trainer.max_steps\), got -5$"),
    (["--optim.cosine_steps=0"], r"optim.cosine_steps must be > 0"),
])
def test_rates_that_train_wrong_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, "tiny-cpu", overrides)


def test_min_lr_may_equal_lr_and_is_unused_by_a_constant_schedule():
    assert OptimConfig(lr=1e-3, min_lr=1e-3).min_lr == 1e-3
    assert OptimConfig(lr=1e-3, min_lr=1e-2, schedule="constant").schedule == "constant"
    assert OptimConfig(lr=1e-3, min_lr=0.0).min_lr == 0.0
    assert OptimConfig(name="muon", muon_lr=None).muon_lr is None


@pytest.mark.parametrize("kwargs, note", [
    ({"muon_lr": 0.02}, 'optim.muon_lr=0.02 has no effect (the muon_* options apply to optim.name="muon"; this run\'s '
                        'optimizer is "adamw")'),
    ({"decay_fraction": 0.1, "decay_shape": "1-sqrt"},
     'optim.decay_fraction=0.1, optim.decay_shape="1-sqrt" have no effect (optim.decay_fraction and '
     'optim.decay_shape apply to optim.schedule="wsd"; this run\'s schedule is "cosine")'),
    ({"schedule": "constant", "cosine_steps": 500},
     'optim.cosine_steps=500 has no effect (optim.schedule="constant" never decays)'),
])
def test_options_the_optimizer_and_schedule_never_read_are_named(kwargs, note):
    assert OptimConfig(**kwargs).ignored_options() == [note]


@pytest.mark.parametrize("kwargs", [
    {}, {"name": "muon", "muon_lr": 0.02, "muon_momentum": 0.9}, {"schedule": "wsd", "decay_fraction": 0.1},
    {"schedule": "linear", "cosine_steps": 500}, {"schedule": "constant", "min_lr": 0.0},
])
def test_options_the_optimizer_and_schedule_read_are_not_named(kwargs):
    assert OptimConfig(**kwargs).ignored_options() == []
