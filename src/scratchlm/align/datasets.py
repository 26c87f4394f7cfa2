"""Reasoning datasets as lists of `MathExample`: a question, its ground-truth answer, and a
worked solution when there is one.

Sources:
- ``gsm8k``: ``{question, answer}`` JSONL whose answer is a worked solution ending
  ``#### N``. Calculator annotations (``<<3*4=12>>``) are removed from the reasoning.
- ``math`` / ``math500``: Hendrycks MATH JSONL ``{problem, solution, answer, level, type}``.
- ``arith``: the synthetic multi-step arithmetic task of `scratchlm.align.task`
  (``arith`` or ``arith:D`` for difficulty D), generated, not read.
- a path to a JSONL file in either of the first two layouts.

Files live in ``<data_dir>/gsm8k/{train,test}.jsonl`` and ``<data_dir>/math/{train,test,
math500_test}.jsonl``; `default_data_dir` is the ``shared/data`` folder beside the repository.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scratchlm.errors import UserError

DATASETS = ("gsm8k", "math", "math500", "arith")
_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")


@dataclass
class MathExample:
    """One problem: the question, the answer a reward checks against, a worked solution."""

    question: str
    answer: str
    reasoning: str = ""  # worked solution without the final-answer marker ("" when none)
    meta: dict[str, Any] = field(default_factory=dict)


def default_data_dir() -> Path:
    """``shared/data`` beside the repository (or beside the working directory)."""
    for base in (Path(__file__).resolve().parents[3], Path.cwd()):
        candidate = base.parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return Path(__file__).resolve().parents[3].parent / "shared" / "data"


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file (blank lines skipped); a bad line is a UserError naming it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(2, "No such file or directory", str(p))
    rows = []
    with p.open("rb") as f:
        for n, raw in enumerate(f, 1):
            line = decode_line(raw, p, n)
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise UserError(f"{p}:{n}: not valid JSON ({exc.msg})") from None
    return rows


def decode_line(raw: bytes, path: Path, n: int) -> str:
    """Line `n` of a JSONL file as text; bytes that are not UTF-8 are a UserError naming the line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                        "convert the file to UTF-8") from None


def arith_difficulty(name: str, default: int) -> int:
    """The difficulty D of a dataset name ``arith`` or ``arith:D`` (a positive integer)."""
    if ":" not in name:
        return default
    text = name.split(":", 1)[1]
    try:
        difficulty = int(text)
    except ValueError:
        raise UserError(f"{name!r}: the difficulty after 'arith:' must be an integer") from None
    if difficulty < 1:
        raise UserError(f"{name!r}: the difficulty after 'arith:' must be at least 1, got {difficulty}")
    return difficulty


def gsm8k_example(row: dict[str, Any]) -> MathExample:
    """A GSM8K row {question, answer: "... #### N"} as a MathExample."""
    solution = row["answer"]
    if "####" not in solution:
        raise UserError("a GSM8K answer must end with '#### <number>'")
    reasoning, final = solution.rsplit("####", 1)
    if not final.strip():
        # An empty gold answer would grade every response as wrong, silently.
        raise UserError("a GSM8K answer must end with '#### <number>', not an empty '####'")
    reasoning = _CALCULATOR_RE.sub("", reasoning).strip()
    return MathExample(row["question"], final.strip().replace(",", ""), reasoning)


def math_example(row: dict[str, Any]) -> MathExample:
    """A MATH row {problem, solution, answer, level, type} as a MathExample."""
    from scratchlm.align.math_normalize import last_boxed

    answer = row.get("answer")
    answer = str(answer) if isinstance(answer, (int, float)) and not isinstance(answer, bool) else answer
    if answer is not None and not isinstance(answer, str):
        raise UserError(f"answer must be a string or a number, got {type(answer).__name__}")
    boxed = last_boxed(row["solution"])
    if not (answer or "").strip() and boxed is None:
        # An empty gold answer would grade every response as wrong, silently.
        raise UserError("a MATH row needs an answer: an 'answer' value or a \\boxed{...} answer in its solution")
    answer = answer or boxed or ""
    meta = {k: row[k] for k in ("level", "type", "unique_id") if k in row}
    return MathExample(row["problem"], answer, row["solution"].strip(), meta)


def examples_from_rows(rows: list[dict[str, Any]], where: str) -> list[MathExample]:
    """MathExamples from rows in the GSM8K or the MATH layout (detected from the keys)."""
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, dict) and "problem" in row and "solution" in row:
            keys, convert = ("problem", "solution"), math_example
        elif isinstance(row, dict) and "question" in row and "answer" in row:
            keys, convert = ("question", "answer"), gsm8k_example
        else:
            raise UserError(f"{where}: row {i} has neither question/answer nor problem/solution keys")
        wrong = next((k for k in keys if not isinstance(row[k], str)), None)
        if wrong is not None:
            raise UserError(f"{where}: row {i}: {wrong} must be a string, got {type(row[wrong]).__name__}")
        try:
            out.append(convert(row))
        except UserError as exc:
            raise UserError(f"{where}: row {i}: {exc}") from None
    return out


def is_file_dataset(dataset: str) -> bool:
    """Whether `load_examples` reads `dataset` as a JSONL file (which has no splits), not as a named dataset."""
    if dataset in DATASETS or dataset.startswith("arith:"):
        return False
    return dataset.endswith(".jsonl") or Path(dataset).is_file()


def load_examples(dataset: str, split: str = "test", *, data_dir: str | os.PathLike | None = None,
                  limit: int | None = None, seed: int = 0) -> list[MathExample]:
    """The examples of a named dataset's split, or of a JSONL file; the first `limit` of them."""
    if dataset == "arith" or dataset.startswith("arith:"):
        from scratchlm.align.task import ArithmeticTask

        if split not in ("train", "test"):
            raise UserError(f"{dataset} has a train and a test split, not {split!r}")
        return ArithmeticTask(difficulty=arith_difficulty(dataset, 2)).examples(limit or 1000, split=split, seed=seed)
    base = Path(data_dir) if data_dir is not None else default_data_dir()
    if dataset == "gsm8k":
        path = base / "gsm8k" / f"{split}.jsonl"
    elif dataset == "math":
        path = base / "math" / f"{split}.jsonl"
    elif dataset == "math500":
        if split != "test":
            raise UserError("math500 has only a test split")
        path = base / "math" / "math500_test.jsonl"
    elif is_file_dataset(dataset):
        path = Path(dataset)
    else:
        raise UserError(f"unknown dataset {dataset!r} (known: {', '.join(DATASETS)}, or a .jsonl path)")
    rows = read_jsonl(path)
    if limit is not None:
        rows = rows[:limit]
    return examples_from_rows(rows, str(path))
