"""GSM8K answer extraction and a 0/1 reward (the ``####`` convention).

Source of the format: GSM8K (openai/grade-school-math, ``grade_school_math/
dataset.py``): every gold solution ends with a line ``#### <number>``.  Model
completions are less tidy, so :func:`extract_answer` tries, in order:

1. the text after the **last** ``####`` (its first number; the rest of that
   line if it holds no number, e.g. ``#### \\frac{1}{2}``);
2. the content of the **last** ``\\boxed{...}`` (braces balanced);
3. the **last** number in the text.

:func:`parse_number` turns an answer string into a float: it strips spaces, ``$``
(also LaTeX ``\\$``), a trailing ``%`` / ``\\%`` and a trailing ``.``, and
accepts thousands separators only in groups of three (``1,000`` yes, ``1,0``
no).  It does not evaluate fractions or expressions.

:func:`gsm8k_reward` compares numerically (``abs(pred - gold) < 1e-6``, so
``18.0`` equals ``18``) when both sides parse; otherwise it falls back to
``math_verify`` (HuggingFace Math-Verify, imported lazily: about 0.7 s) for
symbolic answers such as ``\\frac{1}{2}``.

This module imports only the standard library; it runs in reward worker
processes.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ._math_verify import answers_equal, gold_text

__all__ = ["extract_answer", "gsm8k_reward", "parse_number"]

#: A number as written in text: optional sign and ``$``, digits with optional
#: thousands groups, optional decimals; or a bare decimal like ``.5``.
_NUMBER = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\$?\.\d+")
_PLAIN = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")
_BOXED = "\\boxed{"
_TOLERANCE = 1e-6


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, else None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth = 1
        pos = start + len(_BOXED)
        for index in range(pos, len(text)):
            char = text[index]
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    return text[pos:index].strip()
        start = text.rfind(_BOXED, 0, start)  # unbalanced: try an earlier one
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in ``text`` as a string, or None if there is none.

    Rules (first that applies): number after the last ``####``; content of the
    last ``\\boxed{}``; last number in the text.  The string is returned as
    written (``"$1,000"``); :func:`parse_number` normalises it.
    """
    marker = text.rfind("####")
    if marker != -1:
        rest = text[marker + 4 :].strip()
        line = rest.splitlines()[0].strip() if rest else ""
        match = _NUMBER.search(line)
        if match:
            return match.group(0)
        if line:
            return line
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(s: str) -> float | None:
    """``s`` as a finite float, or None if it is not a plain number.

    Handles ``"1,000"``, ``"$18"``, ``"\\$18"``, ``"18.0"``, ``"18."``, ``"50%"``,
    ``"-3"``, ``".5"``; rejects ``"1/2"``, ``"nan"``, ``"inf"``, ``"1,0"``.
    """
    text = s.strip().replace("\\$", "$").replace("\\%", "%").replace("{,}", ",")
    text = text.replace("$", "").replace(" ", "")
    text = text.removesuffix("%").removesuffix(".")
    if not _PLAIN.fullmatch(text):
        return None
    value = float(text.replace(",", ""))
    return value if math.isfinite(value) else None


def gsm8k_reward(
    prompt: Any,
    completions: str,
    prompt_ids: Any,
    completion_ids: Any,
    answer: str,
    **data: Any,
) -> float:
    """1.0 if the completion's final answer equals the GSM8K gold answer, else 0.0.

    Args:
        completions: the generated text (AReaL's name; one completion).
        answer: the dataset's gold solution (number after ``####``; if there is
            no ``####``, the whole string is the gold answer).
        prompt, prompt_ids, completion_ids, data: unused (AReaL's signature).
    """
    pred = extract_answer(str(completions))
    gold = gold_text(str(answer))
    if pred is None or not gold:
        return 0.0
    pred_value, gold_value = parse_number(pred), parse_number(gold)
    if pred_value is not None and gold_value is not None:
        return 1.0 if abs(pred_value - gold_value) < _TOLERANCE else 0.0
    return 1.0 if answers_equal(gold, pred) else 0.0  # imports math_verify (slow): only when needed
