"""The rollout engine: one trio task per episode under the engine's nursery.

::

    async with open_rollout_engine(backend, EngineConfig(...)) as engine:
        task_id = engine.submit(data, workflow, group_size=4)   # returns at once
        trajs = await engine.wait(count=8)                      # oldest first, None = not accepted
        batch = await engine.prepare_batch(dataloader, workflow)  # async RL: overlaps training
        engine.set_version(v + 1)                               # after each weight update

Contract names and semantics follow AReaL's ``WorkflowExecutor``
(``areal/infra/workflow_executor.py``); admission follows its staleness manager
(:mod:`engine.staleness`).  Ours:

* Exactly-once accounting, always true: ``submitted == queued + running +
  accepted + rejected + failed``.  Every episode ends once as ``accepted``,
  ``rejected`` or ``failed`` with a reason (:class:`EpisodeResult`); one failing
  episode never stops the run.  An episode is ``running`` from admission until
  its result is deposited in the bounded buffer (:mod:`engine.buffer`).
* ``wait`` counts completions, accepted or not (AReaL issue #588), and a ``wait``
  that times out or is cancelled consumes nothing.
* A group (``group_size = n``) runs its n samples in a child nursery; results are
  ordered by sample index; every trajectory carries ``group_id`` and
  ``group_size`` so partial groups cannot corrupt GRPO (AReaL issue #1419).
* ``set_version`` wakes admission at once (a latent hang in AReaL).

:class:`RolloutEngine` composes its parts, each owning its state and handed the typed
parts it needs: the ledger (:mod:`engine._ledger`: counts, reasons, task ids),
admission (:mod:`engine._admission`: queue, running episodes, staleness, version,
pause), the result buffer (:mod:`engine.buffer`), the episodes (:mod:`engine._episode`),
the batch calls and ``prepare_batch``'s run-ahead (:mod:`engine._batches`) and the
checkpoint codec (:mod:`engine._checkpoint`); they call the engine back through
:class:`~engine._records.EngineCalls`.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar, cast

import trio
from tensordict import TensorDict

from rewards._context import set_pool_in_context

from ._admission import Admission
from ._batches import BatchPipeline
from ._breaker import FailureBreaker, FailureLog
from ._checkpoint import EngineCheckpoint
from ._collated import ITEMS_FIX, check_item
from ._config import EngineConfig
from ._episode import Episodes
from ._gc import gc_tuned
from ._generate import generate
from ._ledger import Ledger
from ._lifecycle import open_services
from ._resources import EngineResources, open_engine_resources
from ._records import (EngineCalls, EngineStatistics, EpisodeResult, EpisodeStatus, FailReason, Task as _Task, episode_id,
                       is_cancellation, sample_index)
from ._scheduling import resolve_max_segments, warn_if_unordered
from .backends.base import InferenceBackend, WeightSync
from .buffer import ResultBuffer
from .datastream import DataStream
from .dump import TrajectoryDumper
from .errors import BackendError, unwrap_single
from .types import ModelRequest, ModelResponse
from .workflow import EngineRewards, EpisodeEngine

T = TypeVar("T")

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "EngineConfig",
    "EngineStatistics",
    "EpisodeResult",
    "RolloutEngine",
    "episode_id",
    "open_rollout_engine",
    "sample_index",
]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace


class RolloutEngine:
    """Created by :func:`open_rollout_engine`; do not instantiate directly."""

    def __init__(self, nursery: trio.Nursery, backend: InferenceBackend,
                 reward_pool: EngineRewards | None, config: EngineConfig, dumper: TrajectoryDumper | None = None) -> None:
        self._dumper = dumper
        self._resources: EngineResources | None = None  # set by open_rollout_engine
        self.backend = backend
        self.reward_pool = reward_pool
        self.config = config
        self._ledger = Ledger()
        # the version: the engine's from here on (set_version); the policy's scheduling_max_segments="server"
        # is the open backend's limit
        policy_config = resolve_max_segments(config, lambda: backend.running_sequence_limit())
        warn_if_unordered(policy_config, getattr(backend, "priority_scheduling", None))
        self._admission = Admission(policy_config, backend.version, self._ledger, nursery, self._run_episode)
        capacity = config.buffer_capacity or max(1024, 4 * config.max_concurrent_rollouts)
        self._buffer = ResultBuffer(capacity)
        self._breaker = FailureBreaker(config.failure_breaker_consecutive, config.failure_breaker_window,
                                       config.failure_breaker_rate)
        # what workflows get: inside an episode the reward pool is never None (open_rollout_engine opens one)
        self._episodes = Episodes(cast(EpisodeEngine, self), config, self._admission, self._ledger, FailureLog(logger))
        self._workflows: dict[tuple[Any, int], tuple[Any, Any]] = {}  # spec -> (kwargs, instance)
        # the parts call back through these (bound here: a sharded engine's overrides apply)
        self._calls = EngineCalls(submit=self.submit, resolve=self._resolve, admit=self._admit_now, refill=self._refill,
                                  take=self._take, withdraw=self._withdraw_queued, restore=self.restore)
        self._batches = BatchPipeline(config, self._ledger, self._admission, self._buffer, self._breaker, self._calls,
                                      reward_pool)
        self._checkpoint = EngineCheckpoint(config, self._ledger, self._admission, self._buffer, self._batches, self._calls)

    # -- generation ----------------------------------------------------------
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate a completion for ``req`` on the backend: each segment is one
        ``await backend.generate(request, budget)`` on the caller's task (a batching
        backend queues it inside itself).

        Each segment waits while the engine is paused, then tags its tokens with
        the version read before it is sent (AReaL PR #1569).  An interrupted
        generation (stop reason ``"abort"``, e.g. during a weight update) is
        resumed by re-sending prompt + partial output with the budget lowered; an
        abort that lands exactly at the budget is reported as ``"length"`` with
        all tokens kept.  Cancelling the caller withdraws the request.

        Raises:
            InvalidRequestError: the request is malformed or its budget is <= 0.
            BackendError: the backend failed, or its response broke the evidence
                rules (:func:`engine.backends.base.validate_response`).
            trio.ClosedResourceError: the engine is closed.
        """
        return await generate(req, self.backend, self._admission, self._ledger)  # engine._generate

    async def shared_resource(self, key: Hashable, opener: Callable[[], AbstractAsyncContextManager[T]]) -> T:
        """A resource shared by this engine's episodes (e.g. the asyncio loop of
        :func:`engine.aio.run_asyncio`): ``opener()``, an async context manager, is
        entered on the first call with ``key`` and its value returned to every call;
        it exits when the engine closes, after the episodes and the backend
        (:mod:`engine._resources`).

        Raises:
            trio.ClosedResourceError: the engine is closed (or was not opened by
                :func:`open_rollout_engine`).
            Whatever ``opener()`` raises while it opens (the next call tries again).
        """
        if self._resources is None:
            raise trio.ClosedResourceError("shared_resource: this engine has no resource scope (open it with "
                                           "open_rollout_engine)")
        return cast(T, await self._resources.get(key, opener))

    # -- version, pause ------------------------------------------------------------
    @property
    def version(self) -> int:
        """The current policy version (tokens generated now are tagged with it).  The
        engine owns it; :meth:`set_version` tells the backend."""
        return self._admission.version

    def set_version(self, version: int) -> None:
        """Set the policy version: tells the backend (segments sent from now on carry
        it), re-checks the staleness of buffered trajectories and wakes admission, all
        at once (every version change goes through here)."""
        self._admission.version = version
        self.backend.set_version(version)
        self._recheck_buffer()
        self._admission.wake()

    async def update_weights(self, source: Any, *, version: int, mode: str = "abort") -> None:
        """Swap the policy's weights mid-rollout (partial rollout), through the
        backend's :class:`~engine.backends.base.WeightSync` interface.

        Dispatch of new episodes and generation segments pauses; the backend pauses
        (``"abort"``: in-flight generations return their partial output, resumed
        afterwards by re-sending prompt + partial output; ``"in_place"``: they park
        between two decoding steps); the weights load; the version becomes ``version``
        (:meth:`set_version`); the backend and dispatch resume.  Every episode in
        flight completes, with per-token versions showing the boundary.

        Args:
            source: a checkpoint folder (every backend; the servers must see the same
                path) or a state dict (the ``hf`` backend).
            mode: ``"abort"`` or ``"in_place"`` (``hf`` only).

        Raises:
            BackendError: the backend does not implement ``WeightSync`` (naming it),
                cannot honour ``mode``, or the new weights do not load (the old
                weights and version stay; dispatch resumes).
        """
        sync = self.backend
        if not isinstance(sync, WeightSync):
            raise BackendError(f"{type(sync).__name__} does not support weight updates "
                               "(it does not implement engine.backends.base.WeightSync: pause, resume, update_weights)")
        was_paused = self.paused
        self.pause()
        try:
            try:
                await sync.pause(mode)
                await sync.update_weights(source, version=version, mode=mode)
                self.set_version(version)  # before the backend resumes: queued segments start tagged with it
            finally:
                await sync.resume()
        finally:
            if not was_paused:
                self.resume()

    def restore(self, version: int) -> None:
        """Resume after loading a checkpoint taken at ``version``: sets the version
        and resets the staleness counter of accepted episodes to ``version * B``
        (AReaL issue #1388)."""
        self._admission.staleness.restore(version)
        self.set_version(version)

    # -- checkpoints (the codec: engine._checkpoint) ---------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The engine's resumable state, for a trainer's checkpoint: policy version,
        accounting, finished-but-unconsumed results (with their trajectories), and
        the data of queued and running episodes.  Plain containers and tensors:
        ``torch.save`` it; ``torch.load(..., weights_only=True)`` reads it back when
        the dataset items are plain too.  Sync; the engine keeps running.  Format:
        :mod:`engine._checkpoint`."""
        return self._checkpoint.state(self.statistics())

    def load_state_dict(self, state: dict[str, Any], workflow: Any = None,
                        workflow_kwargs: dict[str, Any] | None = None,
                        should_accept_fn: Callable[..., Any] | None = None) -> list[int]:
        """Restore :meth:`state_dict` into this fresh engine: version and staleness
        counter (AReaL's restore, ``accepted = version * B``, plus the accepted
        results restored), lifetime counts, the unconsumed results (``wait`` returns
        them first), and the episodes that were queued or running, re-submitted with
        their task ids to ``workflow`` (they start over).  Returns those task ids.

        Raises:
            ValueError: the engine has already submitted episodes, the state's
                format is unknown, or it holds episodes to re-submit and
                ``workflow`` is None.
        """
        return self._checkpoint.load(state, workflow, workflow_kwargs, should_accept_fn)

    def pause(self) -> None:
        """Stop starting episodes and sending new generation segments; segments in
        flight finish."""
        self._admission.pause()

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._admission.resume()

    @property
    def paused(self) -> bool:
        return self._admission.paused

    # -- submission and admission ----------------------------------------------------
    def submit(self, data: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
               should_accept_fn: Callable[..., Any] | None = None, group_size: int = 1,
               task_id: int | None = None) -> int:
        """Enqueue an episode of ``workflow`` on ``data``; returns its task id at once.

        Args:
            workflow: an instance, a class (with ``workflow_kwargs``), a dotted
                path, or an object with ``async run(engine, data)``
                (:func:`workflows.resolve_workflow`).
            should_accept_fn: ``(trajectory) -> bool``, sync or async; ``False``
                rejects the episode (reason ``"filtered"``); raising or running past
                ``should_accept_timeout_s`` rejects it (``"filter_error"`` /
                ``"filter_timeout"``).  A sync filter runs in a thread, so a slow one
                never stalls other episodes.
            group_size: run the workflow this many times on ``data`` concurrently.
            task_id: an explicit id (must be unused).

        Raises:
            WorkflowError: the workflow spec cannot be resolved.
            ValueError: ``group_size < 1`` or ``task_id`` is in use.
            DatasetError: ``data`` is a batch or a message's role/content is not a str (:mod:`engine._collated`).
            trio.ClosedResourceError: the engine is closed.
        """
        if self._admission.closed:
            raise trio.ClosedResourceError("the rollout engine is closed")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        check_item(data, "submit: data", ITEMS_FIX)
        wf = self._resolve(workflow, workflow_kwargs)
        task_id = self._ledger.new_task(task_id)
        self._admission.enqueue(_Task(task_id, wf, data, should_accept_fn, group_size))
        return task_id

    def _resolve(self, workflow: Any, workflow_kwargs: dict[str, Any] | None) -> Any:
        """Resolve a workflow spec; a class or dotted path given again with the same
        kwargs object reuses the instance built the first time (building one can
        load a tokenizer)."""
        from engine.workflow import resolve_workflow

        if not isinstance(workflow, (str, type)):
            return resolve_workflow(workflow, workflow_kwargs)
        key = (workflow, id(workflow_kwargs))
        cached = self._workflows.get(key)
        if cached is None or cached[0] is not workflow_kwargs:
            cached = (workflow_kwargs, resolve_workflow(workflow, workflow_kwargs))
            self._workflows[key] = cached
        return cached[1]

    async def _admit_forever(self) -> None:
        """Start queued episodes whenever capacity allows (the admission actor)."""
        while True:
            self._admit_now()
            await self._admission.parked()

    def _admit_now(self) -> None:
        self._admission.admit_now()  # (a sharded engine dispatches to its shards instead)

    # -- one episode -------------------------------------------------------------------
    async def _run_episode(self, task: _Task) -> None:
        episode_id.set(task.task_id)
        # the engine's pool is the episode's current pool (rewards.AsyncRewardWrapper), whichever
        # task admitted it: a task trio.from_thread started (the blocking facade) has none
        set_pool_in_context(self.reward_pool)
        start = trio.current_time()
        result: EpisodeResult | None = None
        try:
            scope = self._admission.policy.episode_scope(task)  # None unless the policy may cut it
            if scope is None:
                result = self._admission.check_staleness(await self._episodes.result(task))
            else:
                result = await self._cuttable_result(task, scope)
            object.__setattr__(result, "elapsed_s", trio.current_time() - start)  # a new record, not shared yet
            await self._buffer.put(result)  # backpressure: wait for room
        except BaseException as exc:
            if not is_cancellation(exc):
                raise
            if result is None:  # unfinished work is cancelled; finished work is kept
                result = EpisodeResult(task.task_id, EpisodeStatus.FAILED, reason=FailReason.CANCELLED, error_type="Cancelled",
                                       error_message="the episode was cancelled", data=task.data,
                                       elapsed_s=trio.current_time() - start)
            self._buffer.deposit(result)
            self._ended(result, was_running=True)
            raise
        self._ended(result, was_running=True)

    async def _cuttable_result(self, task: _Task, scope: trio.CancelScope) -> EpisodeResult:
        """The episode's result when its scheduling policy may cut it (cancel ``scope``):
        then the policy's own result (``"tail_batching"``: rejected ``"deferred"``)."""
        outcome: EpisodeResult | None = None
        with scope:
            outcome = await self._episodes.result(task)
        cut = self._admission.policy.episode_finished(task, cut=scope.cancelled_caught)
        if outcome is None:
            assert cut is not None, "a scheduling policy cancelled an episode without a result for it"
            return cut
        return self._admission.check_staleness(outcome)

    def _recheck_buffer(self) -> None:
        """After a version change: drop or flag trajectories that turned stale."""
        if self.config.max_head_offpolicyness is None:
            return
        for result in self._buffer.results():
            if result.trajectory is None:
                continue
            checked = self._admission.check_staleness(result)
            if checked.status != result.status:  # accepted -> rejected (stale)
                self._buffer.replace(result.task_id, checked)
                self._admission.reclassified(result, checked)

    # -- accounting ------------------------------------------------------------------------
    def _ended(self, result: EpisodeResult, *, was_running: bool) -> None:
        self._admission.ended(result, was_running=was_running)
        self._breaker.record(result)
        if self._batches.ended(result.task_id):
            self._refill()
        self._admit_now()  # here, not via the admission actor: the successor starts one run-queue pass sooner
        if self._dumper is not None and result.status == EpisodeStatus.ACCEPTED:
            self._dumper.record(result, self.version)

    # -- results -----------------------------------------------------------------------------
    def _take(self, results: list[EpisodeResult]) -> list[EpisodeResult]:
        return self._ledger.consumed(results)

    async def _wait_for(self, predicate: Callable[[], bool], timeout: float | None, what: str) -> None:
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await self._buffer.wait_until(predicate)
        if not predicate():
            raise TimeoutError(f"{what} within {timeout} s{self._admission.why_waiting()}")

    async def wait_results(self, count: int, timeout: float | None = None) -> list[EpisodeResult]:
        """Wait until ``count`` episodes have ended (accepted or not) and take their
        records, oldest completion first.

        Raises:
            TimeoutError: ``timeout`` seconds passed first; nothing is consumed.
            ValueError: ``count`` is negative or more than could ever end.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._ledger.live_ids):
            raise ValueError(f"count={count} but only {len(self._ledger.live_ids)} episodes are pending or unconsumed")
        await self._wait_for(lambda: len(self._buffer) >= count, timeout,
                             f"fewer than {count} episodes ended")
        return self._take([self._buffer.pop_oldest() for _ in range(count)])

    async def wait(self, count: int, timeout: float | None = None) -> list[TensorDict | None]:
        """AReaL's ``wait``: ``count`` completions, oldest first; the trajectory of
        each accepted episode, ``None`` for rejected or failed ones.  Completions
        are those of every episode, including ones :meth:`prepare_batch` submitted
        to run ahead; use :meth:`wait_for_task` to wait for a particular one."""
        return [r.trajectory for r in await self.wait_results(count, timeout)]

    async def wait_for_task(self, task_id: int, timeout: float | None = None) -> EpisodeResult:
        """Wait for one episode and take its record.

        Raises:
            ValueError: ``task_id`` is unknown or was already consumed.
            TimeoutError: ``timeout`` seconds passed first (the record stays).
        """
        if task_id not in self._ledger.live_ids:
            raise ValueError(f"task_id {task_id} is unknown or already consumed")
        await self._wait_for(lambda: task_id in self._buffer, timeout, f"task {task_id} did not end")
        return self._take([self._buffer.pop(task_id)])[0]

    async def rollout_batch(self, items: Iterable[Any], workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
                            should_accept_fn: Callable[..., Any] | None = None, group_size: int = 1) -> TensorDict:
        """Submit every item, wait for all of them, and return the accepted
        trajectories concatenated (:func:`engine.data.concat_padded_tensors`), in
        submission order.  Rejected and failed episodes are left out; when all were
        rejected the batch is empty (AReaL's ``rollout_batch`` returns ``[]``).

        Raises:
            EpisodeFailuresError: the failure breaker opened (recent episodes all failed): this call's
                episodes not yet started end as failed (``"cancelled"``); raised once the running ones ended.
                Also when none was accepted and some failed (fewer than the breaker needs): the message
                names the counts by reason and the first failures (**ours**: AReaL returns ``[]``, and
                a trainer fails later on a ``KeyError``).
            DatasetError: ``items`` is a dict or a string, or an item is a batch (as :meth:`submit`).
        """
        return await self._batches.rollout_batch(items, workflow, workflow_kwargs, should_accept_fn, group_size)

    async def prepare_batch(self, dataloader: Iterable[Any] | DataStream, workflow: Any,
                            workflow_kwargs: dict[str, Any] | None = None,
                            should_accept_fn: Callable[..., Any] | None = None, group_size: int = 1,
                            dynamic_bs: bool = False, timeout: float | None = None) -> TensorDict:
        """The asynchronous path (AReaL ``prepare_batch``): return once ``B``
        (``consumer_batch_size``) accepted results are ready (with ``dynamic_bs``,
        once ``B`` have ended, returning the accepted among them), oldest first.

        Run-ahead is kept on every call and *between* calls: the engine keeps
        ``(eta + 1) * B`` episodes of this dataloader queued or running (AReaL),
        refilling as each episode ends and right after a batch is taken, so
        generation overlaps the trainer's step whenever the staleness bound
        (``max_head_offpolicyness`` = eta) allows.  Accepted results waiting plus
        episodes in flight stay at most ``(eta + 2) * B`` (with ``eta=None``:
        ``max(B, C) + B``), and never more than the result buffer's capacity plus
        ``B``.  Refills use the episode spec of the latest call.

        The data position is a :class:`~engine.datastream.DataStream`
        (``engine.data_stream``): the engine streams from one dataloader, holding a
        reference to it.  Pass the *same* object every call (or a ``DataStream``
        you built, e.g. to restore a position); a different object raises unless
        the previous one is exhausted or :meth:`reset_data_stream` was called.  A
        re-iterable dataloader is cycled in epochs; a one-pass one (a generator)
        is read once: when it runs out, the call returns what is left (a partial
        batch) and the next call raises :class:`~engine.errors.DataExhaustedError`.

        Returns:
            The padded batch of the accepted trajectories (``B`` episodes, times
            their group sizes, rows).

        Raises:
            TimeoutError: ``timeout`` seconds passed; nothing is consumed; the
                message says why (paused, staleness bound, failures).
            EpisodeFailuresError: recent episodes all failed (the failure breaker
                opened, see :class:`EngineConfig`); names the dominant reason with
                one example.  The next call submits again.  Also when the results
                it would return hold none accepted and some failed (``dynamic_bs``, or
                the last partial batch of a one-pass dataloader), as :meth:`rollout_batch`.
            DataExhaustedError: the one-pass dataloader had no more items and all
                its episodes were returned.
            DatasetError: the dataloader yields no items or a default-collated
                batch as an item, is a torch ``DataLoader`` with the default
                collate, or is a different object than the one the engine streams from.
        """
        return await self._batches.prepare_batch(dataloader, workflow, workflow_kwargs, should_accept_fn, group_size,
                                   dynamic_bs, timeout)

    @property
    def data_stream(self) -> DataStream | None:
        """The :class:`~engine.datastream.DataStream` that ``prepare_batch`` reads, or ``None``."""
        return self._batches.stream

    def reset_data_stream(self) -> None:
        """Forget ``prepare_batch``'s dataloader, so the next call may pass another one.
        Episodes already submitted from the old one still run and are returned."""
        self._batches.feeder = None

    def _refill(self) -> None:
        self._batches.refill()  # (a sharded engine stops refilling once every shard died)

    def longest_running(self, top: int) -> tuple[Any, ...] | None:
        """None: one engine does not time its episodes (``RunMonitor.track`` does); a
        sharded engine returns its shards' ``top`` longest (``EpisodeTiming``)."""
        return None

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot; sync and cheap."""
        ledger = self._ledger
        c = ledger.counts
        return EngineStatistics(
            submitted=c["submitted"], queued=c["queued"], running=c["running"], accepted=c["accepted"],
            rejected=c["rejected"], failed=c["failed"],
            rejected_by_reason={k: v for k, v in ledger.rejected_by.items() if v},
            failed_by_reason={k: v for k, v in ledger.failed_by.items() if v},
            results_waiting=len(self._buffer), buffer_size=self._buffer.rows, buffer_peak=self._buffer.peak_rows,
            buffer_capacity=self._buffer.capacity, capacity=self._admission.staleness.capacity(self.version), version=self.version,
            paused=self.paused, generated_tokens=ledger.generated_tokens,
            segments_resumed=ledger.segments_resumed, reward_fallbacks=ledger.reward_fallbacks, backend=self.backend.statistics(),
            rewards=self.reward_pool.statistics() if self.reward_pool is not None else None,
            breaker_open=self._breaker.open, breaker_trips=self._breaker.trips,
            data_position=self._batches.position(),
            retokenization_drifts=ledger.retokenization_drifts,
            scheduling=self._admission.policy.statistics(),
        )

    def _withdraw_queued(self, task_ids: set[int], why: str) -> None:
        """End the queued (not yet started) episodes among ``task_ids`` as failed (``"cancelled"``)."""
        self._end_unstarted(self._admission.withdraw(task_ids), why)

    def _close(self) -> None:
        """Mark closed; episodes never admitted end as failed (``"cancelled"``)."""
        self._end_unstarted(self._admission.close(), "the engine closed before the episode started")

    def _end_unstarted(self, tasks: list[_Task], why: str) -> None:
        for task in tasks:
            result = EpisodeResult(task.task_id, EpisodeStatus.FAILED, reason=FailReason.CANCELLED, error_type="Cancelled",
                                   error_message=why, data=task.data)
            self._buffer.deposit(result)
            self._ended(result, was_running=False)


@asynccontextmanager
async def open_rollout_engine(backend: InferenceBackend, config: EngineConfig | None = None, *,
                              reward_pool: EngineRewards | None = None, tokenizer: Any = None) -> AsyncIterator[RolloutEngine]:
    """Open an engine: the backend (:meth:`InferenceBackend.open`), the admission actor, the reward worker
    pool, the dump writer and every episode task live in this scope.  Leaving it
    cancels episodes still running or queued (recorded as failed, reason
    ``"cancelled"``; finished trajectories are kept), withdraws their generation
    requests, kills their reward jobs, flushes dumps and stops the backend.

    Args:
        backend: an :class:`InferenceBackend` (``SimBackend``, ``HFBackend``, ...).
        config: :class:`EngineConfig`; defaults if omitted.
        reward_pool: an already-open reward pool to share; by default one is
            opened with the ``reward_*`` settings of ``config``.
        tokenizer: used only to decode text in trajectory dumps.

    Raises:
        Whatever the backend's start-up raises (e.g. the model cannot be loaded),
        as itself: an error raised while the engine starts, or by the body of the
        ``async with`` block, is not wrapped in an ``ExceptionGroup`` (several
        errors at once still are; :func:`engine.errors.unwrap_single`).
    """
    config = config or EngineConfig()
    dumper = TrajectoryDumper(config.dump_dir, tokenizer) if config.dump_dir else None
    try:
        with gc_tuned(config.gc_tuning):
            # shared resources (engine.shared_resource) close after the episodes and the backend
            async with open_engine_resources() as resources, \
                    open_services(backend, config, reward_pool, dumper) as (nursery, pool):
                engine = RolloutEngine(nursery, backend, pool, config, dumper)
                engine._resources = resources
                nursery.start_soon(engine._admit_forever, name="admission")
                try:
                    yield engine
                finally:
                    engine._close()  # then the episodes' nursery is cancelled
    except BaseExceptionGroup as group:
        single = unwrap_single(group)
        if single is group:
            raise
    else:
        return
    raise single  # outside the handler: its own __cause__/__context__ stay as they were
