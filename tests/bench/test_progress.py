import io
import logging
import time

import torch

from scratchlm.bench.progress import reported
from scratchlm.bench.run import CPU_PARAMS_LIMIT, _warn_if_gpu_sized


def test_a_piped_loop_reports_a_line_every_few_seconds():
    stream = io.StringIO()  # not a terminal: plain lines, no bar
    with reported("bench forward", 6, every_s=0.05, stream=stream) as counter:
        step = counter.wrap(lambda: time.sleep(0.03))
        for _ in range(6):
            step()
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 2
    assert all(line.startswith("bench forward: ") and line.endswith(" s)") for line in lines)
    counts = [int(line.split(": ")[1].split("/")[0]) for line in lines]
    assert counts == sorted(counts) and counts[-1] <= 6 and counts[0] < 6
    assert counter.count == 6


def test_wrap_returns_what_the_step_returns():
    with reported("x", 1, every_s=60, stream=io.StringIO()) as counter:
        assert counter.wrap(lambda: 7)() == 7


def test_gpu_sized_models_on_cpu_are_flagged(caplog):
    with caplog.at_level(logging.WARNING):
        _warn_if_gpu_sized({"params": CPU_PARAMS_LIMIT + 1}, torch.device("cpu"))
        _warn_if_gpu_sized({"params": CPU_PARAMS_LIMIT - 1}, torch.device("cpu"))
        _warn_if_gpu_sized({"params": 10 * CPU_PARAMS_LIMIT}, torch.device("meta"))
    assert len(caplog.records) == 1 and "meant for a GPU" in caplog.records[0].getMessage()
