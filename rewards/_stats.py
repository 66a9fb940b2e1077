"""What a score call returns, and a pool's counters and their snapshot.

* :class:`RewardOutcome`: one call's reward with its fallback flag.
* :class:`RewardPoolStatistics`: a pool's counters (``RewardPool.statistics()``).
* :class:`Counters`: the mutable counters behind it, shared by the pool's policy,
  its worker slots (:mod:`rewards._slots`) and its batcher (:mod:`rewards._batch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["LATENCY_WINDOW", "Counters", "LatencyWindow", "RewardOutcome", "RewardPoolStatistics", "percentile"]

LATENCY_WINDOW = 4096  # successful calls kept for the latency percentiles


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
        workers_busy: worker processes running a job now (not counting starting ones).
        workers_idle: live worker processes waiting for a job.
        workers_starting: worker processes (or Ray actors) being started now, their
            first job waiting for them (seconds for a spawn worker that imports torch).
        max_workers: the most worker processes running at once.
        batches: worker jobs that carried a micro-batch (``batch_size > 1``; a
            call alone at low load is a batch of one).
        batched_calls: calls those jobs carried (``batched_calls / batches`` is
            the mean batch size).
        batch_failures: micro-batches of several calls that timed out or whose
            worker died (the call running then failed its attempt, those before it
            kept their results, those after it were re-run one by one, uncharged).
        latency_p50_s, latency_p99_s: latency percentiles in seconds over the
            last 4096 successful calls; None before the first success.  A call's
            latency is from the call to its result, so the first calls of a pool
            include the wait for the worker processes to start (seconds where a
            training script's ``__main__`` imports torch): until ~4096 more calls
            have pushed them out, ``latency_p99_s`` can be that start-up wait.
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
    workers_starting: int = 0


class Counters:
    """A pool's counters (see :class:`RewardPoolStatistics` for their meaning)."""

    __slots__ = (
        "batch_failures", "batched_calls", "batches", "busy", "calls", "cancelled", "errors", "fallbacks",
        "latencies", "retries", "successes", "timeouts", "worker_deaths", "workers_killed",
    )

    def __init__(self) -> None:
        self.calls = self.successes = self.timeouts = self.retries = 0
        self.fallbacks = self.errors = self.worker_deaths = self.cancelled = 0
        self.workers_killed = self.batches = self.batch_failures = self.batched_calls = 0
        self.busy = 0
        self.latencies = LatencyWindow()

    def snapshot(self, max_workers: int, workers_busy: int, workers_idle: int,
                 workers_starting: int = 0) -> RewardPoolStatistics:
        """The counters now, as a frozen record."""
        p50, p99 = self.latencies.percentiles(0.50, 0.99)
        return RewardPoolStatistics(
            calls=self.calls,
            successes=self.successes,
            timeouts=self.timeouts,
            retries=self.retries,
            fallbacks=self.fallbacks,
            errors=self.errors,
            worker_deaths=self.worker_deaths,
            workers_killed=self.workers_killed,
            worker_restarts=self.worker_deaths + self.workers_killed,
            cancelled=self.cancelled,
            busy=self.busy,
            workers_busy=workers_busy,
            workers_idle=workers_idle,
            workers_starting=workers_starting,
            max_workers=max_workers,
            batches=self.batches,
            batched_calls=self.batched_calls,
            batch_failures=self.batch_failures,
            latency_p50_s=p50,
            latency_p99_s=p99,
        )


class LatencyWindow:
    """The last ``size`` latencies (seconds) in a float64 ring; percentiles by
    selection (:func:`numpy.partition`, O(n)), not a sort: ``statistics()`` is
    called every training step or monitor tick (~30 us for 4096 values; sorting
    the deque it replaced took ~600 us on this 2-core box)."""

    __slots__ = ("_next", "_values", "count")

    def __init__(self, size: int = LATENCY_WINDOW) -> None:
        self._values = np.empty(size, dtype=np.float64)
        self._next = 0
        self.count = 0  # values held, <= size

    def __len__(self) -> int:
        return self.count

    def append(self, value: float) -> None:
        values = self._values
        values[self._next] = value
        self._next = (self._next + 1) % len(values)
        if self.count < len(values):
            self.count += 1

    def percentiles(self, *qs: float) -> tuple[float | None, ...]:
        """Nearest-rank percentiles (as :func:`percentile`), ``qs`` in (0, 1];
        None each while empty."""
        n = self.count
        if n == 0:
            return (None,) * len(qs)
        ranks = [max(math.ceil(q * n), 1) - 1 for q in qs]
        picked = np.partition(self._values[:n], sorted(set(ranks)))
        return tuple(float(picked[r]) for r in ranks)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in (0, 1]."""
    rank = max(math.ceil(q * len(sorted_values)), 1)
    return sorted_values[rank - 1]
