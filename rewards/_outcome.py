"""What a score call returns, pool statistics, and the per-context state.

* :class:`RewardOutcome`: one call's reward with its fallback flag.
* :class:`RewardPoolStatistics`: a pool's counters (``RewardPool.statistics()``).
* :func:`current_reward_pool`: the pool open in this task's context (a context
  variable set by ``open_reward_pool``), used by ``AsyncRewardWrapper``.
* :func:`collect_reward_outcomes`: collect every outcome of a block (the
  engine's per-episode fallback flag).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._pool import RewardPool

__all__ = [
    "RewardOutcome",
    "RewardPoolStatistics",
    "collect_reward_outcomes",
    "current_reward_pool",
]

_CURRENT_POOL: contextvars.ContextVar[RewardPool | None] = contextvars.ContextVar(
    "trio_rollout_reward_pool", default=None
)
_COLLECTOR: contextvars.ContextVar[list[RewardOutcome] | None] = contextvars.ContextVar(
    "trio_rollout_reward_outcomes", default=None
)


@dataclass(frozen=True)
class RewardOutcome:
    """The result of one :meth:`RewardPool.score` call.

    Attributes:
        reward: the reward, or the pool's ``fallback_reward`` if every attempt
            timed out.
        is_fallback: True when ``reward`` is the fallback, not a computed value.
        attempts: attempts made, 1 to ``max_retries + 1``.
        latency_s: seconds from the call to its result (trio clock), including
            waiting for a free worker and all retries.
    """

    reward: float
    is_fallback: bool
    attempts: int
    latency_s: float


@dataclass(frozen=True)
class RewardPoolStatistics:
    """A snapshot of a :class:`RewardPool` (see :meth:`RewardPool.statistics`).

    Attributes:
        calls: ``score`` calls started.
        successes: calls that returned a computed reward.
        timeouts: attempts that timed out (a worker attempt's worker is killed).
        retries: attempts after the first, for any reason.
        fallbacks: calls that returned the fallback reward after timeouts.
        errors: calls that raised :class:`~engine.errors.RewardError`.
        worker_deaths: worker jobs whose process died (crash, ``os._exit``, OOM).
        workers_killed: worker jobs killed by the pool (timeout or cancellation).
        worker_restarts: ``worker_deaths + workers_killed``: workers lost and
            replaced by a fresh process at the next job.
        cancelled: calls cancelled by their caller.
        busy: calls in flight now (running or waiting for a worker).
        workers_busy: worker processes running a job now.
        workers_idle: live worker processes waiting for a job.
        max_workers: the most worker processes running at once.
        batches: worker jobs that carried a micro-batch (``batch_size > 1``; a
            call alone at low load is a batch of one).
        batched_calls: calls those jobs carried (``batched_calls / batches`` is
            the mean batch size).
        batch_failures: micro-batches that timed out or whose worker died (their
            calls were re-run one by one).
        latency_p50_s, latency_p99_s: latency percentiles in seconds over the
            last 4096 successful calls; None before the first success.
    """

    calls: int
    successes: int
    timeouts: int
    retries: int
    fallbacks: int
    errors: int
    worker_deaths: int
    workers_killed: int
    worker_restarts: int
    cancelled: int
    busy: int
    workers_busy: int
    workers_idle: int
    max_workers: int
    batches: int
    batch_failures: int
    batched_calls: int
    latency_p50_s: float | None
    latency_p99_s: float | None


def current_reward_pool() -> RewardPool | None:
    """The innermost open :class:`RewardPool` of this task's context, or None.

    Set by :func:`open_reward_pool` (so also by ``open_rollout_engine``) for the
    task that opened it and every task started from it while it is open.
    """
    pool = _CURRENT_POOL.get()
    return None if pool is None or pool._closed else pool


@contextmanager
def collect_reward_outcomes() -> Iterator[list[RewardOutcome]]:
    """Collect the :class:`RewardOutcome` of every score call made in this block.

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


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in (0, 1]."""
    rank = max(math.ceil(q * len(sorted_values)), 1)
    return sorted_values[rank - 1]
