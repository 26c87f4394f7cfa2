"""Names of floating-point dtypes, as configs and flags spell them.

One mapping serves every place that reads a dtype name. The canonical names are the short ones
the configs use ("fp32", "bf16", "fp16") and are what scratchlm writes back (resolved configs,
printed summaries); torch's spellings ("float32", "bfloat16", "float16") and "half"/"float" are
accepted wherever a user types a name. Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_NAMES", "canonical_dtype", "dtype_name", "torch_dtype"]

# canonical name -> the torch attribute of that dtype
DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_ALIASES: dict[str, str] = {
    **{name: name for name in DTYPE_NAMES},
    **{attr: name for name, attr in DTYPE_NAMES.items()},
    "float": "fp32",
    "half": "fp16",
}


def canonical_dtype(name: str, *, allowed: tuple[str, ...] = tuple(DTYPE_NAMES)) -> str:
    """The canonical name ("fp32", "bf16", "fp16") of a dtype name in either spelling; raises
    ValueError naming the accepted names when `name` is not one of `allowed`.

    >>> canonical_dtype("bfloat16")
    'bf16'
    """
    canonical = _ALIASES.get(str(name).lower())
    if canonical is None or canonical not in allowed:
        spellings = ", ".join(f"{n} ({DTYPE_NAMES[n]})" for n in allowed)
        raise ValueError(f"unknown dtype {name!r}; use one of {spellings}")
    return canonical


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name in either spelling: ``torch_dtype("bf16") is torch.bfloat16``."""
    import torch

    return getattr(torch, DTYPE_NAMES[canonical_dtype(name)])


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a torch floating-point dtype: ``dtype_name(torch.bfloat16) == "bf16"``."""
    return canonical_dtype(str(dtype).removeprefix("torch."))
