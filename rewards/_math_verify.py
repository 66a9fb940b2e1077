"""Math-Verify helpers shared by :mod:`rewards.math` and :mod:`rewards.gsm8k` (a leaf).

* :func:`gold_text`: a gold answer's text: the first line after the last ``####``
  (GSM8K's convention), else the whole string, stripped.
* :func:`answers_equal`: HuggingFace ``math-verify`` equivalence of a gold
  answer and a prediction (``parse`` + ``verify``: sympy, so ``\\frac{1}{2}`` =
  ``0.5``), False when either side cannot be parsed.

math-verify is imported on first use (about 0.7 s), so importing this module
stays cheap (it imports only the standard library).  Its own time limits use
``SIGALRM`` and so work only in a process's main thread (they are on in reward
workers, off elsewhere); the pool's timeout kills a worker in any case.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["answers_equal", "gold_text"]

_TIMEOUT_S = 5  # math_verify's alarm-based limit per parse/verify (main thread only)
_DELIMITERS = ("$", "\\boxed", "\\[", "\\(")


def _limit() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def gold_text(answer: str) -> str:
    """The text after the last ``####`` (its first line; "" if none), else all of ``answer``; stripped."""
    text = answer.strip()
    marker = text.rfind("####")
    if marker != -1:
        rest = text[marker + 4 :].strip()
        text = rest.splitlines()[0].strip() if rest else ""
    return text


def _parse_gold(answer: str) -> list[Any]:
    from math_verify import parse

    text = gold_text(answer)
    if not text:
        return []
    candidates = [text] if any(d in text for d in _DELIMITERS) else [f"${text}$", text]
    for candidate in candidates:
        parsed = parse(candidate, parsing_timeout=_limit())
        if parsed:
            return parsed
    return []


def answers_equal(gold: str, prediction: str) -> bool:
    """True if ``prediction`` (any text) holds an answer equal to ``gold``.

    ``gold`` may be bare LaTeX, delimited (``$...$``, ``\\boxed{}``), a number,
    or a GSM8K solution (:func:`gold_text`); bare gold answers are tried inside
    ``$...$`` first, so that sets and intervals are read as such.  False when
    either side cannot be parsed.
    """
    from math_verify import parse, verify

    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return False
    pred_parsed = parse(prediction, parsing_timeout=_limit())
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=_limit()))
