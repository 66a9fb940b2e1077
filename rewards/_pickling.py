"""What crosses to a reward worker process: the job's bytes, and the checks before.

* :func:`dumps`: plain pickle when it can (twice as fast), else cloudpickle
  (lambdas, nested functions, things defined in ``__main__``), as trio-parallel
  chooses.
* :func:`pickle_job`: one call's ``(reward_fn, args, data)`` pickled once per
  call (not per attempt); a :class:`~rewards.RewardActor` travels as an
  :class:`~rewards._worker.ActorRef`; a function from a module a worker cannot
  import (loaded by path) travels with that module's file (:mod:`rewards._shipping`).
* :func:`reward_data`: a call's keyword data, without the reward's positional names.
* :func:`check_signature` (``RewardPool.check_reward_fn``) and
  :func:`check_picklable` (:class:`~rewards.AsyncRewardWrapper`): start-up checks.
* :func:`is_async` (``async def`` rewards run in-process, never pickled) and
  :func:`describe_fn` (the name used in every message).
"""

from __future__ import annotations

import inspect
import pickle
import types
from typing import Any

from engine._portable import dumps
from engine.errors import RewardError

from . import _worker
from ._actor import RewardActor
from ._shipping import Shipped, modules_to_ship

__all__ = ["check_picklable", "check_signature", "describe_fn", "dumps", "is_async", "pickle_job", "reward_data"]

#: the reward function's positional parameters; dataset keys of the same name (a ``prompt``
#: column) are not passed again as keywords, which would raise "multiple values for argument"
REWARD_POSITIONAL = frozenset({"prompt", "completions", "prompt_ids", "completion_ids"})

#: How to fix a reward that cannot go to a worker (every unpicklable message ends with it).
_HOW_TO_FIX = (
    "define reward functions at module level and pass picklable data, "
    "create a RewardActor's unpicklable state in setup(), "
    "or use an 'async def' reward function, which runs in-process"
)


def reward_data(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys that name the reward function's positional parameters."""
    if REWARD_POSITIONAL.isdisjoint(data):
        return data
    return {k: v for k, v in data.items() if k not in REWARD_POSITIONAL}


def check_signature(fn: Any, name: str, data: dict[str, Any]) -> None:
    """Raise :class:`~engine.errors.RewardError` unless ``fn(prompt, completions,
    prompt_ids, completion_ids, **data)`` binds to ``fn``'s signature (none: passes)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        signature.bind("prompt", "completions", [], [], **data)
    except TypeError as exc:
        raise RewardError(
            f"reward function {name} cannot be called as {name.rsplit('.', 1)[-1]}(prompt, "
            f"completions, prompt_ids, completion_ids, **data) with data keys {sorted(data)}: {exc}"
        ) from None


def describe_fn(fn: Any) -> str:
    """``module.qualname`` of a function, or of an instance's class (``path.py:qualname``
    for one loaded from a file); ``repr`` otherwise."""
    target = fn if hasattr(fn, "__qualname__") else type(fn)  # an instance: its class
    qualname = getattr(target, "__qualname__", None)
    if qualname is None:
        return repr(fn)
    module = getattr(target, "__module__", None)
    if isinstance(module, str) and module.endswith(".py"):  # loaded from a file: its import string, path:name
        return f"{module}:{qualname}"
    return f"{module}.{qualname}" if module else qualname


def is_async(fn: Any) -> bool:
    """True for an ``async def`` function, or an object whose ``__call__`` is one."""
    if type(fn) is types.FunctionType and not fn.__dict__:  # fast path: a plain function
        return bool(fn.__code__.co_flags & inspect.CO_COROUTINE)  # (no markcoroutinefunction)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def pickle_job(fn: Any, name: str, args: tuple, data: dict) -> tuple[bytes, float | None]:
    """The job's bytes, and the actor's setup timeout in seconds (None: not an actor).

    Raises:
        RewardError: ``fn`` or an argument cannot be pickled (the message says which).
    """
    setup_timeout = None
    try:
        files, by_value = modules_to_ship(fn)  # its module cannot be imported in a worker (rewards._shipping)
        pickler = _by_value_dumps if by_value else dumps
        if isinstance(fn, RewardActor):
            setup_timeout = float(fn.setup_timeout_seconds)
            fn = _worker.ActorRef(fn.actor_key, pickler(fn))
        if files:
            fn = Shipped(files, fn)
        return pickler((fn, args, data)), setup_timeout
    except Exception as exc:
        try:
            dumps(fn)
        except Exception:
            what = f"reward function {name}"
        else:
            what = f"an argument of reward function {name}"
        raise RewardError(
            f"{what} cannot be pickled for a worker process: {type(exc).__name__}: {exc} ({_HOW_TO_FIX})"
        ) from exc


def _by_value_dumps(obj: Any) -> bytes:
    """cloudpickle, for a job naming a module registered by value (:mod:`rewards._shipping`)."""
    import cloudpickle

    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def check_picklable(fn: Any) -> None:
    """Raise :class:`~engine.errors.RewardError` if sync ``fn`` cannot go to a worker."""
    if is_async(fn):
        return
    try:
        dumps(fn)
    except Exception as exc:
        raise RewardError(
            f"reward function {describe_fn(fn)} cannot be pickled for a worker process: "
            f"{type(exc).__name__}: {exc} ({_HOW_TO_FIX})"
        ) from exc
