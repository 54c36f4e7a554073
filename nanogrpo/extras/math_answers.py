"""Reading the final answer of a math solution and comparing two answers exactly.

Owns: `last_boxed`, `extract_answer` (boxed, then `####`, then the last
number), `parse_number` and `answers_match`: what the `accuracy` reward
(extras/builtin_rewards.py) checks.

Does not know about: completions, reward functions or torch: plain strings
in, a Fraction or a bool out.

Choices: answers are exact `fractions.Fraction`s, never floats and no
sympy: 2.50 == 5/2 == \\frac{5}{2} == "$2.5", and 0.1 + 0.2 style rounding
cannot make a right answer wrong.
"""

import re
from fractions import Fraction


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in text, nested braces allowed; None if there is none."""
    start = text.rfind("\\boxed")
    while start != -1:
        # the first non-space after \\boxed
        i = len(text) - len(text[start + len("\\boxed") :].lstrip(" "))
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j]
        start = text.rfind("\\boxed", 0, start)  # no brace or unbalanced: try an earlier one
    return None


_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer in a solution: last `\\boxed{}`, else what follows `####`, else the last
    number."""
    if (boxed := last_boxed(text)) is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    return (_NUMBER.findall(text) or [None])[-1]


def parse_number(s: str) -> Fraction | None:
    """An answer string as an exact Fraction, or None if it is not a plain number. Understands
    "-1,234.50", "$5", "50%", "3/4", "\\frac{3}{4}", "\\dfrac34", "x = 7", "5 \\text{cm}"."""
    s = re.sub(r"\\(?:text|mathrm|mbox)\{[^{}]*\}", "", str(s))
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\ ", "\\$", "$", "{,}", "\\%", "%"):
        s = s.replace(junk, "")
    s = s.replace("\u2212", "-").rsplit("=", 1)[-1].replace(" ", "").rstrip(".").lstrip("+")
    if m := re.fullmatch(r"(-?)\\[dt]?frac(?:\{([^{}]+)\}\{([^{}]+)\}|(\d)(\d))", s):
        num = parse_number(m[2] or m[4])
        den = parse_number(m[3] or m[5])
        if num is None or not den:
            return None
        return -num / den if m[1] else num / den
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    if m := re.fullmatch(r"(-?(?:\d+\.?\d*|\.\d+))/(-?(?:\d+\.?\d*|\.\d+))", s):
        den = Fraction(m[2])
        return Fraction(m[1]) / den if den else None
    if re.fullmatch(r"-?(?:\d+\.?\d*|\.\d+)", s):
        return Fraction(s)
    return None


def answers_match(predicted: str, gold: str) -> bool:
    """Numeric equivalence when both parse as numbers, else whitespace- and `$`-insensitive
    equality."""
    p = parse_number(predicted)
    g = parse_number(gold)
    if p is not None and g is not None:
        return p == g
    predicted = re.sub(r"\s+|\$", "", str(predicted))
    gold = re.sub(r"\s+|\$", "", str(gold))
    return predicted != "" and predicted == gold
