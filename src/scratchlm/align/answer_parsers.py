"""Pulling a final answer out of free text: the last number (GSM8K) or a choice letter (MMLU).

Both parsers return the answer as a short canonical string, or None when the text holds no
answer of that kind, so a reward can tell "unformatted" (None) from "wrong".

Numbers (`parse_last_number`, `parse_gsm8k_answer`). A number is an optional minus sign and
dollar sign, digits with optional well-formed thousands groups (``1,234``), and an optional
decimal part. Commas and ``$`` are dropped, the sign and the decimal digits are kept as
written (``"$1,234.50" -> "1234.50"``, ``"-$5" -> "-5"``); a period that ends the sentence is
not a decimal point (``"It is 42." -> "42"``). A minus sign right after a digit, letter or
closing bracket is subtraction, not a sign (``"10-3"`` holds 10 and 3). Digits glued to a
word (``"COVID19"``) are not a number. A GSM8K-style ``#### 42`` marks the final answer
explicitly: `parse_gsm8k_answer` takes the first number after the last ``####`` and falls
back to the last number of the text. Fractions are not read as one value (``1/2`` ends with
the number 2).

>>> parse_last_number("She pays $1,234.50 in total.")
'1234.50'
>>> parse_gsm8k_answer("48/2 = <<48/2=24>>24 clips\\n#### 72\\nThat is all for 3 days.")
'72'

Choices (`parse_multiple_choice`). The last "answer is X" / "answer: X" phrase wins (``The
correct answer is (B).``, ``Answer: c``, ``the answer is **D**``); without one, a response
that is only a letter (``B``, ``(b)``, ``C.``), or whose last ``\\boxed{}`` holds only one,
is that letter. Letters come back upper-case; one outside `choices` gives None. A lower-case
letter in a phrase must stand alone (bracketed, or followed by punctuation or the end), so
that the article in "the answer is a number" is not read as choice A.

>>> parse_multiple_choice("Paris is in France, so the correct answer is (c).")
'C'
>>> parse_multiple_choice("I am not sure.") is None
True
"""

from __future__ import annotations

import re

from scratchlm.align.math_normalize import last_boxed

_NUMBER_RE = re.compile(
    r"""
    (?<![\w.)\]])                          # not inside a word or a longer number, not after a bracket
    (?P<sign>-)?\$?(?P<sign_after>-)?      # "-5", "-$5", "$-5"
    (?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)  # "1,234" (well-formed groups only) or "1234"
    (?P<frac>\.\d+)?                       # a decimal point needs a digit after it
    """,
    re.VERBOSE,
)

_CHOICE_PHRASE_RE = re.compile(
    r"""
    \banswer\b\s*(?:is\b|:)?\s*(?:option|choice)?\s*:?\s*
    [*_]*\s*(?P<open>[(\[])?\s*
    (?P<letter>[A-Za-z])
    \s*(?P<close>[)\]])?[*_]*
    (?P<after>\s*[.,;:!?]|\s*$|\s)?
    (?![A-Za-z0-9])
    """,
    re.IGNORECASE | re.VERBOSE,
)
_BARE_CHOICE_RE = re.compile(r"^\s*[*_]*\s*[(\[]?\s*([A-Za-z])\s*[)\]]?\s*[*_]*\s*[.,;:!?]?\s*$")


def _numbers(text: str) -> list[str]:
    out = []
    for m in _NUMBER_RE.finditer(text):
        sign = "-" if m["sign"] or m["sign_after"] else ""
        out.append(sign + m["int"].replace(",", "") + (m["frac"] or ""))
    return out


def parse_last_number(text: str) -> str | None:
    """The last number in `text` without commas or ``$``, else None.

    >>> parse_last_number("Down 3 degrees, it is -12.5 now."), parse_last_number("no digits")
    ('-12.5', None)
    """
    numbers = _numbers(text)
    return numbers[-1] if numbers else None


def parse_gsm8k_answer(text: str) -> str | None:
    """The first number after the last ``####``, else the last number of `text`, else None.

    >>> parse_gsm8k_answer("#### 1,072"), parse_gsm8k_answer("so 5 + 7 = 12")
    ('1072', '12')
    """
    if "####" in text:
        after = _numbers(text.rsplit("####", 1)[1])
        if after:
            return after[0]
    return parse_last_number(text)


def parse_multiple_choice(text: str, choices: str = "ABCD") -> str | None:
    """The chosen letter (upper-case, one of `choices`), else None (see the module docstring).

    >>> parse_multiple_choice("The correct answer is B"), parse_multiple_choice("Answer: (e)")
    ('B', None)
    """
    allowed = choices.upper()
    for m in reversed(list(_CHOICE_PHRASE_RE.finditer(text))):
        letter = m["letter"]
        standalone = m["open"] or m["close"] or (m["after"] is not None and m["after"].strip() != "")
        standalone = standalone or m.end() == len(text.rstrip())
        if letter.islower() and not standalone:
            continue  # "the answer is a number": an article, not choice A
        return letter.upper() if letter.upper() in allowed else None
    boxed = last_boxed(text)
    m = _BARE_CHOICE_RE.match(boxed if boxed is not None else text)
    if m and m[1].upper() in allowed:
        return m[1].upper()
    return None
