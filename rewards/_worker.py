"""Worker-side half of the reward pool: unpickle one job, run it, check the value.

This module is imported inside every reward worker process, so it imports only
the standard library.  :func:`run_job` is module-level so that trio-parallel can
pickle it by reference.

The parent pickles ``(reward_fn, args, kwargs)`` itself (see
:mod:`rewards._pool`) so that an unpicklable function or argument is reported
with a clear message before any process is involved, and so that the bytes are
made once per call, not once per attempt.

:func:`run_job` returns a tagged tuple instead of raising for everything the
parent must not retry:

* ``(OK, reward)``: ``reward`` is a finite Python ``float``;
* ``(INVALID, description)``: the function returned something that is not a
  finite real number (the description names its type);
* ``(LOAD_FAILED, description)``: the job could not be unpickled in the worker
  (for example its module cannot be imported there).

An exception raised by the reward function itself propagates unchanged;
trio-parallel sends it back with its worker-side traceback (tblib).
"""

from __future__ import annotations

import inspect
import math
import numbers
import pickle
from typing import Any

__all__ = ["INVALID", "LOAD_FAILED", "OK", "as_reward", "describe_value", "run_job"]

OK = "ok"
INVALID = "invalid"
LOAD_FAILED = "load_failed"

_REPR_CHARS = 80


def describe_value(value: Any) -> str:
    """``"<type> (<short repr>)"``, e.g. ``"NoneType (None)"``, ``"float (nan)"``."""
    cls = type(value)
    name = cls.__qualname__
    if cls.__module__ not in ("builtins", None):
        name = f"{cls.__module__}.{name}"
    text = repr(value)
    if len(text) > _REPR_CHARS:
        text = text[: _REPR_CHARS - 3] + "..."
    return f"{name} ({text})"


def _element_count(value: Any) -> int | None:
    """Element count of a tensor/array-like, or None if it is not one."""
    numel = getattr(value, "numel", None)
    if callable(numel):  # torch.Tensor
        return int(numel())
    size = getattr(value, "size", None)
    if isinstance(size, int):  # numpy.ndarray and numpy scalars
        return size
    return None


def as_reward(value: Any) -> tuple[str, Any]:
    """Convert a reward function's return value to ``(OK, float)`` or ``(INVALID, why)``.

    Accepted: ``int``, ``float``, any :class:`numbers.Real` (numpy scalars,
    ``fractions.Fraction``), and one-element tensors/arrays (through ``.item()``),
    provided the result is finite.  Rejected (``INVALID``): ``None``, NaN, +-inf,
    ``bool`` (ours: a bool is usually a bug such as returning a comparison by
    mistake; return ``float(ok)``), strings, coroutines, tensors with more than
    one element, anything else.
    """
    original = value
    if inspect.iscoroutine(value):
        value.close()  # avoid "coroutine was never awaited"
        return INVALID, (
            f"{describe_value(original)}; an async reward function must be declared "
            "with 'async def' so that the pool awaits it in-process"
        )
    if not isinstance(value, numbers.Real):
        count = _element_count(value)
        item = getattr(value, "item", None)
        if count is None or not callable(item):
            return INVALID, f"{describe_value(original)}; expected a finite real number"
        if count != 1:
            return INVALID, (
                f"{describe_value(original)} with {count} elements; "
                "expected a finite real number or a one-element tensor"
            )
        value = item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return INVALID, f"{describe_value(original)}; expected a finite real number"
    result = float(value)
    if not math.isfinite(result):
        return INVALID, f"{describe_value(original)}; expected a finite real number"
    return OK, result


def run_job(job: bytes) -> tuple[str, Any]:
    """Unpickle ``(reward_fn, args, kwargs)``, call it, return a tagged result.

    Raises:
        Exception: whatever the reward function raises, unchanged.
    """
    try:
        reward_fn, args, kwargs = pickle.loads(job)
    except Exception as exc:
        return LOAD_FAILED, f"{type(exc).__name__}: {exc}"
    return as_reward(reward_fn(*args, **kwargs))
