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
cannot be traced with fake tensors), or ``set_op_registration("custom_op")`` chose it (the
registration measured first, docs/benchmarks/train_step.md), the same bodies are registered as
opaque ``custom_op``s with separate fake kernels. The choice is made once per process, by an
explicit ``set_op_registration`` call or else by the first op registered, not by an environment
variable.
"""

from __future__ import annotations

import inspect
import logging
import os
from contextlib import nullcontext

import torch

from scratchlm.errors import UserError

try:  # triton is optional: CPU-only wheels of torch may not ship it
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

__all__ = ["OP_REGISTRATIONS", "can_use_triton", "device_of", "interpreting", "op_registration", "pdl_launch_options",
           "pdl_supported", "register_op", "set_op_registration", "tl", "triton", "triton_available", "wrap_triton"]


def triton_available() -> bool:
    """True when triton could be imported (CUDA is checked separately, per tensor)."""
    return triton is not None


def interpreting() -> bool:
    """True under Triton's CPU interpreter (numpy), which runs the kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def can_use_triton(t: torch.Tensor) -> bool:
    """Whether a kernel can run on `t`: triton is installed and `t` is on CUDA (or interpreted)."""
    return triton_available() and (t.is_cuda or interpreting())


def pdl_supported(t: torch.Tensor) -> bool:
    """Whether kernels on `t` can be launched with programmatic dependent launch (PDL): a CUDA
    device of compute capability 9 or more (Hopper on) and a Triton with grid dependency control
    (``tl.extra.cuda.gdc_wait``). A PDL kernel may start while the kernel before it in the stream
    still runs, and waits (``gdc_wait``) before it reads what that kernel wrote: what it reads
    before then must not depend on it (weights)."""
    if not (triton_available() and t.is_cuda and not interpreting()):
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return hasattr(cuda, "gdc_wait") and torch.cuda.get_device_capability(t.device)[0] >= 9


def pdl_launch_options(pdl: bool, t: torch.Tensor) -> dict:
    """A kernel's PDL constexpr and launch option for a launch on `t`: on where asked for and
    `pdl_supported`. (The kernel takes a `PDL: tl.constexpr` that makes it call ``gdc_wait``.)"""
    on = pdl and pdl_supported(t)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


def device_of(t: torch.Tensor):
    """A context that makes `t`'s CUDA device current for a launch (no-op on CPU)."""
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


OP_REGISTRATIONS = ("triton_op", "custom_op")
_registration: str | None = None  # fixed by set_op_registration, or else by the first op_registration()


def _triton_op_supported() -> bool:
    # triton_op needs torch >= 2.6, and kernels it can trace: not the Triton interpreter's.
    return hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton") and not interpreting()


def set_op_registration(kind: str) -> None:
    """Register scratchlm's Triton ops as `kind`: "triton_op" (torch.compile traces into them; the
    default where torch has it) or "custom_op" (opaque to torch.compile, with fake kernels).

    Ops are registered when their kernel module is first imported (building a model with the
    "flash_triton" backend imports it), so call this before; afterwards only the kind in effect is
    accepted. Both kinds ran the gpt2small training step at the same speed on an H200
    (docs/benchmarks/train_step.md).
    """
    global _registration
    if kind not in OP_REGISTRATIONS:
        raise UserError(f"unknown op registration {kind!r}; choose one of {', '.join(OP_REGISTRATIONS)}")
    if kind == "triton_op" and not _triton_op_supported():
        raise UserError("triton_op registration needs torch >= 2.6 and no Triton interpreter (TRITON_INTERPRET=1); "
                        "use 'custom_op'")
    if _registration is not None and _registration != kind:
        raise UserError(f"scratchlm's Triton ops are already registered as {_registration!r}; call "
                        f"set_op_registration({kind!r}) before any scratchlm.kernels module is imported")
    _registration = kind


def op_registration() -> str:
    """How the ops are registered ("triton_op" or "custom_op"): what `set_op_registration` chose,
    else "triton_op" where torch supports it. Fixed from the first call on."""
    global _registration
    if _registration is None:
        _registration = "triton_op" if _triton_op_supported() else "custom_op"
    return _registration


def wrap_triton(kernel):
    """``torch.library.wrap_triton(kernel)`` for the triton_ops; the kernel itself otherwise.

    Named like torch's function on purpose: ``triton_op`` finds the kernels an op launches by
    looking for ``wrap_triton(<name>)`` calls in its source, and keys compile caches on them.
    """
    return torch.library.wrap_triton(kernel) if op_registration() == "triton_op" else kernel


def _custom_op_takes_tags() -> bool:
    return "tags" in inspect.signature(torch.library.custom_op).parameters


def register_op(name: str, impl, fake, *, mutates_args: tuple[str, ...] = (), opaque: bool = False):
    """The op `name` running `impl`: a triton_op where torch has one (its body is its own fake
    kernel), else, or with `opaque`, a custom op with the fake kernel `fake`. `impl` mutates only
    the arguments named in `mutates_args`. An opaque op launches its kernels itself (not through
    `wrap_triton`), inside compiled code too: with launch options Inductor does not pass on (PDL).

    An opaque op takes its inputs in whatever layout Inductor gives them (`torch.Tag.flexible_layout`,
    where torch has it; the impls check strides and take torch's path on any they cannot run).
    Under the default (exact strides), Inductor computed a copy of an unrealised input for each
    op that read it: a fused decode step of GPT-2-small computed the (b,) positions 24 times, a
    ~1 us kernel each between the step's kernels."""
    if opaque or op_registration() == "custom_op":
        flexible = opaque and hasattr(torch.Tag, "flexible_layout") and _custom_op_takes_tags()
        tags = {"tags": (torch.Tag.flexible_layout,)} if flexible else {}
        op = torch.library.custom_op(name, mutates_args=mutates_args, **tags)(impl)
        op.register_fake(fake)
        return op
    # Without triton (CPU wheels) triton_op still works (the body then only runs the PyTorch
    # reference) but logs that it found no kernels; that is expected here, so keep it quiet.
    log = logging.getLogger("torch._library.triton")
    level = log.level
    if triton is None:
        log.setLevel(logging.ERROR)
    try:
        return torch.library.triton_op(name, mutates_args=mutates_args)(impl)
    finally:
        log.setLevel(level)
