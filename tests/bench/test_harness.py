import pytest
import torch

from scratchlm.bench.harness import benchmark


def test_counts_warmup_and_steps_and_reports_stats():
    calls = []
    result = benchmark(lambda: calls.append(1), warmup=3, steps=5, device="cpu")
    assert len(calls) == 8 and len(result.times) == 5
    assert result.min <= result.median <= max(result.times)
    assert result.mean >= 0 and result.std >= 0 and result.peak_memory_bytes is None
    d = result.to_dict()
    assert set(d) >= {"times", "mean", "std", "min", "median", "peak_memory_bytes"}


def test_custom_sync_is_called_and_bad_steps_rejected():
    synced = []
    benchmark(lambda: None, warmup=1, steps=2, sync=lambda: synced.append(1), device="cpu")
    assert len(synced) == 3  # once after warm-up, once per timed step
    with pytest.raises(ValueError):
        benchmark(lambda: None, steps=0, device="cpu")


@pytest.mark.gpu
def test_cuda_timing_and_peak_memory():
    a = torch.randn(2048, 2048, device="cuda")
    result = benchmark(lambda: a @ a, warmup=2, steps=3)
    assert result.peak_memory_bytes >= a.numel() * 4 * 2
    assert all(t > 0 for t in result.times)


def test_timing_device_defaults_to_cuda_or_cpu_never_mps(monkeypatch):
    from scratchlm.bench.harness import timing_device
    from scratchlm.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert timing_device(None) == torch.device("cpu")
    assert timing_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="CUDA is not available"):
        timing_device("cuda")
