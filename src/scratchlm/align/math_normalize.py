"""Normalising and comparing final answers to math problems (GSM8K and MATH).

Answers arrive in many spellings of one value: ``$1,000.``, ``1000 dollars``, ``\\boxed{1000}``;
``\\frac12``, ``\\dfrac{1}{2}``, ``1/2``, ``0.5``; ``90^\\circ``; ``x = 3``; ``\\text{5 cm}``.
`normalize_answer` maps a string to a canonical form by removing presentation (LaTeX spacing,
``\\left``/``\\right``, ``\\text{}`` wrappers, dollar signs, degree marks, trailing units and
periods, a leading ``x =``) and canonicalising fraction and square-root syntax; `answers_match`
compares two answers as canonical strings and, when both are plain numbers, by value.

Grading is deliberately strict about content: a comma is only dropped inside a well-formed
thousands group (``1,234``), never between numbers (``1,4`` stays two numbers), so an answer
that lists several candidates never equals one of them.

>>> normalize_answer("\\\\dfrac{1}{2}"), normalize_answer("$1,000.")
('\\\\frac{1}{2}', '1000')
>>> answers_match("0.5", "\\\\frac12"), answers_match("1, 2, 14", "14")
(True, False)
"""

from __future__ import annotations

import math
import re

# Spacing and sizing commands that change nothing about the value.
_NOISE = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\quad", r"\qquad", r"\displaystyle",
          r"\bigl", r"\bigr", r"\Bigl", r"\Bigr", r"\big", r"\Big")
_TEXT_COMMANDS = ("text", "textbf", "textit", "mathrm", "mathbf", "mbox", "textnormal", "operatorname")
_THOUSANDS_RE = re.compile(r"(?<![\d.])(\d{1,3})((?:,\d{3})+)(?![\d,])")
_NUMBER_RE = r"[-+]?(?:\d+\.?\d*|\.\d+)"
# A number followed by words only (units, "dollars", "cm"): keep the number.
_NUMBER_THEN_WORDS_RE = re.compile(rf"^({_NUMBER_RE})\s*(?:[a-zA-Z]+\.?\s*)+$")
_LEADING_VARIABLE_RE = re.compile(r"^\\?[a-zA-Z]+(?:_\{?[a-zA-Z0-9]+\}?)?\s*=\s*")


def find_braced(text: str, start: int) -> tuple[str, int] | None:
    """The balanced ``{...}`` group opening at ``text[start]``: (inner text, index after it).

    >>> find_braced("{a{b}c}d", 0)
    ('a{b}c', 7)
    """
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in text, else None.

    >>> last_boxed("so \\\\boxed{\\\\frac{1}{2}} and \\\\boxed{x^{2}}")
    'x^{2}'
    """
    best: str | None = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        end = match.end()
        if text.startswith("{", end):
            group = find_braced(text, end)
            if group is not None:
                best = group[0]
        else:
            word = re.match(r"[^\s$]+", text[end:])
            if word:
                best = word.group(0)
    return best


def _read_argument(text: str, start: int) -> tuple[str, int] | None:
    """A LaTeX macro argument at ``text[start]``: a braced group or a single character."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start >= len(text):
        return None
    if text[start] == "{":
        return find_braced(text, start)
    if text[start] == "\\":
        command = re.match(r"\\[a-zA-Z]+", text[start:])
        if command:
            return command.group(0), start + command.end()
    return text[start], start + 1


def canonical_macros(text: str) -> str:
    r"""Write ``\frac``/``\sqrt`` with braced arguments: ``\frac12`` -> ``\frac{1}{2}``, ``\sqrt3`` -> ``\sqrt{3}``."""
    out: list[str] = []
    i = 0
    while i < len(text):
        match = re.match(r"\\(frac|sqrt)(?![a-zA-Z])", text[i:])
        if not match:
            out.append(text[i])
            i += 1
            continue
        name = match.group(1)
        j = i + match.end()
        if name == "sqrt" and j < len(text) and text[j] == "[":  # \sqrt[3]{x}: keep the index
            close = text.find("]", j)
            if close < 0:
                out.append(text[i:])
                break
            out.append(f"\\sqrt{text[j:close + 1]}")
            j = close + 1
        else:
            out.append(f"\\{name}")
        for _ in range(2 if name == "frac" else 1):
            arg = _read_argument(text, j)
            if arg is None:
                break
            out.append("{" + canonical_macros(arg[0]) + "}")
            j = arg[1]
        i = j
    return "".join(out)


def _unwrap_text_commands(text: str) -> str:
    """``\\text{ cm}`` -> `` cm`` for every text-like command, innermost content kept."""
    pattern = re.compile(r"\\(?:" + "|".join(_TEXT_COMMANDS) + r")\s*(?=\{)")
    while True:
        match = pattern.search(text)
        if match is None:
            return text
        group = find_braced(text, match.end())
        if group is None:
            return text[:match.start()] + text[match.end():]
        text = text[:match.start()] + group[0] + text[group[1]:]


def normalize_answer(answer: str) -> str:
    """A canonical string for a final answer (see the module docstring for what is removed)."""
    s = answer.strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.replace("\n", " ").replace("\\$", "").replace("$", "")
    for noise in _NOISE:
        s = s.replace(noise, "")
    s = _unwrap_text_commands(s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    # Degrees and percent signs are presentation, the number is the answer.
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("{,}", ",")
    s = s.replace("\\le ", "\\leq ").replace("\\ge ", "\\geq ")
    s = s.strip().rstrip(".").strip()
    if s.count("=") == 1:
        s = _LEADING_VARIABLE_RE.sub("", s)
    s = _THOUSANDS_RE.sub(lambda m: m.group(1) + m.group(2).replace(",", ""), s)
    unit = _NUMBER_THEN_WORDS_RE.match(s)
    if unit:
        s = unit.group(1)
    s = re.sub(r"\\?degrees?$", "", s).strip()
    s = canonical_macros(s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if re.fullmatch(r"\{[^{}]*\}", s):  # a value wrapped in one group of braces
        s = s[1:-1]
    number = parse_number(s)
    if number is not None and number == int(number) and abs(number) < 1e15 and not re.search(r"[eE/\\]", s):
        s = str(int(number))  # 5.0, 05, +5 -> 5; fractions keep their spelling
    return s


def parse_number(s: str) -> float | None:
    r"""The value of a plain number, ``a/b`` or ``\frac{a}{b}`` (optionally negative), else None.

    >>> parse_number("-\\frac{3}{4}"), parse_number("2/5"), parse_number("x+1")
    (-0.75, 0.4, None)
    """
    s = s.strip()
    sign = 1.0
    if s.startswith("-"):
        sign, s = -1.0, s[1:]
    elif s.startswith("+"):
        s = s[1:]
    frac = re.fullmatch(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if frac:
        top, bottom = parse_number(frac.group(1)), parse_number(frac.group(2))
        if top is None or bottom is None or bottom == 0:
            return None
        return sign * top / bottom
    slash = re.fullmatch(rf"({_NUMBER_RE})/({_NUMBER_RE})", s)
    if slash:
        top, bottom = float(slash.group(1)), float(slash.group(2))
        return None if bottom == 0 else sign * top / bottom
    if re.fullmatch(_NUMBER_RE, s):
        value = float(s)
        return sign * value if math.isfinite(value) else None
    return None


def answers_match(prediction: str, truth: str, *, rel_tol: float = 1e-6) -> bool:
    """True when two answers are the same after normalisation, or the same number."""
    pred, gold = normalize_answer(prediction), normalize_answer(truth)
    if not pred or not gold:
        return False
    if pred == gold:
        return True
    a, b = parse_number(pred), parse_number(gold)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)
    return False

