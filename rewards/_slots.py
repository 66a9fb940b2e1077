"""``WorkerSlots``: the reward pool's worker capacity and its kill-on-timeout job runner.

A pool has ``max_workers`` slots (a ``trio.CapacityLimiter``).  A caller holds a
slot around a job, *outside* the job's timeout, so waiting for a free worker is
not timed (AReaL's ``asyncio.wait_for`` also counts time queued behind busy
workers; **ours** does not).  :meth:`WorkerSlots.run_job` runs one job in a
trio-parallel worker under ``timeout``; past it, or when the caller is
cancelled, the worker process is killed (``kill_on_cancel``) and a fresh one
replaces it at the next job.  Both the pool's unbatched attempts
(:mod:`rewards._attempts`) and the batcher (:mod:`rewards._batch`) run their
jobs here; the Ray pool replaces :meth:`~WorkerSlots.run_job` with Ray actors
(:mod:`rewards._ray_pool`).

Starting a worker process is not timed (as for Ray actors): when no idle worker
is left, :meth:`WorkerSlots.run_job` first starts one with a no-op job under
:data:`WORKER_START_TIMEOUT_S`.  A "spawn" worker re-imports the parent's
``__main__`` module (a training script importing torch and transformers: seconds
on a busy CPU), so timing the start made a short timeout kill every fresh
worker before its first call, forever.

Process trees (issue 24): a local pool's workers are child subreapers
(:mod:`rewards._proctree`), so every process a reward started, also one in its
own session, stays below its worker.  trio-parallel kills a worker with
``Process.kill()`` (``kill_on_cancel``: a timeout or a cancellation; and a
worker that does not exit within the grace period at close).  Each worker this
pool starts (:meth:`WorkerSlots._start_worker` learns its pid) gets that kill
wrapped (:class:`_TreeKill`, on its own ``multiprocessing.Process`` object
only): first the whole tree below the worker is frozen and killed, then the
worker, as before.  Nothing else in this process changes.  Every local job runs
as the holder of a ticket on the pool's job board (:mod:`rewards._board`), which
also says when a worker retires (too many zombies: see
:func:`rewards._worker.retire_worker`): the next job first starts a replacement,
so that no worker trio-parallel starts on its own escapes the wrapping.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from typing import Any

import trio
import trio_parallel

from . import _proctree, _worker
from ._board import JobBoard, Progress
from ._stats import Counters

__all__ = ["WORKER_START_TIMEOUT_S", "BatchInterrupted", "JobTimeout", "WorkerSlots"]

#: Seconds a fresh worker process may take to start (not part of any call's timeout).
WORKER_START_TIMEOUT_S = 120.0


class JobTimeout(Exception):
    """One job (an attempt) ran past its timeout; its worker was killed."""


class BatchInterrupted(Exception):
    """A batch job (:meth:`WorkerSlots.run_batch`) ended without its results.

    Attributes:
        cause: why: :class:`JobTimeout` (its worker was killed),
            ``trio_parallel.BrokenWorkerError`` (its worker died), or what else the
            job raised (a result that could not be sent back).
        progress: how far the batch got (:class:`~rewards._board.Progress`), or None
            where the workers keep no board (Ray actors).
    """

    def __init__(self, cause: Exception, progress: Progress | None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.progress = progress


class _TreeKill:
    """A worker process's ``kill``: freeze and kill every process below it (see the
    module docstring), then kill it with the original ``kill``.  Never raises."""

    __slots__ = ("kill", "pid")

    def __init__(self, kill: Any, pid: int) -> None:
        self.kill = kill
        self.pid = pid

    def __call__(self) -> None:
        try:
            _proctree.kill_tree(self.pid, stop_root=True)
        finally:
            self.kill()


def _wrap_kill(pid: int) -> None:
    """Give the worker process ``pid`` (started by this process) a :class:`_TreeKill`."""
    for proc in multiprocessing.active_children():
        if proc.pid == pid and not isinstance(proc.__dict__.get("kill"), _TreeKill):
            proc.kill = _TreeKill(proc.kill, pid)  # type: ignore[method-assign]  # this object only


class _NoLimit:
    """A no-op stand-in for trio-parallel's limiter (it only uses ``async with``).

    The slots' own limiter is held around the timeout, so that waiting for a
    worker slot is not timed; a second, real limiter would only add two
    scheduler round trips per call.
    """

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info: object) -> None:
        return None


class WorkerSlots:
    """``max_workers`` worker slots over a trio-parallel worker context.

    Args:
        context: the worker processes (None for a subclass that brings its own
            workers and overrides :meth:`run_job`).
        max_workers: slots, i.e. jobs running at once (>= 1).
        counters: where ``worker_deaths`` and ``workers_killed`` are counted (the
            pool's; the batcher counts its batches there too).

    Attributes:
        limiter: the slots; hold one around :meth:`run_job` (:meth:`acquire` /
            :meth:`release`, or ``acquire_on_behalf_of`` for a batch).
        closed: set when the pool closes (a Ray worker is then not kept).
        starting: workers being started now (:meth:`_start_worker`).
    """

    def __init__(self, context: trio_parallel.WorkerContext | None, max_workers: int, counters: Counters,
                 board: JobBoard | None = None) -> None:
        self._ctx = context
        self.board = board
        self.max_workers = max_workers
        self.counters = counters
        self.limiter = trio.CapacityLimiter(max_workers)
        self.closed = False
        self.starting = 0
        self._unlimited = _NoLimit()  # our limiter is held instead, outside the timeout
        self._retired = 0  # workers that said they retire: each next job starts a replacement first

    async def acquire(self) -> None:
        """Take a slot (no schedule point when one is free)."""
        try:
            self.limiter.acquire_nowait()
        except trio.WouldBlock:
            await self.limiter.acquire()

    def release(self) -> None:
        """Give back the slot this task took with :meth:`acquire`."""
        self.limiter.release()

    async def run(self, function: Any, *args: Any, timeout: float) -> Any:
        """:meth:`run_job` holding a slot for it (the wait for the slot is not timed)."""
        await self.acquire()
        try:
            return await self.run_job(function, *args, timeout=timeout)
        finally:
            self.release()

    async def run_batch(
        self, jobs: list[bytes], timeout: float, nursery: trio.Nursery
    ) -> tuple[list[tuple[str, Any]], float]:
        """:func:`rewards._worker.run_batch` over ``jobs`` in a worker (the caller
        holds a slot), recording its progress on the board.

        Each call gets ``timeout`` seconds of its own: the job is killed once the
        call running in it has run ``timeout`` seconds (a watchdog task in
        ``nursery`` reads when that call started from the board), so the calls
        before it never eat into its time.  Without a board (Ray actors) the whole
        job gets ``timeout``.

        Returns:
            ``(results, work_s)``: one tagged result per job, and the seconds they took.

        Raises:
            BatchInterrupted: the job timed out, its worker died, or its results could
                not be sent back; with what the batch recorded before.
            trio.Cancelled: the caller was cancelled; the worker was killed first.
        """
        board = self.board
        ticket = None if board is None else board.take()
        if board is None or ticket is None:  # no board (Ray actors): no progress either
            try:
                return await self.run_job(_worker.run_batch, jobs, timeout=timeout)
            except Exception as exc:
                raise BatchInterrupted(exc, None) from exc
        try:
            if len(jobs) == 1:
                return await self._run_ticketed(ticket, _worker.run_batch, jobs, timeout=timeout)
            await self._ensure_worker()  # (a worker's start is not timed)
            kill, watching = trio.CancelScope(), trio.CancelScope()
            nursery.start_soon(self._watch, ticket, timeout, kill, watching)
            try:
                with kill:
                    return await self._run_started(
                        _worker.run_ticketed, ticket, _worker.run_batch, jobs, timeout=math.inf
                    )
            finally:
                watching.cancel()
            raise JobTimeout
        except Exception as exc:
            raise BatchInterrupted(exc, board.progress(ticket)) from exc
        finally:
            self._retired += board.retiring(ticket)
            board.give(ticket)

    async def _watch(self, ticket: int, timeout: float, kill: trio.CancelScope, watching: trio.CancelScope) -> None:
        """Cancel ``kill`` once the call running in ``ticket``'s batch has run
        ``timeout`` seconds (time.monotonic, as the worker records it)."""
        assert self.board is not None
        with watching:
            deadline = time.monotonic() + timeout
            while True:
                await trio.sleep(max(deadline - time.monotonic(), 0.0))
                deadline = self.board.started_at(ticket) + timeout  # 0.0 + timeout if no call started
                if deadline <= time.monotonic():
                    kill.cancel()
                    return

    async def run_job(self, function: Any, *args: Any, timeout: float) -> Any:
        """``function(*args)`` in a worker (the caller holds a slot); kill it on timeout.

        Raises:
            JobTimeout: the job ran past ``timeout`` seconds; its worker was killed.
            trio_parallel.BrokenWorkerError: the worker died (crash, ``os._exit``, OOM).
            trio.Cancelled: the caller was cancelled; the worker was killed first.
            Exception: what ``function`` raised in the worker.
        """
        board = self.board
        ticket = None if board is None else board.take()
        if board is None or ticket is None:
            return await self._run_sync(function, *args, timeout=timeout)
        try:
            return await self._run_ticketed(ticket, function, *args, timeout=timeout)
        finally:
            self._retired += board.retiring(ticket)
            board.give(ticket)

    async def _run_ticketed(self, ticket: int, function: Any, *args: Any, timeout: float) -> Any:
        return await self._run_sync(_worker.run_ticketed, ticket, function, *args, timeout=timeout)

    async def _run_sync(self, function: Any, *args: Any, timeout: float) -> Any:
        await self._ensure_worker()
        return await self._run_started(function, *args, timeout=timeout)

    async def _ensure_worker(self) -> None:
        assert self._ctx is not None, "WorkerSlots without a context must override run_job"
        if self._retired:  # a retiring worker may be the next one trio-parallel takes: replace it first
            self._retired -= 1
            await self._start_worker()
        elif self._ctx.statistics().idle_workers == 0:  # the job would start a worker: start it untimed
            await self._start_worker()

    async def _run_started(self, function: Any, *args: Any, timeout: float) -> Any:
        """``function(*args)`` on an idle worker (no schedule point since :meth:`_ensure_worker`)."""
        assert self._ctx is not None
        counters = self.counters
        try:
            with trio.move_on_after(timeout) as scope:
                return await self._ctx.run_sync(function, *args, kill_on_cancel=True, limiter=self._unlimited)
        except trio.Cancelled:
            counters.workers_killed += 1
            raise
        except trio_parallel.BrokenWorkerError:
            counters.worker_deaths += 1
            raise
        assert scope.cancelled_caught
        counters.workers_killed += 1
        raise JobTimeout

    async def _start_worker(self) -> None:
        """Start a worker with a no-op job (its pid: its kill is wrapped, see the module
        docstring), so the next job (no schedule point in between: trio-parallel
        reuses workers LIFO) runs on it already started.

        Raises:
            trio_parallel.BrokenWorkerError: it died, or did not start within
                :data:`WORKER_START_TIMEOUT_S` (then it was killed).
        """
        assert self._ctx is not None
        counters = self.counters
        self.starting += 1
        try:
            with trio.move_on_after(WORKER_START_TIMEOUT_S) as scope:
                pid = await self._ctx.run_sync(os.getpid, kill_on_cancel=True, limiter=self._unlimited)
                if self.board is not None:  # a local pool's own workers (subreapers)
                    _wrap_kill(pid)
        except trio.Cancelled:
            counters.workers_killed += 1
            raise
        except trio_parallel.BrokenWorkerError:
            counters.worker_deaths += 1
            raise
        finally:
            self.starting -= 1
        if scope.cancelled_caught:
            counters.workers_killed += 1
            raise trio_parallel.BrokenWorkerError(
                f"a reward worker process did not start within {WORKER_START_TIMEOUT_S} s"
            )

    def worker_counts(self) -> tuple[int, int]:
        """``(running a job, idle)`` worker processes now (one being started is in
        :attr:`starting` instead); ``(0, 0)`` once closed."""
        if self.closed or self._ctx is None:
            return 0, 0
        workers = self._ctx.statistics()  # (its running workers include the ones starting)
        return max(0, workers.running_workers - self.starting), workers.idle_workers
