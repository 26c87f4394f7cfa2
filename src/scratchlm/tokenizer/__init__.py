"""Byte-level BPE: training (``train_bpe``), encoding and decoding (``Tokenizer``), file formats.

Pure Python on ``regex``; nothing here imports torch. Names are loaded on first use.
"""

from __future__ import annotations

from scratchlm.lazy_exports import lazy_exports

_EXPORTS = {
    "train_bpe": "scratchlm.tokenizer.train",
    "Tokenizer": "scratchlm.tokenizer.tokenizer",
    "UnknownTokenError": "scratchlm.tokenizer.tokenizer",
    "GPT2_PAT": "scratchlm.tokenizer.pretokenize",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
