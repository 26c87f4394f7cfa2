"""What scratchlm's Triton kernels share: the guarded import, when a tensor can run them, and
how their launchers become ops that torch.compile can see into.

Triton is optional (CPU-only torch wheels may not ship it): ``triton`` and ``tl`` are None
without it, and every op then runs its PyTorch formula instead.

The ops: with ``torch.library.triton_op`` (torch >= 2.6) an op's body is visible to
torch.compile: AOTAutograd traces it (allocations plus one triton_kernel_wrapper HOP per
``wrap_triton`` call) and Inductor launches the Triton kernels from its own generated code, so a
compiled model has no opaque Python call in its graph and CUDA graphs (mode="reduce-overhead")
capture the kernels with everything else. The body doubles as the fake (meta) kernel, so it must
stay free of data-dependent Python: only shapes, strides and dtypes decide anything. Eagerly a
triton_op runs its body directly (``wrap_triton`` is then a no-op).

Where triton_op is missing (torch < 2.6), Triton runs in its CPU interpreter (whose kernels
cannot be traced with fake tensors) or SCRATCHLM_FLASH_TRITON_OP=0, the same bodies are
registered as opaque ``custom_op``s with separate fake kernels.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext

import torch

try:  # triton is optional: CPU-only wheels of torch may not ship it
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

__all__ = ["USE_TRITON_OP", "can_use_triton", "device_of", "interpreting", "register_op", "tl", "triton",
           "triton_available", "wrap_triton"]


def triton_available() -> bool:
    """True when triton could be imported (CUDA is checked separately, per tensor)."""
    return triton is not None


def interpreting() -> bool:
    """True under Triton's CPU interpreter (numpy), which runs the kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def can_use_triton(t: torch.Tensor) -> bool:
    """Whether a kernel can run on `t`: triton is installed and `t` is on CUDA (or interpreted)."""
    return triton_available() and (t.is_cuda or interpreting())


def device_of(t: torch.Tensor):
    """A context that makes `t`'s CUDA device current for a launch (no-op on CPU)."""
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


def _use_triton_op() -> bool:
    # SCRATCHLM_FLASH_TRITON_OP=0 keeps the opaque custom ops (the registration measured first,
    # docs/benchmarks/train_step.md); both ran the gpt2small step at the same speed on the H200.
    return (os.environ.get("SCRATCHLM_FLASH_TRITON_OP", "1") != "0" and hasattr(torch.library, "triton_op")
            and hasattr(torch.library, "wrap_triton") and not interpreting())


USE_TRITON_OP = _use_triton_op()


def wrap_triton(kernel):
    """``torch.library.wrap_triton(kernel)`` for the triton_ops; the kernel itself otherwise.

    Named like torch's function on purpose: ``triton_op`` finds the kernels an op launches by
    looking for ``wrap_triton(<name>)`` calls in its source, and keys compile caches on them.
    """
    return torch.library.wrap_triton(kernel) if USE_TRITON_OP else kernel


def register_op(name: str, impl, fake):
    """The op `name` running `impl`: a triton_op where torch has one (its body is its own fake
    kernel), else a custom op with the fake kernel `fake`. `impl` must not mutate its inputs."""
    if not USE_TRITON_OP:
        op = torch.library.custom_op(name, mutates_args=())(impl)
        op.register_fake(fake)
        return op
    # Without triton (CPU wheels) triton_op still works (the body then only runs the PyTorch
    # reference) but logs that it found no kernels; that is expected here, so keep it quiet.
    log = logging.getLogger("torch._library.triton")
    level = log.level
    if triton is None:
        log.setLevel(logging.ERROR)
    try:
        return torch.library.triton_op(name, mutates_args=())(impl)
    finally:
        log.setLevel(level)
