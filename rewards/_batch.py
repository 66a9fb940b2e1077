"""Micro-batching: several sync reward calls in one worker job.

One worker round trip costs about 0.2-0.3 ms (pickling, two pipe hops, a
context switch), which dominates trivial rewards such as a regex check.  With
``open_reward_pool(batch_size=B)`` (B > 1) the first attempt of each sync call
goes into a queue; a batcher task takes a worker slot, then drains up to ``B``
queued calls (waiting up to ``max_batch_delay_s`` for more if the batch is not
full) and sends them as one job (:func:`rewards._worker.run_batch`).

Policy, so that batching never changes a call's result:

* A batch runs under the smallest ``timeout_seconds`` of its calls and is
  killed when it runs past it.  A batch that times out or whose worker dies
  fails *as a batch*: none of its calls counts an attempt, and each of them is
  re-run on its own with the normal policy (timeout, kill, retries, fallback).
  So a hung or crashing call costs its batch-mates one extra timeout (or one
  re-run), never their reward.  Keep batching for cheap rewards that finish far
  below the timeout.
* An exception raised by one call is returned for that call only (it counts as
  that call's first attempt and is retried on its own).
* Actor calls whose actor is not set up in the worker come back "not set up"
  and are re-run on their own, where setup gets its own timeout.
* A caller cancelled while its call waits in the queue leaves the queue; one
  cancelled while its batch runs does not kill the batch (the others need it):
  the batch ends by itself or at its timeout.
* Retries (attempts after the first) are never batched.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import trio

from . import _worker

if TYPE_CHECKING:
    from ._pool import RewardPool

__all__ = ["BatchFailed", "Batcher"]


class BatchFailed(Exception):
    """The batch holding a call timed out or lost its worker; re-run the call."""


class _Item:
    __slots__ = ("abandoned", "done", "failed", "job", "result", "timeout")

    def __init__(self, job: bytes, timeout: float) -> None:
        self.job = job
        self.timeout = timeout
        self.done = trio.Event()
        self.result: tuple[str, Any] | None = None
        self.failed = False
        self.abandoned = False


class Batcher:
    """Collects first attempts into batches for a :class:`~rewards.RewardPool`."""

    def __init__(
        self, pool: RewardPool, nursery: trio.Nursery, batch_size: int, max_delay_s: float
    ) -> None:
        self._pool = pool
        self._nursery = nursery
        self._batch_size = batch_size
        self._max_delay_s = max_delay_s
        self._send, self._receive = trio.open_memory_channel[_Item](math.inf)

    async def run(self, job: bytes, timeout: float) -> tuple[str, Any]:
        """Run one job in a batch; its tagged result (see :mod:`rewards._worker`).

        Raises:
            BatchFailed: the batch timed out or its worker died.
        """
        item = _Item(job, timeout)
        self._send.send_nowait(item)
        try:
            await item.done.wait()
        except BaseException:  # cancelled: leave the queue (or the running batch)
            item.abandoned = True
            raise
        if item.failed:
            raise BatchFailed
        assert item.result is not None
        return item.result

    async def _next_live(self) -> _Item:
        while True:
            item = await self._receive.receive()
            if not item.abandoned:
                return item

    async def loop(self) -> None:
        """Form batches until cancelled (by the pool's exit)."""
        limiter = self._pool._limiter
        while True:
            first = await self._next_live()
            borrower = object()
            try:  # a worker slot for the batch (no schedule point when one is free)
                limiter.acquire_on_behalf_of_nowait(borrower)
            except trio.WouldBlock:
                await limiter.acquire_on_behalf_of(borrower)
            batch = [first]
            while len(batch) < self._batch_size:  # what queued up meanwhile
                try:
                    item = self._receive.receive_nowait()
                except trio.WouldBlock:
                    break
                if not item.abandoned:
                    batch.append(item)
            if len(batch) < self._batch_size and self._max_delay_s > 0:
                with trio.move_on_after(self._max_delay_s):
                    while len(batch) < self._batch_size:
                        batch.append(await self._next_live())
            if limiter.total_tokens == 1:  # one worker: no other batch can run meanwhile, so run it
                await self._run_batch(batch, borrower)  # here (one pass of the run queue less per call)
            else:
                self._nursery.start_soon(self._run_batch, batch, borrower)

    async def _run_batch(self, batch: list[_Item], borrower: object) -> None:
        pool = self._pool
        try:
            live = [item for item in batch if not item.abandoned]
            if not live:
                return
            timeout = min(item.timeout for item in live)
            try:
                results = await pool._run_job(
                    _worker.run_batch, [item.job for item in live], timeout=timeout
                )
            except Exception:
                # _Timeout (worker killed), BrokenWorkerError, or a result that
                # could not be sent back: every call is re-run on its own.
                pool._batch_failures += 1
                for item in live:
                    item.failed = True
            else:
                pool._batches += 1
                for item, result in zip(live, results):
                    item.result = result
        finally:
            pool._limiter.release_on_behalf_of(borrower)
            for item in batch:
                if item.result is None:
                    item.failed = True
                item.done.set()
