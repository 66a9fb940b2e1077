"""Micro-batching: several sync reward calls in one worker job, sized to the load.

One worker round trip costs about 0.2-0.3 ms (pickling, two pipe hops, a
context switch), which dominates trivial rewards such as a regex check.  With
``open_reward_pool(batch_size=B)`` (B > 1; the default is
:data:`DEFAULT_BATCH_SIZE`) the first attempt of each sync call goes into a
queue; a batcher task takes a worker slot, then sends what is queued as one job
(:func:`rewards._worker.run_batch`).  The batch size adapts to the load and to
the reward's cost, with no fixed wait:

* **Low load**: a call that finds a worker free goes at once, alone: it is
  never held back to wait for batch-mates (unless ``max_batch_delay_s`` > 0
  asks for that).
* **Under load**: calls queue while every worker is busy; when a worker frees
  up, the batcher takes what is waiting, split evenly over the free workers
  (``ceil(waiting / free workers)`` per job), so batches grow with the backlog.
* **Cost cap**: a batch carries at most about :data:`BATCH_WORK_S` of reward
  work: the cap is ``BATCH_WORK_S / mean call time`` (an exponential moving
  average of the call times the workers measure; the first batch, before any
  measurement, holds one call), bounded by ``B``.  Cheap rewards (a regex,
  ~30 us) batch up to ``B``; slow ones (a compiler run, a second) run alone, so
  one slow call never holds many others.  A batch that times out or loses its
  worker sets the estimate to its timeout: calls run alone again until fast
  calls bring it down.

Policy, so that batching never changes a call's result nor how often a call runs:

* A batch holds calls of one ``timeout_seconds`` (a call with another one waits
  for the next batch).  The worker records on the pool's job board
  (:mod:`rewards._board`) which call is running, since when, and each result as
  it comes; the batch is killed once the call running in it has run
  ``timeout_seconds`` (the calls before it do not eat into its time).  So a batch
  that times out or whose worker dies is sorted
  call by call (issue 24): the call that was running then has failed *its*
  attempt (a timeout, or a dead worker), exactly as alone, and the policy retries
  it alone (so a hung call runs ``max_retries + 1`` times in all, AReaL's
  ``range(max_retries + 1)``); the calls that finished before it keep their
  results; the calls not started yet are re-run on their own, not charged an
  attempt.  So a hung or crashing call costs its batch-mates at most one wait,
  never their reward nor a run.  Without a board (Ray actors) the progress is not
  known: every call of a failed batch is re-run on its own, uncharged, and a call
  that was alone in its job has failed its attempt.  Keep batching for cheap
  rewards that finish far below the timeout.
* An exception raised by one call is returned for that call only (it counts as
  that call's first attempt and is retried on its own).
* Actor calls whose actor is not set up in the worker come back "not set up"
  and are re-run on their own, where setup gets its own timeout.
* A caller cancelled while its call waits in the queue leaves the queue; one
  cancelled while its batch runs does not kill the batch while others need it
  (the batch ends by itself or at its timeout); when the last caller of a
  running batch is cancelled (always, for a call alone), the worker is killed,
  as without batching.
* Retries (attempts after the first) are never batched.
"""

from __future__ import annotations

import math
from typing import Any

import trio

import trio_parallel

from ._options import DEFAULT_BATCH_SIZE
from ._slots import BatchInterrupted, JobTimeout, WorkerSlots

__all__ = ["BATCH_WORK_S", "DEFAULT_BATCH_SIZE", "BatchFailed", "BatchItem", "Batcher"]

#: Seconds of reward work one batch carries at most (from the measured mean call time).
BATCH_WORK_S = 0.02
_EWMA_WEIGHT = 0.2  # weight of the newest batch in the call-time estimate


class BatchFailed(Exception):
    """The batch holding a call ended before the call ran (or without its result):
    re-run the call alone, not counting an attempt."""


class _Running:
    """A batch in a worker: its cancel scope and how many of its callers still wait."""

    __slots__ = ("scope", "waiting")

    def __init__(self, waiting: int) -> None:
        self.scope = trio.CancelScope()
        self.waiting = waiting

    def leave(self) -> bool:
        """A caller gave up; when none is left, kill the job (nobody needs it) and
        return True."""
        self.waiting -= 1
        if self.waiting == 0:
            self.scope.cancel()
            return True
        return False


class BatchItem:
    """One queued call (:meth:`Batcher.submit`).  Its caller sleeps in
    ``trio.lowlevel.wait_task_rescheduled(item)`` until the batcher wakes it (the
    item is its own abort function): no ``trio.Event``, parking lot, closure or
    helper coroutine per call.  Then :meth:`outcome` gives the result; a caller
    woken by a cancellation calls :meth:`leave` first."""

    __slots__ = ("abandoned", "done", "error", "failed", "job", "result", "running", "task", "timeout")

    def __init__(self, job: bytes, timeout: float, task: trio.lowlevel.Task | None) -> None:
        self.job = job
        self.timeout = timeout
        self.done = False
        self.task = task  # the caller, while it waits
        self.result: tuple[str, Any] | None = None
        self.failed = False
        self.error: Exception | None = None  # the call's own failure: it was running when its batch failed
        self.abandoned = False
        self.running: _Running | None = None  # the batch it is in, once sent

    def __call__(self, raise_cancel: Any) -> trio.lowlevel.Abort:
        """The abort function: the caller was cancelled while waiting; it wakes with the cancellation."""
        self.task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def finish(self) -> None:
        """Done: wake the caller if it still waits."""
        self.done = True
        task, self.task = self.task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def leave(self) -> None:
        """The caller gave up (cancelled): leave the queue, or the running batch; the
        last caller of a running batch returns once its worker is killed, as an
        unbatched call does."""
        self.abandoned = True
        self.task = None
        if self.running is not None and not self.done and self.running.leave():
            with trio.CancelScope(shield=True):
                self.task = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(_not_abortable)

    def outcome(self) -> tuple[str, Any]:
        """The call's tagged result (see :mod:`rewards._worker`), once woken.

        Raises:
            BatchFailed: the batch failed before this call ran (re-run it alone, uncharged).
            Exception: the call was running when its batch failed (the pool's
                ``JobTimeout`` or ``BrokenWorkerError``): this attempt's own failure,
                as without batching.
        """
        if self.error is not None:
            raise self.error
        if self.failed:
            raise BatchFailed
        assert self.result is not None
        return self.result


def _not_abortable(raise_cancel: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


class Batcher:
    """Collects first attempts into batches for a :class:`~rewards.RewardPool`.

    Args:
        slots: the pool's worker slots: a batch holds one slot
            (``slots.limiter``) and runs as one job (``slots.run_job``); its
            ``batches``, ``batched_calls`` and ``batch_failures`` are counted in
            ``slots.counters``.
        nursery: where batches run when the pool has several workers.
        batch_size: the most calls in one job (>= 2).
        max_delay_s: seconds a batch may wait for more calls once it holds a
            worker slot (0: take what is queued and go).
        work_s: seconds of reward work a batch carries at most (the cost cap).
    """

    def __init__(
        self, slots: WorkerSlots, nursery: trio.Nursery, batch_size: int, max_delay_s: float,
        work_s: float = BATCH_WORK_S,
    ) -> None:
        self._slots = slots
        self._nursery = nursery
        self._batch_size = batch_size
        self._max_delay_s = max_delay_s
        self._work_s = work_s
        self.call_s: float | None = None  # mean seconds per call (EWMA); None: not measured yet
        self._send, self._receive = trio.open_memory_channel[BatchItem](math.inf)
        self._held: BatchItem | None = None  # taken from the queue for the next batch (another timeout)

    def cap(self) -> int:
        """The most calls the next batch may carry: ``work_s / call_s`` within
        ``[1, batch_size]``; 1 before any call has been measured."""
        if self.call_s is None:
            return 1
        if self.call_s <= self._work_s / self._batch_size:
            return self._batch_size
        return max(1, min(self._batch_size, int(self._work_s / self.call_s + 1e-9)))

    def _measured(self, per_call_s: float) -> None:
        if self.call_s is None:
            self.call_s = per_call_s
        else:
            self.call_s += _EWMA_WEIGHT * (per_call_s - self.call_s)

    def submit(self, job: bytes, timeout: float) -> BatchItem:
        """Queue one job for the calling task, which must then wait for it::

            item = batcher.submit(job, timeout)
            try:
                await trio.lowlevel.wait_task_rescheduled(item)
            except BaseException:
                await item.leave()
                raise
            tag, value = item.outcome()

        (:meth:`run` in one call; the pool does it inline, one coroutine less per call)."""
        item = BatchItem(job, timeout, trio.lowlevel.current_task())
        self._send.send_nowait(item)
        return item

    async def run(self, job: bytes, timeout: float) -> tuple[str, Any]:
        """Run one job in a batch; its tagged result (see :mod:`rewards._worker`).

        Raises:
            BatchFailed: the batch failed before this call ran (re-run it alone, uncharged).
            Exception: the call was running when its batch failed (the pool's
                ``JobTimeout`` or ``BrokenWorkerError``): this attempt's own failure.
        """
        item = self.submit(job, timeout)
        try:
            await trio.lowlevel.wait_task_rescheduled(item)
        except BaseException:  # cancelled: leave the queue (or the running batch)
            await item.leave()
            raise
        return item.outcome()

    async def _next_live(self) -> BatchItem:
        held, self._held = self._held, None
        if held is not None and not held.abandoned:
            return held
        while True:
            item = await self._receive.receive()
            if not item.abandoned:
                return item

    def _joins(self, batch: list[BatchItem], item: BatchItem) -> bool:
        """Add ``item`` to ``batch`` if it has the batch's timeout, else hold it for
        the next batch; False when the batch is complete."""
        if item.timeout != batch[0].timeout:
            self._held = item
            return False
        batch.append(item)
        return True

    async def loop(self) -> None:
        """Form batches until cancelled (by the pool's exit)."""
        limiter = self._slots.limiter
        while True:
            first = await self._next_live()
            borrower = object()
            try:  # a worker slot for the batch (no schedule point when one is free)
                limiter.acquire_on_behalf_of_nowait(borrower)
            except trio.WouldBlock:
                await limiter.acquire_on_behalf_of(borrower)
            # What queued up meanwhile, shared evenly by the free workers, within the cost cap.
            waiting = 1 + self._receive.statistics().current_buffer_used
            size = min(self.cap(), -(-waiting // (limiter.available_tokens + 1)))
            batch = [first]
            joining = True
            while joining and len(batch) < size:
                try:
                    item = self._receive.receive_nowait()
                except trio.WouldBlock:
                    break
                if not item.abandoned:
                    joining = self._joins(batch, item)
            if joining and len(batch) < size and self._max_delay_s > 0:
                with trio.move_on_after(self._max_delay_s):
                    while joining and len(batch) < size:
                        joining = self._joins(batch, await self._next_live())
            if limiter.total_tokens == 1:  # one worker: no other batch can run meanwhile, so run it
                await self._run_batch(batch, borrower)  # here (one pass of the run queue less per call)
            else:
                self._nursery.start_soon(self._run_batch, batch, borrower)

    async def _run_batch(self, batch: list[BatchItem], borrower: object) -> None:
        slots = self._slots
        try:
            live = [item for item in batch if not item.abandoned]
            if not live:
                return
            timeout = min(item.timeout for item in live)
            running = _Running(len(live))
            for item in live:
                item.running = running
            try:
                with running.scope:  # cancelled when every caller has given up: the worker is killed
                    results, work_s = await slots.run_batch([item.job for item in live], timeout, self._nursery)
                if running.scope.cancelled_caught:
                    return  # nobody is waiting for these results
            except BatchInterrupted as failure:
                # JobTimeout (worker killed), BrokenWorkerError, or a result that
                # could not be sent back.  Calls run alone until fast ones bring
                # the estimate down.
                self.call_s = max(self.call_s or 0.0, timeout if math.isfinite(timeout) else self._work_s)
                if len(live) > 1:
                    slots.counters.batch_failures += 1
                _sort_out(live, failure)
            else:
                slots.counters.batches += 1
                slots.counters.batched_calls += len(live)
                self._measured(work_s / len(live))
                for item, result in zip(live, results):
                    item.result = result
        finally:
            slots.limiter.release_on_behalf_of(borrower)
            for item in batch:
                if item.result is None:
                    item.failed = True
                item.finish()


def _sort_out(live: list[BatchItem], failure: BatchInterrupted) -> None:
    """Give each call of a failed batch its share (see the module docstring): the
    results recorded before the failure, the failure itself to the call that was
    running, a re-run (:class:`BatchFailed`, set by the caller) to the others."""
    exc, progress = failure.cause, failure.progress
    killed = isinstance(exc, (JobTimeout, trio_parallel.BrokenWorkerError))
    if progress is None:  # no board: a call alone failed by itself; those of a batch are re-run
        if len(live) == 1:
            live[0].error = exc
        for item in live:
            item.failed = True
        return
    done = progress.results
    for i, item in enumerate(live):
        if i < len(done):
            item.result = done[i]
        elif i == progress.started and killed:
            item.error = exc
        else:
            item.failed = True
