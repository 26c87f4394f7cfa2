import time

import pytest

from scratchlm.bench.timing import back_to_back, timed_windows


def _sleeper(seconds):
    calls = []

    def step():
        calls.append(1)
        time.sleep(seconds)
    return step, calls


def test_timed_windows_runs_each_window_and_reports_seconds_per_step():
    step, calls = _sleeper(0.002)
    times = timed_windows(step, steps=4, windows=3, device="cpu")
    assert len(calls) == 12 and len(times) == 3
    assert all(0.002 <= t < 0.05 for t in times)


def test_back_to_back_is_the_median_run_per_step():
    durations = iter([0.001] * 2 + [0.02] * 2 + [0.004] * 2)  # three runs of two steps: fast, slow, middle

    def step():
        time.sleep(next(durations))

    per_step = back_to_back(step, steps=2, repeats=3, device="cpu")
    assert 0.004 <= per_step < 0.015


@pytest.mark.parametrize("fn", [timed_windows, back_to_back])
def test_rejects_empty_runs(fn):
    with pytest.raises(ValueError):
        fn(lambda: None, 0, 1, device="cpu")


@pytest.mark.gpu
def test_copy_bandwidth_is_a_plausible_device_bandwidth():
    from scratchlm.bench.timing import copy_bandwidth

    bandwidth = copy_bandwidth(gib=1, repeats=3)
    assert 1e11 < bandwidth < 2e13  # 0.1 to 20 TB/s: any current GPU's HBM or GDDR
