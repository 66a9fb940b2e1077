"""What the ``hf`` backend's two batchers share: the job queue (one :class:`GenerationJob`
per segment), the weight-sync :class:`Gate`, and :func:`stop_ids`.

``await queue.submit(request, budget)`` enqueues a job on a bounded trio channel (the
backend's batcher receives from :attr:`JobQueue.jobs`) and waits for its reply.  Cancelling
the caller withdraws the job: a queued one is skipped, a running one stopped through
``job.cancel_scope`` or, for rows inside a batch, ``job.withdrawn`` (a plain bool that the
generate thread reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import outcome
import trio

from ..errors import BackendError
from ..types import ModelRequest, ModelResponse

__all__ = ["Gate", "GenerationJob", "JobQueue", "stop_ids"]


@dataclass(eq=False)
class GenerationJob:
    """One segment in flight between a caller and a batcher.

    Attributes:
        request: the (validated) request.
        budget: new-token budget (> 0).
        enqueued_at: ``trio.current_time()`` when the job was sent (seconds).
        cancel_scope: cancelled by :meth:`withdraw`; a batcher serving the job on its
            own task runs it inside this scope.
        withdrawn: the caller gave up on this job.
    """

    request: ModelRequest
    budget: int
    enqueued_at: float = 0.0
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    withdrawn: bool = False
    result: outcome.Outcome[ModelResponse] | None = None
    done: trio.Event = field(default_factory=trio.Event)

    def withdraw(self) -> None:
        """Give up on this job: skipped if queued, cancelled if running."""
        self.withdrawn = True
        self.cancel_scope.cancel()

    def reply(self, result: outcome.Outcome[ModelResponse]) -> None:
        """Deliver the result (the first one counts; dropped once withdrawn)."""
        if self.result is None and not self.withdrawn:
            self.result = result
            self.done.set()


class JobQueue:
    """A bounded channel of jobs plus the waiting side of each job."""

    def __init__(self, capacity: int) -> None:
        self._send, self.jobs = trio.open_memory_channel[GenerationJob](max(1, capacity))
        self._pending: set[GenerationJob] = set()

    async def submit(self, request: ModelRequest, budget: int) -> ModelResponse:
        """Enqueue one segment and return its response (see the module docstring).

        Raises:
            BackendError: the queue closed before the job was answered.
            Whatever the batcher replied with.
        """
        job = GenerationJob(request, budget, enqueued_at=trio.current_time())
        self._pending.add(job)
        try:
            try:
                await self._send.send(job)
            except trio.ClosedResourceError:
                raise BackendError(f"request {request.rid}: the backend is closed") from None
            await job.done.wait()
        except BaseException:
            job.withdraw()
            raise
        finally:
            self._pending.discard(job)
        assert job.result is not None
        return job.result.unwrap()

    def close(self) -> None:
        """Stop accepting jobs; every job not yet answered fails with :class:`BackendError`."""
        self._send.close()
        for job in list(self._pending):
            job.reply(outcome.Error(BackendError(f"request {job.request.rid}: the backend closed")))


def stop_ids(tokenizer: Any, req: ModelRequest) -> set[int]:
    """The ids that end ``req``: ``gconfig.stop_token_ids`` plus the tokenizer's EOS
    unless ``ignore_eos``."""
    stop = set(req.gconfig.stop_token_ids)
    if not req.gconfig.ignore_eos and tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    return stop


class Gate:
    """Open unless a weight sync holds it: batches (static) and requests (continuous)
    start only while it is open."""

    def __init__(self) -> None:
        self._open = trio.Event()
        self._open.set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        """Return once open (always a checkpoint; re-checked after it, so a close
        during the checkpoint holds the caller)."""
        while True:
            await self._open.wait()
            if self._open.is_set():
                return
