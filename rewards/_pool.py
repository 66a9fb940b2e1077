"""A pool of killable reward worker processes with AReaL's timeout/retry policy.

The policy follows AReaL's ``AsyncRewardWrapper`` (``areal/api/reward_api.py``):
a timeout of ``timeout_seconds=15`` s per attempt, ``max_retries=3`` retries (so
up to 4 attempts), workers defaulting to ``max(cpu_count // device_count // 2, 1)``,
a fallback reward of ``0.0`` with a warning after the last timed-out attempt, and
a user exception re-raised after the last attempt (never turned into a reward).

Where we differ (**ours**):

* A timeout or a cancellation *kills* the worker process (trio-parallel's
  ``kill_on_cancel``) and every process the reward started: each worker leads
  its own process group, killed as a whole when the worker dies or exits, or
  when the engine process dies (:func:`rewards._worker.init_worker`).  AReaL only stops waiting, so one hung verifier holds a
  worker for the rest of the run (AReaL PR #1426, verl #6673).  Other calls keep
  flowing while one hangs.
* A worker that dies (``os._exit``, segfault, OOM kill) affects only the call it
  was running; that call is retried on a fresh worker.  If the last attempt's
  worker dies too, the call raises :class:`~engine.errors.RewardError` (AReaL
  re-raises ``BrokenProcessPool`` on the last attempt too).
* The timeout covers one attempt's execution (including starting a fresh worker
  process, about 0.2-1 s for "spawn"), not the wait for a free worker: AReaL's
  ``asyncio.wait_for`` also counts time queued behind busy workers.
* Fallbacks are flagged (:attr:`RewardOutcome.is_fallback`), counted
  (:meth:`RewardPool.statistics`) and can be collected per episode
  (:func:`collect_reward_outcomes`).
* A return value that is not a finite real number, and a function or argument
  that cannot be pickled, raise :class:`~engine.errors.RewardError` at once
  (deterministic, so never retried).
* ``async def`` reward functions (I/O-bound judges) run in-process as trio calls
  under the same timeout/retry/fallback policy; they do not take worker slots.
* Stateful :class:`~rewards.RewardActor` s: ``setup()`` once per worker process,
  under its own ``setup_timeout_seconds`` (see :mod:`rewards._actor`).
* Micro-batching of cheap sync rewards, adaptive and on by default (``batch_size``): see
  :mod:`rewards._batch`.

Timeouts, worker deaths and exceptions are retried, up to ``max_retries``
times; the failure of the *last* attempt decides the result: a timeout gives the
flagged fallback, a death or an exception raises.  **Ours**: an exception that
cannot go away on retry -- one of :data:`DETERMINISTIC_ERRORS` (``TypeError``
from a wrong signature, ``KeyError``/``IndexError`` for missing data,
``AttributeError``, ``NameError``, ``ImportError``, ``NotImplementedError``,
``SyntaxError``) -- raises at once, without retries (AReaL retries every
exception).  Timeouts, dead workers and other exceptions (``OSError``,
``ValueError``, ``RuntimeError``: an I/O-bound judge may recover) keep the
retries.

:meth:`RewardPool.check_reward_fn` checks a reward function at start-up, before
any episode runs: callable, callable with the reward signature and a data row's
keys, picklable, and importable in a spawned worker.

Exceptions raised by :meth:`RewardPool.score`:

* :class:`~engine.errors.RewardError`: the last attempt raised or its worker
  died, the function returned an invalid value, or it (or an argument) cannot be
  pickled, or unpickled in the worker.
* ``trio.Cancelled``: the caller was cancelled; the worker was killed first.
* ``trio.ClosedResourceError``: the pool's ``async with`` block has exited.

While a pool's ``async with`` block is open, :func:`current_reward_pool` returns
it in that task and in tasks started from it afterwards (a context variable), so
that :class:`~rewards.AsyncRewardWrapper` finds the engine's pool.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import math
import os
import pickle
import sys
import types
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pickle import HIGHEST_PROTOCOL
from typing import Any

import trio
import trio_parallel

from engine.errors import RewardError

from . import _worker
from ._actor import RewardActor
from ._batch import DEFAULT_BATCH_SIZE, Batcher, BatchFailed
from ._outcome import (
    _COLLECTOR,
    _CURRENT_POOL,
    RewardOutcome,
    RewardPoolStatistics,
    _percentile,
    collect_reward_outcomes,
    current_reward_pool,
)

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

try:  # mirror trio-parallel: cloudpickle when installed (lambdas, __main__), else pickle
    from cloudpickle import dumps as _cloud_dumps
except ImportError:  # pragma: no cover - cloudpickle comes with tensordict
    from pickle import dumps as _cloud_dumps


def _dumps(obj: Any, protocol: int = HIGHEST_PROTOCOL) -> bytes:
    """Pickle ``obj`` for a worker: plain pickle (twice as fast) when it can do
    it without naming ``__main__``, else cloudpickle (by value: lambdas, nested
    functions, things defined in ``__main__``)."""
    try:
        data = pickle.dumps(obj, protocol=protocol)
    except Exception:
        return _cloud_dumps(obj, protocol=protocol)
    if b"__main__" in data:  # a spawn worker may have no such module to load it from
        return _cloud_dumps(obj, protocol=protocol)
    return data

__all__ = [
    "DETERMINISTIC_ERRORS",
    "RewardOutcome",
    "RewardPool",
    "RewardPoolStatistics",
    "collect_reward_outcomes",
    "current_reward_pool",
    "default_max_workers",
    "open_reward_pool",
    "serving",
]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

WORKER_TYPES = ("spawn", "forkserver")  # never "fork": it hangs once torch is loaded

#: Exceptions a reward function raises the same way on every attempt (a bug or a
#: data row without a key the function needs): raised at once, never retried.
DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, LookupError, AttributeError, NameError, ImportError, NotImplementedError, SyntaxError,
)
LATENCY_WINDOW = 4096  # successful calls kept for the latency percentiles
#: the reward function's positional parameters; dataset keys of the same name (a ``prompt``
#: column) are not passed again as keywords, which would raise "multiple values for argument"
REWARD_POSITIONAL = frozenset({"prompt", "completions", "prompt_ids", "completion_ids"})


def reward_data(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys that name the reward function's positional parameters."""
    if REWARD_POSITIONAL.isdisjoint(data):
        return data
    return {k: v for k, v in data.items() if k not in REWARD_POSITIONAL}



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
    target = fn if hasattr(fn, "__qualname__") else type(fn)  # an instance: its class
    qualname = getattr(target, "__qualname__", None)
    if qualname is None:
        return repr(fn)
    module = getattr(target, "__module__", None)
    return f"{module}.{qualname}" if module else qualname


def _is_async(fn: Any) -> bool:
    if type(fn) is types.FunctionType and not fn.__dict__:  # fast path: a plain function
        return bool(fn.__code__.co_flags & inspect.CO_COROUTINE)  # (no markcoroutinefunction)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)
    )


class _Timeout(Exception):
    """Internal: one attempt ran past ``timeout_seconds``."""


class _NoLimit:
    """A no-op stand-in for trio-parallel's limiter (it only uses ``async with``).

    The pool holds its own limiter around the timeout, so that waiting for a
    worker slot is not timed; a second, real limiter would only add two
    scheduler round trips per call.
    """

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
        return None


class RewardPool:
    """Scores completions with reward functions in killable worker processes.

    Create it with :func:`open_reward_pool`; do not instantiate it directly.

    ``accepts_token_text``: :class:`~rewards.TokenText` arguments are decoded
    where the reward runs (in the worker, or in-process for ``async def``
    rewards), so callers may send token ids instead of text (a duck-typed pool
    without this attribute gets strings from :class:`~workflows.rlvr.RLVRWorkflow`).
    """

    accepts_token_text = True

    def __init__(
        self,
        *,
        context: trio_parallel.WorkerContext,
        max_workers: int,
        timeout_seconds: float,
        max_retries: int,
        fallback_reward: float,
        worker_type: str,
        batch_size: int = 1,
        max_batch_delay_s: float = 0.0,
    ) -> None:
        self._ctx = context
        self.max_workers = max_workers
        self.timeout_seconds = timeout_seconds
        self.max_retries = max_retries
        self.fallback_reward = fallback_reward
        self.worker_type = worker_type
        self.batch_size = batch_size
        self.max_batch_delay_s = max_batch_delay_s
        self._limiter = trio.CapacityLimiter(max_workers)  # worker slots
        self._unlimited = _NoLimit()  # our limiter is held instead, outside the timeout
        self._batcher: Batcher | None = None  # set by open_reward_pool if batch_size > 1
        self._closed = False
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._calls = self._successes = self._timeouts = self._retries = 0
        self._fallbacks = self._errors = self._worker_deaths = self._cancelled = 0
        self._workers_killed = self._batches = self._batch_failures = self._batched_calls = 0
        self._busy = 0
        self._local_actors: dict[str, trio.Lock | None] = {}  # async actors set up here

    def statistics(self) -> RewardPoolStatistics:
        """Return a snapshot of the counters (also works after close)."""
        latencies = sorted(self._latencies)
        workers = self._ctx.statistics() if not self._closed else None
        return RewardPoolStatistics(
            calls=self._calls,
            successes=self._successes,
            timeouts=self._timeouts,
            retries=self._retries,
            fallbacks=self._fallbacks,
            errors=self._errors,
            worker_deaths=self._worker_deaths,
            workers_killed=self._workers_killed,
            worker_restarts=self._worker_deaths + self._workers_killed,
            cancelled=self._cancelled,
            busy=self._busy,
            workers_busy=workers.running_workers if workers else 0,
            workers_idle=workers.idle_workers if workers else 0,
            max_workers=self.max_workers,
            batches=self._batches,
            batched_calls=self._batched_calls,
            batch_failures=self._batch_failures,
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
        in-process; a :class:`~rewards.RewardActor` is set up first where
        needed.  Each attempt gets ``timeout_seconds``; see the module
        docstring for the retry policy.

        Returns:
            A :class:`RewardOutcome`; ``is_fallback`` is True if every attempt
            timed out.

        Raises:
            RewardError: see the module docstring.
            trio.ClosedResourceError: the pool is closed.
        """
        return await self._score(
            reward_fn,
            (prompt, completions, prompt_ids, completion_ids),
            reward_data(data),
            self.timeout_seconds,
            self.max_retries,
        )

    async def _score(
        self,
        reward_fn: Any,
        args: tuple,
        data: dict,
        timeout_seconds: float,
        max_retries: int,
    ) -> RewardOutcome:
        """:meth:`score` with a per-call policy (used by AsyncRewardWrapper)."""
        if self._closed:
            raise trio.ClosedResourceError("the reward pool is closed")
        name = _describe_fn(reward_fn)
        start = trio.current_time()
        self._calls += 1
        self._busy += 1
        try:
            if _is_async(reward_fn):
                attempt = functools.partial(
                    self._attempt_async, reward_fn, name, args, data, timeout_seconds
                )
                first = attempt
            else:
                job, setup_timeout = self._pickle_job(reward_fn, name, args, data)
                attempt = functools.partial(
                    self._attempt_in_worker, job, name, timeout_seconds, setup_timeout
                )
                first = attempt
                if self._batcher is not None:
                    first = functools.partial(
                        self._attempt_batched, job, name, timeout_seconds, setup_timeout
                    )
            outcome = await self._run_with_policy(
                first, attempt, name, start, timeout_seconds, max_retries
            )
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
        collector = _COLLECTOR.get()
        if collector is not None:
            collector.append(outcome)
        return outcome

    async def check_reward_fn(self, reward_fn: Any, data: dict[str, Any] | None = None) -> None:
        """Check ``reward_fn`` before any episode runs (not counted as a call).

        Checks, in order: it is callable; if ``data`` (a dataset item) is given, it
        can be called as ``reward_fn(prompt, completions, prompt_ids,
        completion_ids, **data)`` (its signature binds those arguments); a sync
        function (or actor) can be pickled, and unpickled in a worker process of
        this pool (its module is importable there).  An ``async def`` one runs
        in-process and needs no worker.

        Raises:
            RewardError: naming the function and what is wrong.
            trio.ClosedResourceError: the pool is closed.
        """
        if self._closed:
            raise trio.ClosedResourceError("the reward pool is closed")
        if not callable(reward_fn):
            raise RewardError(f"reward function {reward_fn!r} is not callable")
        name = _describe_fn(reward_fn)
        if data is not None:
            data = reward_data(data)
            try:
                signature = inspect.signature(reward_fn)
            except (TypeError, ValueError):  # a builtin without a signature: nothing to check
                signature = None
            if signature is not None:
                try:
                    signature.bind("prompt", "completions", [], [], **data)
                except TypeError as exc:
                    raise RewardError(
                        f"reward function {name} cannot be called as {name.rsplit('.', 1)[-1]}(prompt, "
                        f"completions, prompt_ids, completion_ids, **data) with data keys {sorted(data)}: {exc}"
                    ) from None
        if _is_async(reward_fn):
            return
        job, _ = self._pickle_job(reward_fn, name, (), {})
        async with self._limiter:
            tag, value = await self._run_job(_worker.load_job, job, timeout=max(self.timeout_seconds, 60.0))
        self._check(tag, value, name)

    @staticmethod
    def _pickle_job(fn: Any, name: str, args: tuple, data: dict) -> tuple[bytes, float | None]:
        """The job's bytes, and the actor's setup timeout (None: not an actor)."""
        setup_timeout = None
        try:
            if isinstance(fn, RewardActor):
                setup_timeout = float(fn.setup_timeout_seconds)
                payload = _dumps(fn, protocol=HIGHEST_PROTOCOL)
                fn = _worker.ActorRef(fn.actor_key, payload)
            return _dumps((fn, args, data), protocol=HIGHEST_PROTOCOL), setup_timeout
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
                "create a RewardActor's unpicklable state in setup(), "
                "or use an 'async def' reward function, which runs in-process)"
            ) from exc

    async def _run_job(self, function: Any, *args: Any, timeout: float) -> Any:
        """``function(*args)`` in a worker (slot already held); kill it on timeout.

        Raises:
            _Timeout: the job ran past ``timeout``; its worker was killed.
            trio_parallel.BrokenWorkerError: the worker died.
        """
        try:
            with trio.move_on_after(timeout) as scope:
                return await self._ctx.run_sync(
                    function, *args, kill_on_cancel=True, limiter=self._unlimited
                )
        except trio.Cancelled:
            self._workers_killed += 1
            raise
        except trio_parallel.BrokenWorkerError:
            self._worker_deaths += 1
            raise
        assert scope.cancelled_caught
        self._workers_killed += 1
        raise _Timeout

    def _check(self, tag: str, value: Any, name: str) -> float:
        if tag == _worker.LOAD_FAILED:
            raise RewardError(
                f"reward function {name} or its arguments could not be unpickled in the "
                f"worker process: {value} (is its module importable there?)"
            )
        if tag == _worker.INVALID:
            raise RewardError(f"reward function {name} returned {value}")
        assert tag == _worker.OK, tag
        return value

    async def _attempt_in_worker(
        self, job: bytes, name: str, timeout: float, setup_timeout: float | None
    ) -> float:
        try:  # the slot is held outside the timeout: queueing is not timed
            self._limiter.acquire_nowait()  # fast path: no scheduler round trip
        except trio.WouldBlock:
            await self._limiter.acquire()
        try:
            if setup_timeout is None:
                tag, value = await self._run_job(_worker.run_job, job, timeout=timeout)
            else:  # an actor: the call alone, then, if not set up there, setup + call
                tag, value = await self._run_job(_worker.run_job, job, False, timeout=timeout)
                if tag == _worker.NOT_SET_UP:
                    tag, value = await self._run_job(
                        _worker.run_job, job, True, timeout=setup_timeout + timeout
                    )
        finally:
            self._limiter.release()
        return self._check(tag, value, name)

    async def _attempt_batched(
        self, job: bytes, name: str, timeout: float, setup_timeout: float | None
    ) -> float:
        assert self._batcher is not None
        try:
            tag, value = await self._batcher.run(job, timeout)
        except BatchFailed:  # another call's hang or crash: run this one on its own
            return await self._attempt_in_worker(job, name, timeout, setup_timeout)
        if tag == _worker.NOT_SET_UP:
            return await self._attempt_in_worker(job, name, timeout, setup_timeout)
        if tag == _worker.RAISED:
            raise value
        return self._check(tag, value, name)

    async def _attempt_async(
        self, fn: Any, name: str, args: tuple, data: dict, timeout: float
    ) -> float:
        if isinstance(fn, RewardActor):
            await self._setup_local_actor(fn)
        with trio.move_on_after(timeout) as scope:
            tag, value = _worker.as_reward(await fn(*_worker.resolve_texts(args), **data))
        if scope.cancelled_caught:
            raise _Timeout
        if tag == _worker.INVALID:
            raise RewardError(f"reward function {name} returned {value}")
        return value

    async def _setup_local_actor(self, actor: RewardActor) -> None:
        """Run an in-process actor's setup() once per pool (sync or async)."""
        key = actor.actor_key
        if key in self._local_actors and self._local_actors[key] is None:
            return  # set up
        lock = self._local_actors.setdefault(key, trio.Lock())
        async with lock:
            if self._local_actors.get(key) is None:
                return  # set up by a concurrent call while we waited
            with trio.move_on_after(float(actor.setup_timeout_seconds)) as scope:
                result = actor.setup()
                if inspect.isawaitable(result):
                    await result
            if scope.cancelled_caught:
                raise _Timeout
            self._local_actors[key] = None

    async def _run_with_policy(
        self,
        first: Callable[[], Any],
        attempt: Callable[[], Any],
        name: str,
        start: float,
        timeout_seconds: float,
        max_retries: int,
    ) -> RewardOutcome:
        attempts = max_retries + 1
        failure, error = "timeout", None  # why the latest attempt failed
        for number in range(1, attempts + 1):
            if number > 1:
                self._retries += 1
            last = number == attempts
            then = "giving up" if last else "retrying"
            try:
                reward = await (first if number == 1 else attempt)()
            except _Timeout:
                self._timeouts += 1
                failure, error = "timeout", None
                if not last:
                    logger.warning(
                        "reward function %s timed out after %s s (attempt %s/%s); "
                        "worker killed; retrying",
                        name, timeout_seconds, number, attempts,
                    )
            except trio_parallel.BrokenWorkerError as exc:
                failure, error = "died", exc
                logger.warning(
                    "worker process died while running reward function %s "
                    "(attempt %s/%s): %s; %s",
                    name, number, attempts, exc, then,
                )
            except (RewardError, trio.ClosedResourceError):
                raise  # deterministic: invalid value, unpicklable job, closed pool
            except DETERMINISTIC_ERRORS as exc:  # raised by the user's function, the same on every attempt
                raise RewardError(
                    f"reward function {name} raised {type(exc).__name__}: {exc} (attempt {number}/{attempts}; "
                    f"not retried: a {type(exc).__name__} does not go away on retry)"
                ) from exc
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
            name, timeout_seconds, attempts, self.fallback_reward,
        )
        return RewardOutcome(
            reward=self.fallback_reward,
            is_fallback=True,
            attempts=attempts,
            latency_s=trio.current_time() - start,
        )


def _check_seconds(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(
            f"{name} must be {kind} number of seconds (math.inf for none), got {value!r}"
        )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _validate(
    max_workers: int,
    timeout_seconds: float,
    max_retries: int,
    fallback_reward: float,
    worker_type: str,
    batch_size: int = 1,
    max_batch_delay_s: float = 0.0,
) -> None:
    _check_int("max_workers", max_workers, 1)
    _check_seconds("timeout_seconds", timeout_seconds)
    _check_int("max_retries", max_retries, 0)
    if (
        isinstance(fallback_reward, bool)
        or not isinstance(fallback_reward, (int, float))
        or not math.isfinite(fallback_reward)
    ):
        raise ValueError(f"fallback_reward must be a finite number, got {fallback_reward!r}")
    if worker_type not in WORKER_TYPES:
        raise ValueError(f"worker_type must be one of {WORKER_TYPES}, got {worker_type!r}")
    _check_int("batch_size", batch_size, 1)
    _check_seconds("max_batch_delay_s", max_batch_delay_s, allow_zero=True)
    if math.isinf(max_batch_delay_s):
        raise ValueError(f"max_batch_delay_s must be finite, got {max_batch_delay_s!r}")


@asynccontextmanager
async def open_reward_pool(
    *,
    max_workers: int | None = None,
    timeout_seconds: float = 15.0,
    max_retries: int = 3,
    fallback_reward: float = 0.0,
    worker_type: str = "spawn",
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_batch_delay_s: float = 0.0,
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
        batch_size: the most sync calls sent to a worker in one job (1: no
            micro-batching; default :data:`rewards._batch.DEFAULT_BATCH_SIZE`).
            Batches adapt below it: a call that finds a worker free goes at
            once, alone; under load a job takes what waits, split over the free
            workers and capped at ~20 ms of measured reward work (slow rewards
            run alone).  See :mod:`rewards._batch`.
        max_batch_delay_s: how long a batch may wait for more calls once a
            worker is free (0, the default: take what is queued and go).

    Raises:
        ValueError: an argument is out of range (the message names it).

    On exit the pool is closed (``score`` raises ``trio.ClosedResourceError``),
    running batches are killed and the worker processes are shut down and
    reaped; exiting waits for running worker jobs, so keep the tasks that call
    ``score`` inside the block.
    """
    if max_workers is None:
        max_workers = default_max_workers()
    _validate(
        max_workers, timeout_seconds, max_retries, fallback_reward, worker_type,
        batch_size, max_batch_delay_s,
    )
    async with trio_parallel.open_worker_context(
        worker_type=trio_parallel.WorkerType(worker_type), init=_worker.init_worker
    ) as context:
        pool = RewardPool(
            context=context,
            max_workers=max_workers,
            timeout_seconds=float(timeout_seconds),
            max_retries=max_retries,
            fallback_reward=float(fallback_reward),
            worker_type=worker_type,
            batch_size=batch_size,
            max_batch_delay_s=float(max_batch_delay_s),
        )
        async with serving(pool) as served:
            yield served


@asynccontextmanager
async def serving(pool: RewardPool) -> AsyncIterator[RewardPool]:
    """Make ``pool`` the current pool (:func:`current_reward_pool`) for the block, with
    its batcher running when ``pool.batch_size > 1``; closed on exit.  Shared by every
    pool opener (local processes, Ray actors)."""
    token = _CURRENT_POOL.set(pool)
    try:
        if pool.batch_size == 1:
            yield pool
        else:
            async with _batching(pool) as batching_pool:
                yield batching_pool
    finally:
        pool._closed = True
        try:
            _CURRENT_POOL.reset(token)
        except ValueError:  # exited in another context than it was entered in
            pass


@asynccontextmanager
async def _batching(pool: RewardPool) -> AsyncIterator[RewardPool]:
    """Run ``pool``'s batcher task for the block; cancel it (killing running
    batches) on exit.  The nursery is hidden: a single exception from the body
    comes out unwrapped, as it does without batching."""
    try:
        async with trio.open_nursery() as nursery:
            pool._batcher = Batcher(pool, nursery, pool.batch_size, pool.max_batch_delay_s)
            nursery.start_soon(pool._batcher.loop)
            try:
                yield pool
            finally:
                pool._closed = True
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
