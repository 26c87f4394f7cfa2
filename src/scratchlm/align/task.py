"""A synthetic verifiable task: multi-step arithmetic word problems with a difficulty knob.

A problem starts from a number and applies `difficulty` operations (add, subtract, multiply),
phrased in words::

    Q: Start with 3. Add 4, then multiply by 2. What is the result?
    reasoning: 3+4=7, 7*2=14        answer: 14

Every intermediate value stays in [0, max_value], so the answer is a small non-negative
integer and the worked solution is a chain of one-operation equations, the R1 form
``<think> 3+4=7, 7*2=14 </think> <answer> 14 </answer>``. Difficulty is the number of
operations; `max_operand` bounds each operand.

Splits are disjoint by construction: a question belongs to the held-out split when a hash
of its text falls in the held-out fraction, whatever seed generated it, so no held-out
question can appear in training data.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from scratchlm.align.datasets import MathExample
from scratchlm.errors import UserError

_OPS = {
    "add": ("+", ("add {x}", "plus {x}", "increase it by {x}")),
    "sub": ("-", ("subtract {x}", "take away {x}", "decrease it by {x}")),
    "mul": ("*", ("multiply by {x}", "times {x}")),
}


def _heldout(question: str, fraction: float) -> bool:
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass(frozen=True)
class ArithmeticTask:
    """Generator of arithmetic chains; `difficulty` = number of operations per problem."""

    difficulty: int = 2
    max_operand: int = 9
    max_value: int = 99
    heldout_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.difficulty < 1:
            raise ValueError(f"difficulty must be >= 1, got {self.difficulty}")
        if self.max_operand < 2 or self.max_value < self.max_operand:
            raise ValueError("need 2 <= max_operand <= max_value")

    def sample(self, rng: random.Random) -> MathExample:
        """One problem drawn with `rng`."""
        value = first = rng.randint(1, self.max_operand)
        steps, phrases = [], []
        for _ in range(self.difficulty):
            op = rng.choice(["add", "sub", "mul"])
            if op == "mul" and value * 2 > self.max_value:
                op = rng.choice(["add", "sub"])
            if op == "add" and value + 1 > self.max_value:
                op = "sub"
            if op == "sub" and value == 0:
                op = "add"
            if op == "add":
                x = rng.randint(1, min(self.max_operand, self.max_value - value))
                new = value + x
            elif op == "sub":
                x = rng.randint(1, min(self.max_operand, value))
                new = value - x
            else:
                x = rng.randint(2, min(self.max_operand, self.max_value // max(value, 1)))
                new = value * x
            symbol, words = _OPS[op]
            steps.append(f"{value}{symbol}{x}={new}")
            phrases.append(rng.choice(words).format(x=x))
            value = new
        question = f"Start with {first}. {phrases[0][0].upper()}{phrases[0][1:]}"
        question += "".join(f", then {p}" for p in phrases[1:]) + ". What is the result?"
        return MathExample(question, str(value), ", ".join(steps), {"difficulty": self.difficulty})

    def examples(self, n: int, *, split: str = "train", seed: int = 0) -> list[MathExample]:
        """`n` distinct problems of one split ("train" or "test"), reproducible from `seed`."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rng = random.Random(f"{seed}-{split}-{self.difficulty}-{self.max_operand}-{self.max_value}")
        want_heldout = split == "test"
        seen: set[str] = set()
        out: list[MathExample] = []
        misses = 0  # draws since the last new problem: many in a row, and the split is exhausted
        while len(out) < n:
            if misses > 200 * len(out) + 10_000:
                # arith:1 holds a few hundred problems, fewer than the 1000 drawn when no limit is set
                # (counted from the last new problem, not from n: a limit of 10**9 is refused as fast)
                raise UserError(f"arith:{self.difficulty} has only {len(out)} distinct {split} problems, fewer than "
                                f"the {n} asked for; set a limit of at most {len(out)}")
            ex = self.sample(rng)
            if ex.question in seen or _heldout(ex.question, self.heldout_fraction) != want_heldout:
                misses += 1
                continue
            misses = 0
            seen.add(ex.question)
            out.append(ex)
        return out


def arithmetic_reward(response: str, ground_truth: str) -> dict[str, float]:
    """The task's reward: an r1_zero-formatted response whose answer is the integer `ground_truth`.

    Stricter than the general math grader: the answer must be a bare integer (no units, no
    fractions), since that is what every worked solution of the task writes.
    """
    from scratchlm.align.rewards import extract_r1_answer

    answer = extract_r1_answer(response)
    if answer is None:
        return {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}
    try:
        correct = int(answer) == int(ground_truth)
    except ValueError:
        correct = False
    value = 1.0 if correct else 0.0
    return {"format_reward": 1.0, "answer_reward": value, "reward": value}
