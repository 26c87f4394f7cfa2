"""What benchmark scripts write and print: the environment, JSON results, ratios against a peer.

Every benchmark in ``benchmarks/`` records the device and torch version with its rows, writes its
JSON as it goes (a run cut short by a time limit keeps the rows it measured), and prints its
rows with their ratio to the peer's row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from scratchlm.fileio import write_text_atomic

__all__ = ["environment", "write_json", "read_jsonl", "ratio", "add_ratios", "ratio_table"]


def environment() -> dict[str, str]:
    """{"device": the CUDA device's name (or "cpu"), "torch": torch's version}."""
    import torch  # here, so that scripts that only read results start without torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__}


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON to ``path``, creating its folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=1))
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl``, blank lines skipped and a last line cut short by
    a killed run left out: `scratchlm.train.metrics.read_metrics` (another damaged line is a
    UserError naming the file and the line)."""
    from scratchlm.train.metrics import read_metrics

    return read_metrics(path)


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference, or None when either is missing or the reference is zero."""
    if value is None or not reference:
        return None
    return value / reference


def add_ratios(rows: Iterable[dict], reference: Mapping[str, Any], fields: Mapping[str, str]) -> None:
    """For each row and each ``{ratio name: field}`` of ``fields``, set ``row[ratio name]`` to
    ``row[field] / reference[field]`` where both rows have the field (rows that failed have not).

    >>> rows = [{"tok_s": 30.0}, {"error": "out of memory"}]
    >>> add_ratios(rows, {"tok_s": 20.0}, {"speed_vs_ref": "tok_s"}); rows
    [{'tok_s': 30.0, 'speed_vs_ref': 1.5}, {'error': 'out of memory'}]
    """
    for row in rows:
        for name, field in fields.items():
            if field in row and field in reference:
                row[name] = ratio(row[field], reference[field])


def ratio_table(rows: Iterable[Mapping[str, Any]], *, label: str, value: str, ratio_key: str,
                header: tuple[str, str, str], value_format: str = ",.0f", label_width: int = 28) -> str:
    """A text table of each row's label, value and ratio (rows without the value are left out).

    >>> print(ratio_table([{"v": "a", "t": 2.0, "r": 1.0}], label="v", value="t", ratio_key="r",
    ...                   header=("variant", "tok/s", "ratio"), value_format=".1f", label_width=8))
    variant      tok/s     ratio
    a              2.0    1.000x
    """
    lines = [f"{header[0]:<{label_width}}{header[1]:>10}{header[2]:>10}"]
    for row in rows:
        if value not in row:
            continue
        r = row.get(ratio_key)
        shown = "n/a" if r is None else f"{r:.3f}x"
        lines.append(f"{str(row[label]):<{label_width}}{format(row[value], value_format):>10}{shown:>10}")
    return "\n".join(lines)
