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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


REWARDS: dict[str, RewardFn] = {"r1_zero": r1_zero_reward, "question_only": question_only_reward}


def get_reward_fn(template_name: str) -> RewardFn:
    """The reward function that matches a prompt template."""
    return REWARDS[template_name]

