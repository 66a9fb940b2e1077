"""``RewardPool``: killable reward worker processes with AReaL's timeout/retry policy.

The pool is assembled from parts, each in its own module:

* :mod:`rewards._options`: :class:`~rewards.RewardPoolOptions`, the settings
  and their defaults (AReaL's: 15 s per attempt, 3 retries, fallback 0.0,
  ``max(cpu_count // device_count // 2, 1)`` workers);
* :mod:`rewards._slots`: the worker slots and the kill-on-timeout job runner;
* :mod:`rewards._attempts`: one attempt in a worker, in a micro-batch
  (:mod:`rewards._batch`) or in-process (``async def`` rewards);
* :mod:`rewards._policy`: retries, the flagged fallback, deterministic errors;
* :mod:`rewards._stats`, :mod:`rewards._context`, :mod:`rewards._pickling`.

Where we differ from AReaL (**ours**):

* A timeout or a cancellation *kills* the worker process and every process the
  reward started, also those in a session of their own (:func:`rewards._worker.init_worker`,
  :mod:`rewards._proctree`); so does closing the pool or retiring a worker; AReaL only stops
  waiting, so one hung verifier holds a worker for the rest of the run (AReaL PR
  #1426, verl #6673).  Other calls keep flowing while one hangs.
* A worker that dies (``os._exit``, segfault, OOM kill) affects only the call it
  was running; that call is retried on a fresh worker.
* The timeout covers one attempt's execution, not the wait for a free worker nor
  the start of a fresh worker process (a "spawn" worker re-imports the parent's
  ``__main__``: seconds for a training script that imports torch; see
  :mod:`rewards._slots`).
* Fallbacks are flagged (:attr:`RewardOutcome.is_fallback`), counted
  (:meth:`RewardPool.statistics`) and can be collected per episode
  (:func:`~rewards.collect_reward_outcomes`).
* A return value that is not a finite real number, and a function or argument
  that cannot be pickled, raise :class:`~engine.errors.RewardError` at once.
* ``async def`` rewards run in-process under the same policy, without worker slots.
* Stateful :class:`~rewards.RewardActor` s: ``setup()`` once per worker process.
* Micro-batching of cheap sync rewards, adaptive and on by default.

While a pool's ``async with`` block is open, :func:`current_reward_pool` returns
it in that task and in tasks started from it afterwards (a context variable), so
that :class:`~rewards.AsyncRewardWrapper` finds the engine's pool.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio
import trio_parallel

from engine.errors import RewardError

from . import _worker
from ._attempts import Attempts, check_result
from ._batch import Batcher, BatchFailed
from ._board import JobBoard
from ._context import pool_in_context, record_outcome, using_pool
from ._options import RewardPoolOptions
from ._pickling import check_signature, describe_fn, is_async, pickle_job, reward_data
from ._policy import attempt_failed, give_up
from ._slots import WorkerSlots
from ._stats import Counters, RewardOutcome, RewardPoolStatistics

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["RewardPool", "current_reward_pool", "open_reward_pool", "serving"]

_NO_DATA: dict[str, Any] = {}  # a sync call's data once pickled (never mutated)


class RewardPool:
    """Scores completions with reward functions in killable worker processes.

    Create it with :func:`open_reward_pool`; do not instantiate it directly.
    Its settings are ``options`` (:class:`~rewards.RewardPoolOptions`, with
    ``max_workers`` resolved, also :attr:`max_workers`); ``worker_type`` is the
    options' for local workers, ``"ray"`` for the Ray pool.

    ``accepts_token_text``: :class:`~rewards.TokenText` arguments are decoded
    where the reward runs (in the worker, or in-process for ``async def``
    rewards), so callers may send token ids instead of text (a duck-typed pool
    without this attribute gets strings from :class:`~workflows.rlvr.RLVRWorkflow`).
    """

    accepts_token_text = True

    def __init__(self, options: RewardPoolOptions, slots: WorkerSlots, worker_type: str) -> None:
        self.options = options
        self.worker_type = worker_type
        self._slots = slots
        self._counters = slots.counters
        self._attempts = Attempts(slots)
        self._checked: dict[int, Any] = {}  # by check_reward_fn_once, by id (kept alive: ids stay unique)

    @property
    def max_workers(self) -> int:
        """The most worker processes (or Ray actors) running at once."""
        return self._slots.max_workers

    @property
    def closed(self) -> bool:
        """True once the pool's ``async with`` block has exited."""
        return self._slots.closed

    def statistics(self) -> RewardPoolStatistics:
        """Return a snapshot of the counters (also works after close)."""
        busy, idle = self._slots.worker_counts()
        return self._counters.snapshot(self.max_workers, busy, idle, 0 if self.closed else self._slots.starting)

    def score(
        self, reward_fn: Callable[..., Any], prompt: Any, completions: Any, prompt_ids: Any, completion_ids: Any,
        /, **data: Any,
    ) -> Coroutine[Any, Any, RewardOutcome]:
        """Compute ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data)``.

        A sync ``reward_fn`` runs in a worker process, an ``async def`` one
        in-process; a :class:`~rewards.RewardActor` is set up first where
        needed.  Each attempt gets ``timeout_seconds``; see :mod:`rewards._policy`
        for the retry policy.  Use as ``await pool.score(...)``: it returns the
        coroutine of :meth:`score_call` (no coroutine of its own in between).

        Returns:
            A :class:`RewardOutcome`; ``is_fallback`` is True if every attempt timed out.

        Raises:
            RewardError: the last attempt raised or its worker died, the function
                returned an invalid value, or it (or an argument) cannot be pickled,
                or unpickled in the worker.
            trio.Cancelled: the caller was cancelled; the worker was killed first.
            trio.ClosedResourceError: the pool's ``async with`` block has exited.
        """
        return self.score_call(reward_fn, (prompt, completions, prompt_ids, completion_ids), reward_data(data))

    async def score_call(
        self, reward_fn: Any, args: tuple, data: dict[str, Any], *,
        timeout_seconds: float | None = None, max_retries: int | None = None,
    ) -> RewardOutcome:
        """``reward_fn(*args, **data)`` under the pool's policy, or a per-call
        ``timeout_seconds`` / ``max_retries`` (:class:`~rewards.AsyncRewardWrapper`'s).

        Returns and raises as :meth:`score`.  Every attempt runs in this one
        coroutine (the policy's decisions are :func:`~rewards._policy.attempt_failed`
        and :func:`~rewards._policy.give_up`).
        """
        if self.closed:
            raise trio.ClosedResourceError("the reward pool is closed")
        timeout = self.options.timeout_seconds if timeout_seconds is None else timeout_seconds
        attempts = (self.options.max_retries if max_retries is None else max_retries) + 1
        counters, attempt = self._counters, self._attempts
        name = describe_fn(reward_fn)
        start = trio.current_time()
        counters.calls += 1
        counters.busy += 1
        try:
            job: bytes | None = None
            setup_timeout: float | None = None
            if not is_async(reward_fn):
                job, setup_timeout = pickle_job(reward_fn, name, args, data)
                args, data = (), _NO_DATA  # the job holds them: not kept alive while the reward runs
            number = 1
            while True:
                try:
                    if job is None:
                        reward = await attempt.in_process(reward_fn, name, args, data, timeout)
                    elif number == 1 and attempt.batcher is not None:
                        item = attempt.batcher.submit(job, timeout)
                        try:
                            await trio.lowlevel.wait_task_rescheduled(item)
                        except BaseException:  # cancelled: leave the queue (or the running batch)
                            await item.leave()
                            raise
                        try:
                            tag, value = item.outcome()
                        except BatchFailed:  # another call's hang or crash: run this one on its own
                            tag = _worker.NOT_SET_UP
                        if tag == _worker.NOT_SET_UP:  # (or an actor not set up there: alone, with setup)
                            reward = await attempt.in_worker(job, name, timeout, setup_timeout)
                        elif tag == _worker.RAISED:
                            raise value
                        else:
                            reward = check_result(tag, value, name)
                    else:
                        reward = await attempt.in_worker(job, name, timeout, setup_timeout)
                except Exception as exc:
                    failed = attempt_failed(exc, number, attempts, name, timeout, counters)
                    if failed is None:
                        raise
                    why, error = failed
                    if number == attempts:
                        outcome = give_up(why, error, attempts, name=name, start=start, timeout_seconds=timeout,
                                          fallback_reward=self.options.fallback_reward)
                        break
                    number += 1
                    counters.retries += 1
                else:
                    outcome = RewardOutcome(reward=reward, is_fallback=False, attempts=number,
                                            latency_s=trio.current_time() - start)
                    break
        except RewardError:
            counters.errors += 1
            raise
        except trio.Cancelled:
            counters.cancelled += 1
            raise
        finally:
            counters.busy -= 1
        if outcome.is_fallback:
            counters.fallbacks += 1
        else:
            counters.successes += 1
            counters.latencies.append(outcome.latency_s)
        record_outcome(outcome)
        return outcome

    async def check_reward_fn(self, reward_fn: Any, data: dict[str, Any] | None = None) -> None:
        """Check ``reward_fn`` before any episode runs (not counted as a call).

        Checks, in order: it is callable; if ``data`` (a dataset item) is given, it
        can be called as ``reward_fn(prompt, completions, prompt_ids,
        completion_ids, **data)`` (its signature binds those arguments); a sync
        function (or actor) can be pickled, and unpickled in a worker process of
        this pool (its module is importable there, or its file loads there:
        :mod:`rewards._shipping`).  An ``async def`` one runs
        in-process and needs no worker.

        Raises:
            RewardError: naming the function and what is wrong.
            trio.ClosedResourceError: the pool is closed.
        """
        if self.closed:
            raise trio.ClosedResourceError("the reward pool is closed")
        if not callable(reward_fn):
            raise RewardError(f"reward function {reward_fn!r} is not callable")
        name = describe_fn(reward_fn)
        if data is not None:
            check_signature(reward_fn, name, reward_data(data))
        if is_async(reward_fn):
            return
        job, _ = pickle_job(reward_fn, name, (), {})
        await self._attempts.load(job, name, timeout=max(self.options.timeout_seconds, 60.0))


    async def check_reward_fn_once(self, reward_fn: Any) -> None:
        """:meth:`check_reward_fn` without data, once per pool and function object (a
        check that passed is not repeated).  The engine calls it for the reward
        functions of a workflow in ``rollout_batch`` and ``prepare_batch`` before it
        submits anything, so that a reward that cannot run in a worker is one error
        before any episode (issue 24).

        Raises:
            RewardError: naming the function and what is wrong.
            trio.ClosedResourceError: the pool is closed.
        """
        if self._checked.get(id(reward_fn)) is not reward_fn:
            await self.check_reward_fn(reward_fn)
            self._checked[id(reward_fn)] = reward_fn


def current_reward_pool() -> RewardPool | None:
    """The innermost open :class:`RewardPool` of this task's context, or None.

    Set by :func:`open_reward_pool` (so also by ``open_rollout_engine``) for the
    task that opened it and every task started from it while it is open.
    """
    pool = pool_in_context()
    return pool if isinstance(pool, RewardPool) and not pool.closed else None


@asynccontextmanager
async def open_reward_pool(options: RewardPoolOptions | None = None, /, **overrides: Any) -> AsyncIterator[RewardPool]:
    """Open a :class:`RewardPool` whose workers live as long as the ``async with`` block.

    Args:
        options: the settings (:class:`~rewards.RewardPoolOptions`; default
            ``RewardPoolOptions()``: AReaL's policy, adaptive micro-batching).
        overrides: fields of ``options`` by keyword (``max_workers=4,
            timeout_seconds=5.0``), applied on top of ``options``.

    Raises:
        ValueError: an option is out of range (the message names it).
        TypeError: a keyword names no option.

    On exit the pool is closed (``score`` raises ``trio.ClosedResourceError``),
    running batches are killed and the worker processes are shut down and
    reaped; exiting waits for running worker jobs, so keep the tasks that call
    ``score`` inside the block.
    """
    options = (options or RewardPoolOptions()).with_changes("open_reward_pool", **overrides).resolved()
    assert options.max_workers is not None
    board = JobBoard(options.max_workers)  # each running job's progress (rewards._board)
    try:
        async with trio_parallel.open_worker_context(
            worker_type=trio_parallel.WorkerType(options.worker_type),
            init=functools.partial(_worker.init_worker, board.path, subreaper=True),
            retire=_worker.retire_worker,
        ) as context:
            slots = WorkerSlots(context, options.max_workers, Counters(), board)
            async with serving(RewardPool(options, slots, options.worker_type)) as pool:
                yield pool
    finally:
        board.close()  # the workers have exited


_Pool = TypeVar("_Pool", bound=RewardPool)


@asynccontextmanager
async def serving(pool: _Pool) -> AsyncIterator[_Pool]:
    """Make ``pool`` the current pool (:func:`current_reward_pool`) for the block, with
    its batcher running when ``pool.options.batch_size > 1``; closed on exit.  Shared by every
    pool opener (local processes, Ray actors)."""
    try:
        with using_pool(pool):
            if pool.options.batch_size == 1:
                yield pool
            else:
                async with _batching(pool):
                    yield pool
    finally:
        pool._slots.closed = True


@asynccontextmanager
async def _batching(pool: RewardPool) -> AsyncIterator[None]:
    """Run ``pool``'s batcher task for the block; cancel it (killing running
    batches) on exit.  The nursery is hidden: a single exception from the body
    comes out unwrapped, as it does without batching."""
    try:
        async with trio.open_nursery() as nursery:
            batcher = Batcher(pool._slots, nursery, pool.options.batch_size, pool.options.max_batch_delay_s)
            pool._attempts.batcher = batcher
            nursery.start_soon(batcher.loop)
            try:
                yield
            finally:
                pool._slots.closed = True
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
