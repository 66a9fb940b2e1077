"""What the built-in workflows share: the ``n_samples`` fan-out of one episode, and the
checks and conversions of the constructor arguments that several of them take."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import trio

from engine.data import concat_padded_tensors

__all__ = ["check_max_turns", "check_turn_discount", "gather_samples", "load_tokenizer", "sample_rows",
           "template_kwargs"]

T = TypeVar("T")


async def gather_samples(n: int, sample: Callable[[int], Awaitable[T]]) -> list[T]:
    """``[await sample(0), ..., await sample(n - 1)]``, in sample order.

    ``n > 1`` samples run concurrently in a child nursery: cancelling the episode
    cancels all of them, and the first error cancels the others and fails the episode
    (raised in an exception group, as a nursery raises).  ``n == 1`` is awaited inline
    (no nursery, no task)."""
    if n == 1:
        return [await sample(0)]
    results: list[Any] = [None] * n

    async def one(i: int) -> None:
        results[i] = await sample(i)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return results


async def sample_rows(n: int, sample: Callable[[int], Awaitable[Any]]) -> Any:
    """One trajectory of batch ``[n]`` from ``n`` samples (each a trajectory of batch
    ``[1]``: :func:`gather_samples`), rows in sample order, padded by
    :func:`engine.data.concat_padded_tensors`; for ``n == 1`` the sample's own."""
    rows = await gather_samples(n, sample)
    return rows[0] if n == 1 else concat_padded_tensors(rows)


def check_turn_discount(value: Any) -> float:
    """``turn_discount`` as a float: a number (not a bool) in ``[0, 1]``.

    Raises:
        ValueError: naming ``turn_discount`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1 or math.isnan(value):
        raise ValueError(f"turn_discount must be a number in [0, 1], got {value!r}")
    return float(value)


def check_max_turns(value: Any) -> int:
    """``max_turns``: an int (not a bool) >= 1.

    Raises:
        ValueError: naming ``max_turns`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_turns must be an int >= 1, got {value!r}")
    return value


def load_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` itself, or for a string (a path or a Hub name) the tokenizer
    ``transformers.AutoTokenizer.from_pretrained`` loads from it."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


def template_kwargs(chat_template_kwargs: Mapping[str, Any] | None, enable_thinking: bool | None) -> dict[str, Any]:
    """The chat template's keyword arguments: a copy of ``chat_template_kwargs`` with
    ``enable_thinking`` set when it is not None."""
    kwargs = dict(chat_template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    return kwargs
