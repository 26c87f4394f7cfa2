import pytest
import torch

from scratchlm.device import GPU_PEAK_FLOPS, gpu_peak_flops, peak_flops, resolve_device
from scratchlm.errors import UserError


def _machine(monkeypatch, *, cuda: int = 0, mps: bool = False):
    """Pretend this machine has `cuda` CUDA devices and MPS or not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)


@pytest.mark.parametrize("cuda, mps, expected", [(0, False, "cpu"), (0, True, "mps"), (1, True, "cuda")])
def test_auto_prefers_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, expected):
    _machine(monkeypatch, cuda=cuda, mps=mps)
    assert resolve_device("auto") == torch.device(expected)


def test_explicit_devices_come_back_as_torch_devices(monkeypatch):
    _machine(monkeypatch, cuda=2)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("name, cuda, message", [
    ("cuda", 0, "CUDA is not available"),
    ("cuda:2", 2, "has 2 CUDA device"),
    ("mps", 0, "MPS is not available"),
    ("gpu0", 0, "unknown device 'gpu0'"),
])
def test_a_device_this_machine_lacks_is_a_user_error(monkeypatch, name, cuda, message):
    _machine(monkeypatch, cuda=cuda)
    with pytest.raises(UserError, match=message) as err:
        resolve_device(name)
    # the same check serves --device, --trainer.device and --policy.device: it names no flag
    assert "--" not in str(err.value)


def test_the_more_specific_gpu_name_wins():
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert gpu_peak_flops("NVIDIA A10G", "fp32") == 31.2e12
    # every fragment is reachable: none is shadowed by an earlier, more general one
    for i, (fragment, _) in enumerate(GPU_PEAK_FLOPS):
        assert not any(earlier in fragment for earlier, _ in GPU_PEAK_FLOPS[:i]), fragment


def test_peaks_by_precision_in_either_spelling():
    assert gpu_peak_flops("NVIDIA H200", "bfloat16") == gpu_peak_flops("NVIDIA H200", "bf16") == 989e12
    assert gpu_peak_flops("NVIDIA H200", "tf32") == 494.5e12
    assert gpu_peak_flops("NVIDIA H200", "float32") == 67e12
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", "fp16") == 125e12
    assert gpu_peak_flops("Some Future GPU", "bf16") is None
    with pytest.raises(ValueError, match="int8"):
        gpu_peak_flops("NVIDIA H200", "int8")


def test_peak_of_a_device(monkeypatch):
    assert peak_flops(torch.device("cpu"), "bf16") is None
    assert peak_flops(torch.device("cpu"), "bf16", override=1e12) == 1e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_flops(torch.device("cuda"), "bf16") == 312e12
    assert peak_flops(torch.device("cuda"), "fp32") == 19.5e12
