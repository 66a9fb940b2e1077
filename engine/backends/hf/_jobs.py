"""The ``hf`` backend's job queue (one :class:`GenerationJob` per segment) and the
:class:`Batcher` interface that both batchers (static, continuous) implement over it.

``await queue.submit(request, budget)`` enqueues a job on a bounded trio channel (the
backend's batcher receives from :attr:`JobQueue.jobs`) and waits for its reply.  Cancelling
the caller withdraws the job: a queued one is skipped, a running one stopped through
``job.cancel_scope`` or, for rows inside a batch, ``job.withdrawn`` (a plain bool that the
generate thread reads).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field

import outcome
import trio

from ...errors import BackendError
from ...types import ModelRequest, ModelResponse
from ..lora import AdapterLease

__all__ = ["Batcher", "BatcherCounts", "GenerationJob", "JobQueue"]


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
        lease: the LoRA adapter version the caller holds for this job (a named adapter,
            pinned from submission to answer); ``None``: the batcher takes one when the
            batch starts (``request.lora_name``'s current version, or none).
    """

    request: ModelRequest
    budget: int
    lease: AdapterLease | None = None
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

    async def submit(self, request: ModelRequest, budget: int, lease: AdapterLease | None = None) -> ModelResponse:
        """Enqueue one segment (sampling ``lease``'s adapter, if given) and return its
        response (see the module docstring).

        Raises:
            BackendError: the queue closed before the job was answered.
            Whatever the batcher replied with.
        """
        job = GenerationJob(request, budget, lease, enqueued_at=trio.current_time())
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


@dataclass(frozen=True)
class BatcherCounts:
    """A batcher's counters (the batcher-specific part of ``HFStatistics``).

    Attributes:
        requests_served: segments answered (any stop reason).
        requests_running: segments being decoded now.
        tokens_generated: tokens in the answered segments.
        aborts: segments answered ``"abort"`` (weight updates in abort mode).
        requests_waiting: received, not yet in a running batch (static).
        batches: ``generate`` calls (static).
        batch_occupancy: mean requests per ``generate`` call (static).
        decode_steps: decoding steps run, the running batch's so far included (static; a
            live progress count: one per step of a batch, whatever its rows).
    """

    requests_served: int = 0
    requests_running: int = 0
    tokens_generated: int = 0
    aborts: int = 0
    requests_waiting: int = 0
    batches: int = 0
    batch_occupancy: float = 0.0
    decode_steps: int = 0


class Batcher(abc.ABC):
    """What ``HFBackend`` drives: a batcher serves the jobs of one queue over the
    backend's one loaded model, and takes part in weight syncs.

    The backend calls, in order: ``await nursery.start(batcher.run, jobs)``; then for each
    weight sync ``pause(mode)``, (the backend loads the weights into the shared model)
    ``weights_loaded(version)``, ``resume()``.  ``pause`` is called once per sync and
    ``resume`` only after a ``pause``.
    """

    @abc.abstractmethod
    async def run(self, jobs: trio.MemoryReceiveChannel[GenerationJob], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve ``jobs`` until the channel closes or the task is cancelled; reports
        started once it accepts jobs."""

    @abc.abstractmethod
    async def pause(self, mode: str) -> None:
        """Start no new work; ``"abort"``: answer the running segments ``"abort"`` with
        their partial tokens; ``"in_place"``: park them between two decoding steps.
        Returns once that is done."""

    @abc.abstractmethod
    def weights_loaded(self, version: int) -> None:
        """While paused, the model's weights were replaced: tokens that running (parked)
        segments decode from now on carry ``version``."""

    def move_leases(self, move: Callable[[AdapterLease], AdapterLease]) -> None:
        """While paused, after an in-place adapter switch: the segments still running (parked)
        compute with the new adapter from now on, so their leases move (``move(old) -> new``)."""

    def exclusive(self) -> AbstractAsyncContextManager[None]:
        """Hold the model for a change (an adapter loaded into it): no segment computes
        inside (static: :meth:`StepGate.exclusive <._gate.StepGate.exclusive>`).  The
        default does nothing: the caller changes the model only inside a weight sync."""
        return nullcontext()

    def reactivate(self) -> None:
        """After a change: the running (parked) batch computes with its own adapter again."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Undo :meth:`pause`: parked segments continue, new work starts."""

    @abc.abstractmethod
    def counts(self) -> BatcherCounts:
        """A snapshot of the counters; cheap, sync."""
