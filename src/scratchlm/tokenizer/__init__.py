"""Byte-level BPE: training (``train_bpe``), encoding and decoding (``Tokenizer``), file formats.

Pure Python on ``regex``; nothing here imports torch. Names are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "train_bpe": "scratchlm.tokenizer.train",
    "Tokenizer": "scratchlm.tokenizer.tokenizer",
    "UnknownTokenError": "scratchlm.tokenizer.tokenizer",
    "GPT2_PAT": "scratchlm.tokenizer.pretokenize",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'scratchlm.tokenizer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
