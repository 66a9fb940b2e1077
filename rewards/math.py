"""Math answer checking with Math-Verify (LaTeX, ``\\boxed{}``, fractions, sets).

:func:`math_reward` is 1.0 when the final answer of a completion is
mathematically equal to the gold answer, as decided by HuggingFace
``math-verify`` (``parse`` + ``verify``: sympy equivalence, so ``\\frac{1}{2}``
= ``0.5`` = ``1/2``, ``\\{1,2\\}`` = ``\\{2,1\\}``, intervals, ``\\sqrt{2}/2``
= ``\\frac{\\sqrt{2}}{2}``).

* The completion is parsed with math-verify's default extraction (LaTeX first,
  ``\\boxed{}`` preferred, then plain expressions).
* The gold answer may be bare LaTeX (``\\frac{1}{2}``, ``\\{1, 2\\}``), already
  delimited (``$...$``, ``\\boxed{...}``), a plain number, or a GSM8K-style
  solution ending in ``#### <answer>`` (the text after the last ``####``).
  Bare gold answers are tried inside ``$...$`` first, so that sets and
  intervals are read as such.

math-verify is imported on first use (about 0.7 s), so importing this module
stays cheap; reward workers pay the import once.  Its own time limits use
``SIGALRM`` and so work only in a process's main thread (they are on in reward
workers, off elsewhere); the pool's timeout kills a worker in any case.

For compatibility this module also re-exports the GSM8K names
(:func:`~rewards.gsm8k.gsm8k_reward`, :func:`~rewards.gsm8k.extract_answer`,
:func:`~rewards.gsm8k.parse_number`), which lived here first.
"""

from __future__ import annotations

import threading
from typing import Any

from .gsm8k import extract_answer, gsm8k_reward, parse_number

__all__ = ["answers_equal", "extract_answer", "gsm8k_reward", "math_reward", "parse_number"]

_TIMEOUT_S = 5  # math_verify's alarm-based limit per parse/verify (main thread only)
_DELIMITERS = ("$", "\\boxed", "\\[", "\\(")


def _limit() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _gold_text(answer: str) -> str:
    text = answer.strip()
    marker = text.rfind("####")
    if marker != -1:
        rest = text[marker + 4 :].strip()
        text = rest.splitlines()[0].strip() if rest else ""
    return text


def _parse_gold(answer: str) -> list[Any]:
    from math_verify import parse

    text = _gold_text(answer)
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

    False when either side cannot be parsed.
    """
    from math_verify import parse, verify

    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        return False
    pred_parsed = parse(prediction, parsing_timeout=_limit())
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=_limit()))


def math_reward(
    prompt: Any,
    completions: str,
    prompt_ids: Any,
    completion_ids: Any,
    answer: str,
    **data: Any,
) -> float:
    """1.0 if the completion's final answer equals ``answer`` (math-verify), else 0.0.

    Args:
        completions: the generated text (AReaL's name; one completion).
        answer: the gold answer (see the module docstring for accepted forms).
        prompt, prompt_ids, completion_ids, data: unused (AReaL's signature).
    """
    return 1.0 if answers_equal(str(answer), str(completions)) else 0.0
