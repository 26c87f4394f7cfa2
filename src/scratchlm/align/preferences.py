"""Preference pairs for DPO: a prompt, a preferred ("chosen") and a dispreferred ("rejected") response.

Two sources:

- a JSONL file, one object per line with string values under ``prompt``, ``chosen`` and
  ``rejected``. The prompt is used verbatim (no template is applied) and each response is the
  text that follows it, so ``prompt + chosen`` is the whole preferred sequence. Blank lines are
  skipped; a line that is not JSON, not an object, misses a key, holds a non-string value or
  the same text as chosen and rejected is a one-line `UserError` naming the file and the line
  number.
- ``arith`` or ``arith:D``: synthetic pairs from the arithmetic task (`scratchlm.align.task`)
  in a prompt template: chosen is the worked solution, rejected the same reasoning with a
  wrong final answer, so the preference is between a consistent and an inconsistent answer.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from scratchlm.errors import UserError

KEYS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """A prompt and two responses to it, the first preferred."""

    prompt: str
    chosen: str
    rejected: str


def read_preference_pairs(path: str | os.PathLike) -> list[PreferencePair]:
    """The pairs of a JSONL file of ``{"prompt", "chosen", "rejected"}`` objects (see the module)."""
    p = Path(path)
    if not p.is_file():
        problem = "is a directory, not a file" if p.is_dir() else "not found"
        raise UserError(f"preference file {p} {problem} (expected JSONL with prompt, chosen, rejected on each line)")
    pairs = []
    from scratchlm.align.datasets import decode_line

    with p.open("rb") as f:
        for n, raw in enumerate(f, 1):
            line = decode_line(raw, p, n)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{p}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{p}:{n}: expected a JSON object with keys prompt, chosen, rejected, "
                                f"got {type(row).__name__}")
            missing = [k for k in KEYS if k not in row]
            if missing:
                raise UserError(f"{p}:{n}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                                f"(each line needs prompt, chosen, rejected)")
            wrong = next((k for k in KEYS if not isinstance(row[k], str)), None)
            if wrong is not None:
                raise UserError(f"{p}:{n}: {wrong} must be a string, got {type(row[wrong]).__name__}")
            if row["chosen"] == row["rejected"]:
                raise UserError(f"{p}:{n}: chosen and rejected are the same response, which gives DPO nothing "
                                "to prefer; remove the pair or fix one of them")
            pairs.append(PreferencePair(row["prompt"], row["chosen"], row["rejected"]))
    if not pairs:
        raise UserError(f"{p} holds no preference pairs (expected JSONL with prompt, chosen, rejected on each line)")
    return pairs


def arithmetic_preference_pairs(n: int, *, difficulty: int = 1, split: str = "train", seed: int = 0,
                                template: str = "r1_zero") -> list[PreferencePair]:
    """`n` synthetic pairs: the worked solution of an arithmetic problem over one with a wrong answer."""
    from scratchlm.align.prompts import get_template
    from scratchlm.align.task import ArithmeticTask

    fmt = get_template(template)
    rng = random.Random(f"dpo-{seed}-{split}")
    pairs = []
    for ex in ArithmeticTask(difficulty=difficulty).examples(n, split=split, seed=seed):
        wrong = int(ex.answer) + rng.choice([-3, -2, -1, 1, 2, 3])
        pairs.append(PreferencePair(fmt.format(ex.question), fmt.response(ex.reasoning, ex.answer),
                                    fmt.response(ex.reasoning, str(wrong))))
    return pairs


def load_preference_pairs(source: str, *, split: str = "train", limit: int | None = None, seed: int = 0,
                          template: str = "r1_zero") -> list[PreferencePair]:
    """Pairs from a JSONL path or ``arith[:D]`` (`split` and `template` apply to the latter); the first `limit`."""
    if source == "arith" or source.startswith("arith:"):
        from scratchlm.align.datasets import arith_difficulty

        return arithmetic_preference_pairs(limit or 1000, difficulty=arith_difficulty(source, 1), split=split, seed=seed,
                                           template=template)
    pairs = read_preference_pairs(source)
    return pairs[:limit] if limit else pairs


def hold_out(pairs: list[PreferencePair], fraction: float, seed: int = 0) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(training, held-out) pairs: a seeded random `fraction` of them held out, at least one when
    `fraction` > 0 and two or more pairs; both keep the file's order."""
    n = len(pairs)
    k = min(max(round(n * fraction), 1), n - 1) if fraction > 0 and n > 1 else 0
    held = set(random.Random(seed).sample(range(n), k))
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]
