"""The pool's per-context state: the one ambient lookup, and the outcome collector.

* :func:`using_pool` / :func:`pool_in_context`: the pool open in this task's
  context (a context variable set while a pool's ``async with`` block is open),
  read by :func:`rewards.current_reward_pool` so that
  :class:`~rewards.AsyncRewardWrapper` finds the engine's pool.  It is the only
  ambient lookup of the package.  The variable holds an ``object`` (this module
  sits below ``rewards._pool``); ``current_reward_pool`` checks its type.
* :func:`collect_reward_outcomes`: collect every outcome of a block (the
  engine's per-episode fallback flag).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from ._stats import RewardOutcome

__all__ = ["collect_reward_outcomes", "pool_in_context", "record_outcome", "set_pool_in_context",
           "swap_reward_outcome_collector", "using_pool"]

_CURRENT_POOL: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "trio_rollout_reward_pool", default=None
)
_COLLECTOR: contextvars.ContextVar[list[RewardOutcome] | None] = contextvars.ContextVar(
    "trio_rollout_reward_outcomes", default=None
)


def pool_in_context() -> object | None:
    """The pool of the innermost :func:`using_pool` block of this context, or None."""
    return _CURRENT_POOL.get()


@contextmanager
def using_pool(pool: object) -> Iterator[None]:
    """Make ``pool`` the pool of this context (and of tasks started from it) for the block."""
    token = _CURRENT_POOL.set(pool)
    try:
        yield
    finally:
        try:
            _CURRENT_POOL.reset(token)
        except ValueError:  # exited in another context than it was entered in
            pass


def set_pool_in_context(pool: object | None) -> None:
    """Make ``pool`` the pool of this context for the rest of the task (a trio task's context
    is its own copy): the engine's episode tasks, which may have been started from a task whose
    context has no pool (a ``trio.from_thread`` call of the blocking facade)."""
    _CURRENT_POOL.set(pool)


def record_outcome(outcome: RewardOutcome) -> None:
    """Append ``outcome`` to the block's collector, if one is open here."""
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.append(outcome)


def swap_reward_outcome_collector(outcomes: list[RewardOutcome] | None) -> list[RewardOutcome] | None:
    """Make ``outcomes`` this context's collector (``None``: none) and return the previous one.

    The allocation-free form of :func:`collect_reward_outcomes` for a hot loop (the
    engine's episodes): no context manager or ``Token`` object lives for the block;
    the caller restores the previous collector by value with a second call.
    """
    previous = _COLLECTOR.get()
    _COLLECTOR.set(outcomes)
    return previous


@contextmanager
def collect_reward_outcomes() -> Iterator[list[RewardOutcome]]:
    """Collect the :class:`~rewards.RewardOutcome` of every score call made in this block.

    Covers calls made by this task and by tasks it starts inside the block
    (child tasks share the list), through any pool or
    :class:`~rewards.AsyncRewardWrapper`.  Calls that raise are not collected.
    The engine can wrap an episode with it to flag a fallback reward::

        with collect_reward_outcomes() as outcomes:
            trajectory = await workflow.arun_episode(engine, data)
        reward_is_fallback = any(o.is_fallback for o in outcomes)
    """
    outcomes: list[RewardOutcome] = []
    token = _COLLECTOR.set(outcomes)
    try:
        yield outcomes
    finally:
        _COLLECTOR.reset(token)
