"""Verifiable rewards: does a response follow the format, and is its final answer right?

Every reward function takes ``(response, ground_truth)`` and returns
``{"format_reward", "answer_reward", "reward"}``, each 0.0 or 1.0. ``ground_truth`` is a string
or a list of acceptable strings. The answer only counts when the format is right, so text that
merely mentions the right number somewhere never earns a reward; ``reward`` is their product.

``r1_zero`` format (the response continues a prompt ending in ``<think>``): reasoning, exactly
one ``</think>``, then exactly one non-empty ``<answer> ... </answer>`` block and nothing after
it. Refused: a missing ``</think>``, an answer outside the tags, several answer blocks, an
empty answer, tags out of order, text after ``</answer>``. Inside the tags a ``\\boxed{}`` is
unwrapped. A list of candidates (``<answer> 12, 13, 14 </answer>``) is one answer that equals
none of them (see math_normalize).

``question_only`` format: the final answer follows the last ``####`` or sits in the last
``\\boxed{}``; a response with neither is unformatted.

Free-text rewards read the answer with answer_parsers: ``gsm8k_last_number`` (the number after
``####``, else the last number) and ``multiple_choice`` (a letter A-D).

The rewards are chosen by name from the registry in reward_registry.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scratchlm.align.answer_parsers import parse_gsm8k_answer, parse_multiple_choice
from scratchlm.align.math_normalize import answers_match, last_boxed

RewardFn = Callable[[str, "str | Sequence[str]"], dict[str, float]]

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K worked solution: the text after ``####``, without commas.

    >>> gsm8k_answer("3 + 4 = <<3+4=7>>7\\n#### 1,007")
    '1007'
    """
    if "####" not in solution:
        raise ValueError("a GSM8K solution ends with '#### <answer>'")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _grade(answer: str, ground_truth: str | Sequence[str]) -> bool:
    truths = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
    return any(answers_match(answer, str(t)) for t in truths)


def _result(formatted: bool, correct: bool) -> dict[str, float]:
    fmt = 1.0 if formatted else 0.0
    ans = 1.0 if formatted and correct else 0.0
    return {"format_reward": fmt, "answer_reward": ans, "reward": fmt * ans}


def extract_r1_answer(response: str) -> str | None:
    """The answer of a well-formatted r1_zero response, else None (see the module docstring)."""
    counts = {tag: response.count(tag) for tag in (_THINK_OPEN, _THINK_CLOSE, _ANSWER_OPEN, _ANSWER_CLOSE)}
    if counts[_THINK_CLOSE] != 1 or counts[_ANSWER_OPEN] != 1 or counts[_ANSWER_CLOSE] != 1:
        return None
    if counts[_THINK_OPEN] > 1:
        return None
    think_close = response.index(_THINK_CLOSE)
    if counts[_THINK_OPEN] == 1 and response.index(_THINK_OPEN) > think_close:
        return None
    after = response[think_close + len(_THINK_CLOSE):]
    if _ANSWER_OPEN not in after:  # the answer block sits inside the reasoning
        return None
    between, rest = after.split(_ANSWER_OPEN, 1)
    if between.strip():  # text between </think> and <answer>
        return None
    if _ANSWER_CLOSE not in rest:
        return None
    answer, tail = rest.split(_ANSWER_CLOSE, 1)
    if tail.strip() or not answer.strip():
        return None
    boxed = last_boxed(answer)
    answer = boxed if boxed is not None else answer
    return answer.strip() or None


def r1_zero_reward(response: str, ground_truth: str | Sequence[str]) -> dict[str, float]:
    """Reward of a response to an r1_zero prompt."""
    answer = extract_r1_answer(response)
    if answer is None:
        return _result(False, False)
    return _result(True, _grade(answer, ground_truth))


def extract_question_only_answer(response: str) -> str | None:
    """The final answer of a question_only response: after the last ``####``, else the last box."""
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip()
        line = tail.splitlines()[0].strip() if tail else ""
        return line or None
    boxed = last_boxed(response)
    return boxed.strip() if boxed and boxed.strip() else None


def question_only_reward(response: str, ground_truth: str | Sequence[str]) -> dict[str, float]:
    """Reward of a response to a question_only prompt."""
    answer = extract_question_only_answer(response)
    if answer is None:
        return _result(False, False)
    return _result(True, _grade(answer, ground_truth))


def gsm8k_last_number_reward(response: str, ground_truth: str | Sequence[str]) -> dict[str, float]:
    """Reward of a free-text response graded by its final number (``#### N``, else the last number).

    Any response holding a number is formatted; see answer_parsers.parse_gsm8k_answer.
    """
    answer = parse_gsm8k_answer(response)
    if answer is None:
        return _result(False, False)
    return _result(True, _grade(answer, ground_truth))


def multiple_choice_reward(response: str, ground_truth: str | Sequence[str]) -> dict[str, float]:
    """Reward of an answer to a lettered question (A-D); `ground_truth` is the right letter.

    The letter is read from the ``<answer>`` block of a well-formed r1_zero response, else from
    the whole response ("The correct answer is (B)."); see answer_parsers.parse_multiple_choice.
    """
    inner = extract_r1_answer(response)
    choice = parse_multiple_choice(inner if inner is not None else response)
    if choice is None:
        return _result(False, False)
    truths = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
    return _result(True, any(choice == (parse_multiple_choice(str(t)) or str(t).strip().upper()) for t in truths))


def get_reward_fn(name: str | RewardFn) -> RewardFn:
    """The registered reward called `name` (see reward_registry; kept here for existing imports)."""
    from scratchlm.align import reward_registry

    return reward_registry.get_reward_fn(name)


def __getattr__(name: str):
    if name == "REWARDS":  # the registry lives in reward_registry, which imports this module
        from scratchlm.align import reward_registry

        return reward_registry.REWARDS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
