"""Exact-match reward: the completion's answer equals the gold text, after normalising.

Normalising (:func:`normalize`): Unicode NFKC, case folded, runs of whitespace
made one space, surrounding whitespace, quotes and trailing ``.``/``!``/``?``
dropped.  The completion matches when any of these equals the normalised gold:

1. the whole completion;
2. its last non-empty line;
3. the text after the last ``Answer:`` (any case), on its line;
4. the content of the last ``\\boxed{...}``.

``answer`` may be a list of accepted strings (any one matches).  Numbers are
compared as text (``"18"`` does not match ``"18.0"``; use the GSM8K or math
reward for numbers).

This module imports only the standard library; it runs in reward worker processes.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from .gsm8k import _last_boxed

__all__ = ["exact_match_reward", "normalize"]

_SPACES = re.compile(r"\s+")
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)


def normalize(text: str) -> str:
    """``text`` NFKC-normalised, case folded, whitespace collapsed, outer quotes and
    trailing ``.!?`` removed."""
    text = _SPACES.sub(" ", unicodedata.normalize("NFKC", str(text)).casefold()).strip()
    while True:
        before = text
        text = text.rstrip(".!?").strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'`":
            text = text[1:-1].strip()
        if text == before:
            return text


def _candidates(completion: str) -> list[str]:
    out = [completion]
    lines = [line for line in completion.splitlines() if line.strip()]
    if lines:
        out.append(lines[-1])
    marks = list(_ANSWER.finditer(completion))
    if marks:
        out.append(completion[marks[-1].end():].split("\n", 1)[0])
    boxed = _last_boxed(completion)
    if boxed is not None:
        out.append(boxed)
    return out


def exact_match_reward(
    prompt: Any,
    completions: str,
    prompt_ids: Any,
    completion_ids: Any,
    answer: Any,
    **data: Any,
) -> float:
    """1.0 if the completion's answer equals ``answer`` after :func:`normalize`, else 0.0.

    Args:
        completions: the generated text (AReaL's name; one completion).
        answer: the gold text, or a list of accepted texts.
        prompt, prompt_ids, completion_ids, data: unused (AReaL's signature).
    """
    golds = answer if isinstance(answer, (list, tuple)) else [answer]
    wanted = {normalize(g) for g in golds if g is not None}
    wanted.discard("")
    if not wanted:
        return 0.0
    return 1.0 if any(normalize(c) in wanted for c in _candidates(str(completions))) else 0.0
