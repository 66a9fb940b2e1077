"""``AsyncRewardWrapper``: AReaL's awaitable reward wrapper, on our pool.

AReaL workflows create ``AsyncRewardWrapper(reward_fn)`` in ``__init__`` and
``await`` it in ``arun_episode``; this class keeps that shape so they port by
changing imports.  The difference is who owns the worker processes.  AReaL
keeps a process-wide executor alive until interpreter exit; under trio,
processes belong to an ``async with`` scope (a pool opened behind the caller's
back would outlive every nursery and leak workers on Ctrl-C).  So a call runs
on, in order:

1. the wrapper's own pool, while ``async with wrapper:`` is open (opened with
   the wrapper's ``max_workers``, ``timeout_seconds``, ``max_retries``);
2. otherwise the current pool (:func:`~rewards.current_reward_pool`): the one
   that ``open_reward_pool`` or ``open_rollout_engine`` opened in this task or
   an ancestor task.  This is the case inside an engine: a bare
   ``await wrapper(...)`` in a workflow uses the engine's workers, with the
   wrapper's ``timeout_seconds`` and ``max_retries`` (``max_workers`` and the
   fallback value are the pool's);
3. otherwise it raises ``RuntimeError`` saying how to fix it.

``await wrapper(...)`` returns a float, as in AReaL.  A fallback is still
flagged: :meth:`AsyncRewardWrapper.score` returns the full
:class:`~rewards.RewardOutcome`, :attr:`AsyncRewardWrapper.fallbacks` counts
them, :attr:`AsyncRewardWrapper.last_outcome` holds the latest, and
:func:`~rewards.collect_reward_outcomes` sees every call (the engine uses it to
flag the episode).
"""

from __future__ import annotations

import contextlib
from typing import Any

from ._options import DEFAULTS, RewardPoolOptions
from ._pickling import check_picklable
from ._pool import RewardPool, current_reward_pool, open_reward_pool
from ._stats import RewardOutcome

__all__ = ["AsyncRewardWrapper"]


class AsyncRewardWrapper:
    """Awaitable reward function with AReaL's signature and defaults.

    Args:
        reward_fn: ``reward_fn(prompt, completions, prompt_ids, completion_ids,
            **data)``: a picklable function, a :class:`~rewards.RewardActor`,
            or an ``async def`` function/actor (runs in-process).
        timeout_seconds: seconds per attempt (worker killed after it).
        max_workers: worker processes of the wrapper's own pool (``async with``
            only); default AReaL's derivation.
        max_retries: retries after the first attempt.

    Raises:
        ValueError: an argument is out of range.
        RewardError: ``reward_fn`` is sync and cannot be pickled.

    Attributes:
        calls: calls completed with a reward (computed or fallback).
        fallbacks: calls that returned the fallback reward.
        last_outcome: the :class:`~rewards.RewardOutcome` of the latest
            completed call, or None.
    """

    def __init__(
        self,
        reward_fn: Any,
        timeout_seconds: float = DEFAULTS.timeout_seconds,
        max_workers: int | None = DEFAULTS.max_workers,
        max_retries: int = DEFAULTS.max_retries,
    ) -> None:
        #: the wrapper's own pool's settings (its ``timeout_seconds`` and ``max_retries``
        #: also apply on the current pool); validated here
        self.options = RewardPoolOptions(
            timeout_seconds=timeout_seconds, max_workers=max_workers, max_retries=max_retries
        )
        check_picklable(reward_fn)
        self.reward_fn = reward_fn
        self.timeout_seconds = self.options.timeout_seconds
        self.max_workers = max_workers
        self.max_retries = max_retries
        self.calls = 0
        self.fallbacks = 0
        self.last_outcome: RewardOutcome | None = None
        self._pool: RewardPool | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> AsyncRewardWrapper:
        if self._stack is not None:
            raise RuntimeError("this AsyncRewardWrapper's 'async with' block is already open")
        stack = contextlib.AsyncExitStack()
        self._pool = await stack.enter_async_context(
            open_reward_pool(self.options)
        )
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        stack, self._stack, self._pool = self._stack, None, None
        assert stack is not None
        return await stack.__aexit__(*exc_info)

    def _current_pool(self) -> RewardPool:
        pool = self._pool or current_reward_pool()
        if pool is None:
            raise RuntimeError(
                "AsyncRewardWrapper has no reward pool: call it inside "
                "'async with AsyncRewardWrapper(...) as wrapper:', or inside an open "
                "rollout engine / 'async with open_reward_pool()' block"
            )
        return pool

    async def score(self, *args: Any, **data: Any) -> RewardOutcome:
        """Like ``await wrapper(...)`` but return the flagged :class:`RewardOutcome`.

        Arguments go to ``reward_fn`` unchanged, as in AReaL (normally
        ``prompt, completions, prompt_ids, completion_ids, **data``).

        Raises:
            RewardError: as :meth:`RewardPool.score`.
            RuntimeError: there is no pool (see the module docstring).
        """
        outcome = await self._current_pool().score_call(
            self.reward_fn, args, data, timeout_seconds=self.timeout_seconds, max_retries=self.max_retries
        )
        self.calls += 1
        self.fallbacks += outcome.is_fallback
        self.last_outcome = outcome
        return outcome

    async def __call__(self, *args: Any, **data: Any) -> float:
        """The reward as a float (AReaL's return type); see :meth:`score`."""
        return (await self.score(*args, **data)).reward
