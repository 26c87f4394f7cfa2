"""Prompt templates for reasoning tasks, and where a response stops.

Two formats:

- ``r1_zero``: the DeepSeek-R1-Zero conversation. The prompt ends inside an open ``<think>``,
  so the model writes its reasoning, closes it, and gives the answer between ``<answer>``
  tags; generation stops at ``</answer>``. A worked solution becomes the SFT target
  ``" {reasoning} </think> <answer> {answer} </answer>"``.
- ``question_only``: the question followed by ``Answer:``; the response is free text whose
  final answer follows ``####`` (GSM8K's convention) or sits in a ``\\boxed{}``. Generation
  stops at a blank line.

A template only formats strings; rewards.py says what a correct response looks like.
"""

from __future__ import annotations

from dataclasses import dataclass

from scratchlm.errors import UserError

R1_ZERO_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process is enclosed within <think> "
    "</think> and answer is enclosed within <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {question}\n"
    "Assistant: <think>"
)
QUESTION_ONLY_PROMPT = "{question}\nAnswer:"
ANSWER_CLOSE = "</answer>"


@dataclass(frozen=True)
class PromptTemplate:
    """A named prompt format: how a question is asked, how a solution is written, where it stops."""

    name: str
    prompt: str  # with a {question} field
    stop: tuple[str, ...]  # the response ends after the first of these (included)

    def format(self, question: str) -> str:
        """The prompt for one question."""
        return self.prompt.replace("{question}", question.strip())

    def response(self, reasoning: str, answer: str) -> str:
        """The target response for a worked solution: what SFT trains the model to write."""
        reasoning, answer = reasoning.strip(), answer.strip()
        if self.name == "r1_zero":
            return f" {reasoning} </think> <answer> {answer} </answer>"
        return f" {reasoning}\n#### {answer}" if reasoning else f" {answer}"


TEMPLATES: dict[str, PromptTemplate] = {
    "r1_zero": PromptTemplate("r1_zero", R1_ZERO_PROMPT, stop=(ANSWER_CLOSE,)),
    "question_only": PromptTemplate("question_only", QUESTION_ONLY_PROMPT, stop=("\n\n",)),
}


def get_template(name: str) -> PromptTemplate:
    """The template called `name` (``r1_zero`` or ``question_only``)."""
    try:
        return TEMPLATES[name]
    except KeyError:
        raise UserError(f"unknown prompt template {name!r} (known: {', '.join(TEMPLATES)})") from None


def truncate_at_stop(text: str, stop: tuple[str, ...] | list[str]) -> tuple[str, bool]:
    """Cut `text` just after the earliest stop string; returns (text, whether one was found).

    >>> truncate_at_stop(" 7 </think> <answer> 7 </answer> junk", ("</answer>",))
    (' 7 </think> <answer> 7 </answer>', True)
    """
    cut = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (cut is None or i + len(s) < cut):
            cut = i + len(s)
    return (text, False) if cut is None else (text[:cut], True)
