"""Reading an episode's final answer: its text, its marked answer, its number.

Why it exists: the rule rewards (:mod:`agentrl.rollout.rewards`), the LLM judge
(:mod:`agentrl.rollout.model_rewards`), the evaluation report and users' own reward functions
all read the answer the same way, so they agree on what the model answered. Pure functions of
strings (and of a :class:`~agentrl.types.Trajectory`'s messages); nothing here scores.

- :func:`final_answer_text`: the content of the last assistant message;
- :func:`extract_answer`: the marked answer in it (the last ``\\boxed{...}``, else GSM8K's
  ``#### 42``);
- :func:`parse_number`: one number, exactly, as a :class:`~fractions.Fraction` (``1,234``,
  ``3/4``, ``\\frac{3}{4}``, ``50%``, ``$12``, ``1e3``);
- :func:`answer_number`: the number a text answers (the marked answer's, else the last one).

Example::

    >>> extract_answer("so the total is \\\\boxed{1,234}.")
    '1,234'
    >>> parse_number("1,234")
    Fraction(1234, 1)
"""

from __future__ import annotations

import re
from fractions import Fraction

from agentrl.types import Trajectory

__all__ = [
    "answer_number",
    "extract_answer",
    "final_answer_text",
    "last_boxed",
    "last_number",
    "parse_number",
]


def final_answer_text(traj: Trajectory) -> str:
    """The content of the last assistant message in ``traj.messages`` ("" if there is none).

    Content given as a list of OpenAI content parts is joined from its text parts.
    """
    for msg in reversed(traj.messages):
        if msg.get("role") != "assistant":
            continue
        content = msg.get("content")
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        return str(content)
    return ""


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        i = start + len("\\boxed{")
        depth = 1
        j = i
        while j < len(text) and depth:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
            j += 1
        if depth == 0:
            return text[i : j - 1]
        start = text.rfind("\\boxed{", 0, start)
    return None


def extract_answer(text: str) -> str | None:
    """The marked final answer in ``text``: the last ``\\boxed{...}``, else what follows the
    last GSM8K ``####`` marker (to the end of its line); None when neither is present."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else ""
    return None


# A number: thousands-grouped ("1,234,567") or plain digits, optional decimals and exponent.
_NUMBER_RE = re.compile(
    r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\w)|(?<![\w.])[-+−]?\.\d+"
)
_FRAC_RE = re.compile(r"^\\d?frac\{([^{}]+)\}\{([^{}]+)\}$")


def parse_number(text: str) -> Fraction | None:
    """Parse one number exactly: ``42``, ``-1,234.5``, ``$12``, ``50%``, ``3/4``,
    ``\\frac{3}{4}``, ``1e3``. Returns None when ``text`` is not a single number."""
    s = text.strip().strip("$").replace("\\!", "").replace("−", "-")
    s = s.removesuffix("\\%").removesuffix("%").strip().rstrip(".").strip()
    s = s.replace("\\$", "").lstrip("$").strip()
    frac = _FRAC_RE.match(s)
    if frac:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        return None if num is None or den is None or den == 0 else num / den
    if "/" in s:
        num_s, _, den_s = s.partition("/")
        num, den = parse_number(num_s), parse_number(den_s)
        return None if num is None or den is None or den == 0 else num / den
    if re.fullmatch(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+", s):
        try:
            return Fraction(s.replace(",", ""))
        except (ValueError, ZeroDivisionError):
            return None
    return None


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (read by :func:`parse_number`), or None."""
    matches = _NUMBER_RE.findall(text)
    return parse_number(matches[-1]) if matches else None


def answer_number(text: str) -> tuple[Fraction | None, str]:
    """``(value, how)``: the marked answer's number if there is a marked answer (its first
    number if it is not a bare number; ``how`` is ``"boxed"`` or ``"####"``), else the last
    number in the text (``"last_number"``)."""
    marked = extract_answer(text)
    if marked is not None:
        value = parse_number(marked)
        if value is None:
            found = _NUMBER_RE.findall(marked)
            value = parse_number(found[0]) if found else None
        return value, "boxed" if last_boxed(text) is not None else "####"
    return last_number(text), "last_number"
