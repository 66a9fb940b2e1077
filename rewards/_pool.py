"""A pool of killable reward worker processes with AReaL's timeout/retry policy.

The policy follows AReaL's ``AsyncRewardWrapper`` (``areal/api/reward_api.py``):
a timeout of ``timeout_seconds=15`` s per attempt, ``max_retries=3`` retries (so
up to 4 attempts), workers defaulting to ``max(cpu_count // device_count // 2, 1)``,
a fallback reward of ``0.0`` with a warning after the last timed-out attempt, and
a user exception re-raised after the last attempt (never turned into a reward).

Where we differ (**ours**):

* A timeout or a cancellation *kills* the worker process (trio-parallel's
  ``kill_on_cancel``).  AReaL only stops waiting, so one hung verifier holds a
  worker for the rest of the run (AReaL PR #1426, verl #6673).  Other calls keep
  flowing while one hangs.
* A worker that dies (``os._exit``, segfault, OOM kill) affects only the call it
  was running; that call is retried on a fresh worker.  If the last attempt's
  worker dies too, the call raises :class:`~engine.errors.RewardError` (AReaL
  re-raises ``BrokenProcessPool`` on the last attempt too).
* The timeout covers one attempt's execution (including starting a fresh worker
  process, about 0.2-1 s for "spawn"), not the wait for a free worker: AReaL's
  ``asyncio.wait_for`` also counts time queued behind busy workers.
* Fallbacks are flagged (:attr:`RewardOutcome.is_fallback`) and counted
  (:meth:`RewardPool.statistics`).
* A return value that is not a finite real number, and a function or argument
  that cannot be pickled, raise :class:`~engine.errors.RewardError` at once
  (deterministic, so never retried).
* ``async def`` reward functions (I/O-bound judges) run in-process as trio calls
  under the same timeout/retry/fallback policy; they do not take worker slots.

Timeouts, worker deaths and exceptions are all retried, up to ``max_retries``
times; the failure of the *last* attempt decides the result: a timeout gives the
flagged fallback, a death or an exception raises.

Exceptions raised by :meth:`RewardPool.score`:

* :class:`~engine.errors.RewardError`: the last attempt raised or its worker
  died, the function returned an invalid value, or it (or an argument) cannot be
  pickled, or unpickled in the worker.
* ``trio.Cancelled``: the caller was cancelled; the worker was killed first.
* ``trio.ClosedResourceError``: the pool's ``async with`` block has exited.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import math
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pickle import HIGHEST_PROTOCOL
from typing import Any

import trio
import trio_parallel

from engine.errors import RewardError

from . import _worker

try:  # mirror trio-parallel: cloudpickle when installed (lambdas, __main__), else pickle
    from cloudpickle import dumps as _dumps
except ImportError:  # pragma: no cover - cloudpickle comes with tensordict
    from pickle import dumps as _dumps

__all__ = [
    "RewardOutcome",
    "RewardPool",
    "RewardPoolStatistics",
    "default_max_workers",
    "open_reward_pool",
]

logger = logging.getLogger(__name__)

WORKER_TYPES = ("spawn", "forkserver")  # never "fork": it hangs once torch is loaded
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
        timeouts: attempts that timed out (each killed its worker).
        retries: attempts after the first, for any reason.
        fallbacks: calls that returned the fallback reward after timeouts.
        errors: calls that raised :class:`~engine.errors.RewardError`.
        worker_deaths: attempts whose worker process died.
        cancelled: calls cancelled by their caller.
        busy: calls in flight now (running or waiting for a worker).
        max_workers: the most worker processes running at once.
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
    cancelled: int
    busy: int
    max_workers: int
    latency_p50_s: float | None
    latency_p99_s: float | None


def default_max_workers() -> int:
    """AReaL's default worker count, ``max(cpu_count // device_count // 2, 1)``.

    ``device_count`` is ``torch.cuda.device_count()`` only if torch is already
    imported (it is never imported here), and is treated as 1 when it is 0 or
    unknown.
    """
    cpu_count = os.cpu_count() or 1
    device_count = 1
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            device_count = max(int(torch.cuda.device_count()), 1)
        except Exception:  # a broken CUDA setup must not stop reward scoring
            device_count = 1
    return max(cpu_count // device_count // 2, 1)


def _describe_fn(fn: Any) -> str:
    qualname = getattr(fn, "__qualname__", None)
    if qualname is None:
        return repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)
    )


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in (0, 1]."""
    rank = max(math.ceil(q * len(sorted_values)), 1)
    return sorted_values[rank - 1]


class _Timeout(Exception):
    """Internal: one attempt ran past ``timeout_seconds``."""


class RewardPool:
    """Scores completions with reward functions in killable worker processes.

    Create it with :func:`open_reward_pool`; do not instantiate it directly.
    """

    def __init__(
        self,
        *,
        context: trio_parallel.WorkerContext,
        max_workers: int,
        timeout_seconds: float,
        max_retries: int,
        fallback_reward: float,
        worker_type: str,
    ) -> None:
        self._ctx = context
        self.max_workers = max_workers
        self.timeout_seconds = timeout_seconds
        self.max_retries = max_retries
        self.fallback_reward = fallback_reward
        self.worker_type = worker_type
        self._limiter = trio.CapacityLimiter(max_workers)  # worker slots
        self._unlimited = trio.CapacityLimiter(math.inf)  # our limiter is held instead
        self._closed = False
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._calls = self._successes = self._timeouts = self._retries = 0
        self._fallbacks = self._errors = self._worker_deaths = self._cancelled = 0
        self._busy = 0

    def statistics(self) -> RewardPoolStatistics:
        """Return a snapshot of the counters (also works after close)."""
        latencies = sorted(self._latencies)
        return RewardPoolStatistics(
            calls=self._calls,
            successes=self._successes,
            timeouts=self._timeouts,
            retries=self._retries,
            fallbacks=self._fallbacks,
            errors=self._errors,
            worker_deaths=self._worker_deaths,
            cancelled=self._cancelled,
            busy=self._busy,
            max_workers=self.max_workers,
            latency_p50_s=_percentile(latencies, 0.50) if latencies else None,
            latency_p99_s=_percentile(latencies, 0.99) if latencies else None,
        )

    async def score(
        self,
        reward_fn: Callable[..., Any],
        prompt: Any,
        completions: Any,
        prompt_ids: Any,
        completion_ids: Any,
        /,
        **data: Any,
    ) -> RewardOutcome:
        """Compute ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data)``.

        A sync ``reward_fn`` runs in a worker process, an ``async def`` one
        in-process.  Each attempt gets ``timeout_seconds``; see the module
        docstring for the retry policy.

        Returns:
            A :class:`RewardOutcome`; ``is_fallback`` is True if every attempt
            timed out.

        Raises:
            RewardError: see the module docstring.
            trio.ClosedResourceError: the pool is closed.
        """
        if self._closed:
            raise trio.ClosedResourceError("the reward pool is closed")
        name = _describe_fn(reward_fn)
        args = (prompt, completions, prompt_ids, completion_ids)
        start = trio.current_time()
        self._calls += 1
        self._busy += 1
        try:
            if _is_async(reward_fn):
                attempt = functools.partial(self._attempt_async, reward_fn, name, args, data)
            else:
                job = self._pickle_job(reward_fn, name, args, data)
                attempt = functools.partial(self._attempt_in_worker, job, name)
            outcome = await self._run_with_policy(attempt, name, start)
        except RewardError:
            self._errors += 1
            raise
        except trio.Cancelled:
            self._cancelled += 1
            raise
        finally:
            self._busy -= 1
        if outcome.is_fallback:
            self._fallbacks += 1
        else:
            self._successes += 1
            self._latencies.append(outcome.latency_s)
        return outcome

    @staticmethod
    def _pickle_job(fn: Any, name: str, args: tuple, data: dict) -> bytes:
        try:
            return _dumps((fn, args, data), protocol=HIGHEST_PROTOCOL)
        except Exception as exc:
            try:
                _dumps(fn, protocol=HIGHEST_PROTOCOL)
            except Exception:
                what = f"reward function {name}"
            else:
                what = f"an argument of reward function {name}"
            raise RewardError(
                f"{what} cannot be pickled for a worker process: {type(exc).__name__}: {exc} "
                "(define reward functions at module level and pass picklable data, "
                "or use an 'async def' reward function, which runs in-process)"
            ) from exc

    async def _attempt_in_worker(self, job: bytes, name: str) -> float:
        async with self._limiter:  # held outside the timeout: queueing is not timed
            with trio.move_on_after(self.timeout_seconds) as scope:
                tag, value = await self._ctx.run_sync(
                    _worker.run_job, job, kill_on_cancel=True, limiter=self._unlimited
                )
        if scope.cancelled_caught:
            raise _Timeout
        if tag == _worker.LOAD_FAILED:
            raise RewardError(
                f"reward function {name} or its arguments could not be unpickled in the "
                f"worker process: {value} (is its module importable there?)"
            )
        if tag == _worker.INVALID:
            raise RewardError(f"reward function {name} returned {value}")
        return value

    async def _attempt_async(self, fn: Any, name: str, args: tuple, data: dict) -> float:
        with trio.move_on_after(self.timeout_seconds) as scope:
            tag, value = _worker.as_reward(await fn(*args, **data))
        if scope.cancelled_caught:
            raise _Timeout
        if tag == _worker.INVALID:
            raise RewardError(f"reward function {name} returned {value}")
        return value

    async def _run_with_policy(
        self, attempt: Callable[[], Any], name: str, start: float
    ) -> RewardOutcome:
        attempts = self.max_retries + 1
        failure, error = "timeout", None  # why the latest attempt failed
        for number in range(1, attempts + 1):
            if number > 1:
                self._retries += 1
            last = number == attempts
            then = "giving up" if last else "retrying"
            try:
                reward = await attempt()
            except _Timeout:
                self._timeouts += 1
                failure, error = "timeout", None
                if not last:
                    logger.warning(
                        "reward function %s timed out after %s s (attempt %s/%s); "
                        "worker killed; retrying",
                        name, self.timeout_seconds, number, attempts,
                    )
            except trio_parallel.BrokenWorkerError as exc:
                self._worker_deaths += 1
                failure, error = "died", exc
                logger.warning(
                    "worker process died while running reward function %s "
                    "(attempt %s/%s): %s; %s",
                    name, number, attempts, exc, then,
                )
            except (RewardError, trio.ClosedResourceError):
                raise  # deterministic: invalid value, unpicklable job, closed pool
            except Exception as exc:  # raised by the user's reward function
                failure, error = "raised", exc
                logger.warning(
                    "reward function %s raised %s: %s (attempt %s/%s); %s",
                    name, type(exc).__name__, exc, number, attempts, then,
                )
            else:
                return RewardOutcome(
                    reward=reward,
                    is_fallback=False,
                    attempts=number,
                    latency_s=trio.current_time() - start,
                )
        if failure == "raised":
            raise RewardError(
                f"reward function {name} raised {type(error).__name__}: {error} "
                f"(attempt {attempts}/{attempts})"
            ) from error
        if failure == "died":
            raise RewardError(
                f"the worker process running reward function {name} died "
                f"({error}) (attempt {attempts}/{attempts})"
            ) from error
        logger.warning(
            "reward function %s timed out after %s s on each of %s attempts; "
            "returning fallback reward %s",
            name, self.timeout_seconds, attempts, self.fallback_reward,
        )
        return RewardOutcome(
            reward=self.fallback_reward,
            is_fallback=True,
            attempts=attempts,
            latency_s=trio.current_time() - start,
        )


def _validate(
    max_workers: int,
    timeout_seconds: float,
    max_retries: int,
    fallback_reward: float,
    worker_type: str,
) -> None:
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be an int >= 1, got {max_workers!r}")
    if (
        isinstance(timeout_seconds, bool)
        or not isinstance(timeout_seconds, (int, float))
        or math.isnan(timeout_seconds)
        or timeout_seconds <= 0
    ):
        raise ValueError(
            f"timeout_seconds must be a positive number of seconds (math.inf for none), "
            f"got {timeout_seconds!r}"
        )
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
    if (
        isinstance(fallback_reward, bool)
        or not isinstance(fallback_reward, (int, float))
        or not math.isfinite(fallback_reward)
    ):
        raise ValueError(f"fallback_reward must be a finite number, got {fallback_reward!r}")
    if worker_type not in WORKER_TYPES:
        raise ValueError(f"worker_type must be one of {WORKER_TYPES}, got {worker_type!r}")


@asynccontextmanager
async def open_reward_pool(
    *,
    max_workers: int | None = None,
    timeout_seconds: float = 15.0,
    max_retries: int = 3,
    fallback_reward: float = 0.0,
    worker_type: str = "spawn",
) -> AsyncIterator[RewardPool]:
    """Open a :class:`RewardPool` whose workers live as long as the ``async with`` block.

    Args:
        max_workers: the most worker processes running at once; default
            :func:`default_max_workers`.
        timeout_seconds: seconds one attempt may run (``math.inf``: no limit).
        max_retries: retries after the first attempt (attempts = max_retries + 1).
        fallback_reward: the reward returned, flagged, after the last timeout.
        worker_type: ``"spawn"`` or ``"forkserver"`` (never fork: it can hang
            once torch is loaded in the parent).

    Raises:
        ValueError: an argument is out of range (the message names it).

    On exit the pool is closed (``score`` raises ``trio.ClosedResourceError``)
    and idle workers are shut down; exiting waits for running workers, so keep
    the tasks that call ``score`` inside the block.
    """
    if max_workers is None:
        max_workers = default_max_workers()
    _validate(max_workers, timeout_seconds, max_retries, fallback_reward, worker_type)
    async with trio_parallel.open_worker_context(
        worker_type=trio_parallel.WorkerType(worker_type)
    ) as context:
        pool = RewardPool(
            context=context,
            max_workers=max_workers,
            timeout_seconds=float(timeout_seconds),
            max_retries=max_retries,
            fallback_reward=float(fallback_reward),
            worker_type=worker_type,
        )
        try:
            yield pool
        finally:
            pool._closed = True
