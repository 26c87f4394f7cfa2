import math

import pytest

from scratchlm.optim.schedule import constant_lr, cosine_lr, linear_lr


def test_cosine_lr_matches_the_formula_at_every_step():
    max_lr, min_lr, tw, tc = 1.0, 0.1, 7, 21
    for it in range(30):
        if it < tw:
            expected = it / tw * max_lr
        elif it <= tc:
            expected = min_lr + 0.5 * (1 + math.cos((it - tw) / (tc - tw) * math.pi)) * (max_lr - min_lr)
        else:
            expected = min_lr
        assert cosine_lr(it, max_lr, min_lr, tw, tc) == pytest.approx(expected, abs=1e-12)


def test_cosine_lr_reference_values():
    # Values from the widely used from-scratch course schedule (max 1, min 0.1, warm-up 7, cycle 21).
    expected = [0, 0.14285714285714285, 0.2857142857142857, 0.42857142857142855, 0.5714285714285714,
                0.7142857142857143, 0.8571428571428571, 1.0, 0.9887175604818206, 0.9554359905560885,
                0.9018241671106134, 0.8305704108364301, 0.7452476826029011, 0.6501344202803414,
                0.55, 0.44986557971965857, 0.3547523173970989, 0.26942958916356996,
                0.19817583288938662, 0.14456400944391146, 0.11128243951817937, 0.1, 0.1, 0.1, 0.1]
    got = [cosine_lr(it, 1, 0.1, 7, 21) for it in range(25)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_edges_without_warmup_or_decay():
    assert cosine_lr(0, 2.0, 0.5, 0, 10) == 2.0
    assert cosine_lr(5, 2.0, 0.5, 5, 5) == 2.0
    assert cosine_lr(6, 2.0, 0.5, 5, 5) == 0.5


def test_other_schedules():
    assert constant_lr(3, 1.0, 0.0, 6, 10) == 0.5 and constant_lr(99, 1.0, 0.0, 6, 10) == 1.0
    assert linear_lr(6, 1.0, 0.0, 6, 10) == 1.0 and linear_lr(8, 1.0, 0.0, 6, 10) == 0.5
    assert linear_lr(11, 1.0, 0.0, 6, 10) == 0.0


def test_budget_lr_is_step_warmup_times_the_schedule_over_progress():
    from scratchlm.optim.schedule import budget_lr

    max_lr, min_lr, warmup = 1.0, 0.1, 4
    for step, progress in [(1, 0.0), (2, 0.1), (4, 0.3), (7, 0.5), (50, 0.99), (60, 1.0), (61, 1.3)]:
        p = min(progress, 1.0)
        warm = min(1.0, step / warmup)
        cosine = min_lr + 0.5 * (1 + math.cos(math.pi * p)) * (max_lr - min_lr)
        assert budget_lr(cosine_lr, step, progress, max_lr, min_lr, warmup) == pytest.approx(warm * cosine, abs=1e-12)
        assert budget_lr(linear_lr, step, progress, max_lr, min_lr, warmup) == pytest.approx(
            warm * (max_lr + p * (min_lr - max_lr)), abs=1e-12)
        assert budget_lr(constant_lr, step, progress, max_lr, min_lr, 0) == max_lr
    assert budget_lr(cosine_lr, 5, 0.5, 1.0, 0.0, 10) == pytest.approx(0.25)


def test_learning_rate_follows_progress_when_given():
    from scratchlm.optim import learning_rate
    from scratchlm.optim.config import OptimConfig

    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="linear")
    assert learning_rate(cfg, 10, 100) == pytest.approx(0.9)
    assert learning_rate(cfg, 10, 100, progress=0.25) == pytest.approx(0.75)  # the step no longer matters


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_matches_the_hand_formula_at_every_step(shape):
    from scratchlm.optim.schedule import wsd_lr

    max_lr, min_lr, warmup, end, fraction = 2.0, 0.2, 5, 50, 0.3
    start = 35  # (1 - 0.3) * 50: the decay takes the last 15 steps
    for it in range(60):
        if it < warmup:
            expected = max_lr * it / warmup
        elif it <= start:
            expected = max_lr
        elif it < end:
            p = (it - start) / (end - start)
            expected = (max_lr + p * (min_lr - max_lr) if shape == "linear"
                        else min_lr + (1 - math.sqrt(p)) * (max_lr - min_lr))
        else:
            expected = min_lr
        got = wsd_lr(it, max_lr, min_lr, warmup, end, decay_fraction=fraction, shape=shape)
        assert got == pytest.approx(expected, abs=1e-12), it
    assert wsd_lr(90, 1.0, 0.0, 10, 100, decay_fraction=0.2) == pytest.approx(0.5)
    # a decay longer than the run after warm-up starts at the end of the warm-up
    assert wsd_lr(10, 1.0, 0.0, 10, 20, decay_fraction=1.0) == 1.0
    assert wsd_lr(15, 1.0, 0.0, 10, 20, decay_fraction=1.0) == pytest.approx(0.5)


def test_wsd_through_the_config_by_steps_and_over_a_time_budget():
    from scratchlm.optim import learning_rate
    from scratchlm.optim.config import OptimConfig

    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=10, schedule="wsd", decay_fraction=0.25)
    assert [learning_rate(cfg, s, 100) for s in (5, 10, 75, 80, 90, 100)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.8, 0.4, 0.0])
    # over a budget: stable until 75% of the time, then linear to 0
    assert [learning_rate(cfg, 50, 10**6, progress=p) for p in (0.5, 0.75, 0.875, 1.0)] == pytest.approx(
        [1.0, 1.0, 0.5, 0.0])
    sqrt = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="wsd", decay_fraction=0.5, decay_shape="1-sqrt")
    assert learning_rate(sqrt, 75, 100) == pytest.approx(1 - math.sqrt(0.5))
    with pytest.raises(ValueError, match="decay_fraction"):
        OptimConfig(schedule="wsd", decay_fraction=0.0)
    with pytest.raises(ValueError, match="decay_shape"):
        OptimConfig(decay_shape="cosine")
