"""Lazy re-exports for package ``__init__`` files.

A package lists ``name -> module`` and gets a module-level ``__getattr__`` / ``__dir__`` that
import the defining module on first use, so importing a package (for the CLI table, a config
dataclass or the tokenizer) never pulls in torch by accident.

    __getattr__, __dir__ = lazy_exports(__name__, {"Tokenizer": "scratchlm.tokenizer.tokenizer"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` resolving each name in ``exports`` on first access."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
