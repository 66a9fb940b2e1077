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
stays cheap; reward workers pay the import once.  The parsing and the time
limits are in :mod:`rewards._math_verify`, shared with :mod:`rewards.gsm8k`.
"""

from __future__ import annotations

from typing import Any

from ._math_verify import answers_equal

__all__ = ["answers_equal", "math_reward"]


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
