"""The Python code blocks of a section of a Markdown page, so tests can run what the docs show.

A worked example in docs/ is only worth reading if it runs: tests call `python_blocks` to pull
the example out of the page (by its `##` heading) and execute it, so an example that stops
working fails the suite instead of misleading its reader.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"

_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def section(page: str, heading: str) -> str:
    """The text under `## heading` of docs/`page`, up to the next `## ` heading."""
    text = (DOCS / page).read_text(encoding="utf-8")
    parts = re.split(r"^## ", text, flags=re.M)
    for part in parts[1:]:
        title, _, body = part.partition("\n")
        if title.strip() == heading:
            return body
    raise KeyError(f"docs/{page} has no section '## {heading}'")


def python_blocks(page: str, heading: str) -> list[str]:
    """The ```python fenced blocks of one section, in order."""
    blocks = _FENCE.findall(section(page, heading))
    if not blocks:
        raise KeyError(f"docs/{page} section '## {heading}' has no python block")
    return blocks
