"""Format rewards for tagged outputs, and weighted sums of rewards.

:func:`format_reward` is 1.0 for a completion of the form
``<think>reasoning</think> answer`` (exactly one ``<think>`` block, at the
start, non-empty reasoning, a non-empty answer after it), else 0.0.
:class:`TagFormat` configures the tag, an answer tag (``<answer>...</answer>``)
and chat templates that put ``<think>`` in the prompt (Qwen3, DeepSeek-R1:
the completion then starts inside the reasoning).

:func:`weighted_sum` composes rewards::

    reward_fn = weighted_sum([(math_reward, 1.0), (format_reward, 0.1)])

Everything here is picklable (module-level classes and functions) and imports
only the standard library, so it runs in reward worker processes.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable, Iterable
from typing import Any

from ._actor import RewardActor
from ._worker import as_reward

__all__ = ["TagFormat", "WeightedSum", "format_reward", "weighted_sum"]

_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class TagFormat:
    """A 0/1 format reward: ``<tag>...</tag>`` then an answer.

    Args:
        tag: the reasoning tag (``"think"``).
        answer_tag: if set, the answer must be exactly one
            ``<answer_tag>...</answer_tag>`` block (non-empty) after the
            reasoning, with nothing else around it but whitespace.
        open_tag_in_prompt: the chat template already opened ``<tag>`` in the
            prompt, so the completion must *not* start with it: it is
            ``reasoning</tag> answer``.

    Raises:
        ValueError: a tag is not a plain tag name.
    """

    def __init__(
        self, tag: str = "think", answer_tag: str | None = None, open_tag_in_prompt: bool = False
    ) -> None:
        for name, value in (("tag", tag), ("answer_tag", answer_tag)):
            if value is not None and not _TAG_NAME.fullmatch(value):
                raise ValueError(f"{name} must be a tag name like 'think', got {value!r}")
        self.tag = tag
        self.answer_tag = answer_tag
        self.open_tag_in_prompt = open_tag_in_prompt

    def __repr__(self) -> str:
        return (
            f"TagFormat(tag={self.tag!r}, answer_tag={self.answer_tag!r}, "
            f"open_tag_in_prompt={self.open_tag_in_prompt!r})"
        )

    def matches(self, text: str) -> bool:
        """True if ``text`` has the format."""
        open_, close = f"<{self.tag}>", f"</{self.tag}>"
        if text.count(close) != 1 or text.count(open_) != (0 if self.open_tag_in_prompt else 1):
            return False
        head, _, answer = text.partition(close)
        if not self.open_tag_in_prompt:
            before, _, head = head.partition(open_)
            if before.strip():
                return False
        if not head.strip() or not answer.strip():
            return False
        if self.answer_tag is None:
            return True
        a_open, a_close = f"<{self.answer_tag}>", f"</{self.answer_tag}>"
        answer = answer.strip()
        if not (answer.startswith(a_open) and answer.endswith(a_close)):
            return False
        inner = answer[len(a_open) : len(answer) - len(a_close)]
        return bool(inner.strip()) and a_open not in inner and a_close not in inner

    def __call__(
        self, prompt: Any, completions: Any, prompt_ids: Any, completion_ids: Any, **data: Any
    ) -> float:
        return 1.0 if self.matches(str(completions)) else 0.0


_THINK = TagFormat()


def format_reward(
    prompt: Any, completions: Any, prompt_ids: Any, completion_ids: Any, **data: Any
) -> float:
    """1.0 if the completion is ``<think>reasoning</think> answer``, else 0.0."""
    return _THINK(prompt, completions, prompt_ids, completion_ids, **data)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


class WeightedSum(RewardActor):
    """``sum(weight * fn(...))`` over sync reward functions; see :func:`weighted_sum`.

    It is a :class:`~rewards.RewardActor` so that components that are actors get
    their ``setup()`` (run by this actor's setup, once per worker process).
    """

    def __init__(self, components: Iterable[tuple[Callable[..., Any], float]]) -> None:
        parts: list[tuple[Callable[..., Any], float]] = []
        for entry in components:
            try:
                fn, weight = entry
            except (TypeError, ValueError):
                raise ValueError(
                    f"weighted_sum expects (reward_fn, weight) pairs, got {entry!r}"
                ) from None
            if not callable(fn):
                raise ValueError(f"weighted_sum: {fn!r} is not callable")
            if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
                getattr(fn, "__call__", None)
            ):
                raise ValueError(
                    f"weighted_sum: {_name(fn)} is async; combine sync reward functions only"
                )
            if (
                isinstance(weight, bool)
                or not isinstance(weight, numbers.Real)
                or not math.isfinite(weight)
            ):
                raise ValueError(f"weighted_sum: weight of {_name(fn)} must be finite, got {weight!r}")
            parts.append((fn, float(weight)))
        if not parts:
            raise ValueError("weighted_sum needs at least one (reward_fn, weight) pair")
        self.components = tuple(parts)
        self.setup_timeout_seconds = max(
            (float(fn.setup_timeout_seconds) for fn, _ in parts if isinstance(fn, RewardActor)),
            default=RewardActor.setup_timeout_seconds,
        )

    def __repr__(self) -> str:
        return "weighted_sum([" + ", ".join(f"({_name(f)}, {w})" for f, w in self.components) + "])"

    def setup(self) -> None:
        for fn, _ in self.components:
            if isinstance(fn, RewardActor):
                fn.setup()

    def __call__(
        self, prompt: Any, completions: Any, prompt_ids: Any, completion_ids: Any, **data: Any
    ) -> float:
        total = 0.0
        for fn, weight in self.components:
            tag, value = as_reward(fn(prompt, completions, prompt_ids, completion_ids, **data))
            if tag != "ok":
                raise ValueError(f"weighted_sum component {_name(fn)} returned {value}")
            total += weight * value
        return total


def weighted_sum(components: Iterable[tuple[Callable[..., Any], float]]) -> WeightedSum:
    """A picklable reward ``sum(w * fn(prompt, completions, prompt_ids, completion_ids, **data))``.

    Every component gets the same arguments.  Components must be sync
    (functions or :class:`~rewards.RewardActor` s); a component returning a
    non-finite or non-numeric value raises ``ValueError`` naming it (the pool
    retries it, then reports ``reward_error``).

    Raises:
        ValueError: empty, a non-callable or async component, a non-finite weight.
    """
    return WeightedSum(components)
