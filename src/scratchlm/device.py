"""Which device to run on, and how fast its matmuls can go.

`resolve_device` gives every command the same meaning for a device name: "auto" is CUDA when
present, else Apple's MPS when present, else the CPU; an explicit device that this machine
lacks is a one-line `UserError`, not a traceback from the first tensor placed on it.

`peak_flops` is the denominator of model-FLOPs utilisation (MFU), for the trainer and the
benchmarks alike: the vendors' dense (non-sparse) datasheet rates of `GPU_PEAK_FLOPS`, per
precision. "bf16" is the bf16 tensor-core rate (fp16 too, on the V100, which has no bf16),
"tf32" the TF32 tensor-core rate that fp32 matmuls run at when TF32 is allowed, "fp32" the
plain float32 rate. A CPU, or a GPU not in the table, has no peak (MFU is then n/a).

Nothing here imports torch until a function needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scratchlm.errors import UserError

if TYPE_CHECKING:
    import torch

__all__ = ["GPU_PEAK_FLOPS", "PEAK_PRECISIONS", "gpu_peak_flops", "peak_flops", "resolve_device"]


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch.device of a device name: "auto" (CUDA, else MPS, else CPU) or as torch spells it
    ("cpu", "cuda", "cuda:1", "mps"); raises UserError for a name torch does not know or a device
    this machine lacks.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    import torch

    if str(name) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device {str(name)!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {str(name)!r} asked for, but CUDA is not available; "
                            "ask for device auto or cpu instead")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"device {str(name)!r} asked for, but this machine has "
                            f"{torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not _mps_available():
        raise UserError(f"device {str(name)!r} asked for, but MPS is not available; "
                        "ask for device auto or cpu instead")
    return device


def _mps_available() -> bool:
    import torch

    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


PEAK_PRECISIONS = ("bf16", "tf32", "fp32")

# (name fragment, {precision: dense peak FLOP/s}); the first fragment found in the device name
# wins, so the more specific names come first. A precision a row lacks has no known peak.
GPU_PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("GH200", {"bf16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("H100", {"bf16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("H200", {"bf16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("B200", {"bf16": 2250e12, "fp32": 80e12}),
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("A10G", {"bf16": 70e12, "fp32": 31.2e12}),
    ("A10", {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("RTX 4090", {"bf16": 165e12, "fp32": 82.6e12}),
    ("V100", {"bf16": 125e12, "fp32": 15.7e12}),  # fp16 tensor cores (V100 has no bf16)
]


def gpu_peak_flops(gpu_name: str, precision: str = "bf16") -> float | None:
    """Dense datasheet FLOP/s of the GPU named `gpu_name` (as CUDA reports it) at `precision`
    ("bf16", "tf32" or "fp32"; dtype spellings such as "bfloat16" work too), or None if unknown.

    >>> gpu_peak_flops("NVIDIA H200", "bf16")
    989000000000000.0
    """
    from scratchlm.dtypes import canonical_dtype

    try:
        key = "tf32" if precision == "tf32" else canonical_dtype(precision)
    except ValueError:
        raise ValueError(f"precision must be one of {', '.join(PEAK_PRECISIONS)} or fp16, got {precision!r}") from None
    key = "bf16" if key == "fp16" else key  # the tensor-core rate: the same for fp16 and bf16
    for fragment, peaks in GPU_PEAK_FLOPS:
        if fragment in gpu_name:
            return peaks.get(key)
    return None


def peak_flops(device: torch.device, precision: str = "bf16", *, override: float = 0.0) -> float | None:
    """Peak FLOP/s of `device` at `precision` (see `gpu_peak_flops`): `override` when positive,
    None on a CPU or an unlisted GPU."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    import torch

    return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
