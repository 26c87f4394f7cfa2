"""Decoding: sampling filters, KV caches (growing and static), the decoding engine; token ids only.

Names are resolved lazily so that importing the package (e.g. for the CLI table) is cheap.
`generate` is not re-exported: its module has the same name, and the package attribute would
then depend on import order; use `from scratchlm.infer.generate import generate`.
"""

from __future__ import annotations

from scratchlm.lazy_exports import lazy_exports

_EXPORTS: dict[str, str] = {
    "KVCache": "scratchlm.infer.kv_cache",
    "StaticKVCache": "scratchlm.infer.static_cache",
    "DecodeEngine": "scratchlm.infer.engine",
    "sample_next": "scratchlm.infer.sampling",
    "top_k_filter": "scratchlm.infer.sampling",
    "top_p_filter": "scratchlm.infer.sampling",
    "apply_temperature": "scratchlm.infer.sampling",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
