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
"""

from __future__ import annotations

import collections
import contextvars
import inspect
import logging
import math
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import trio
from tensordict import TensorDict

from ._gc import gc_tuned
from .backends.base import GenerationJob, InferenceBackend, PerRequestBackend, validate_response
from ._breaker import FailureBreaker, FailureLog
from .buffer import ResultBuffer
from .datastream import DataStream
from .chat import collect_drift_events
from .data import concat_padded_tensors
from .dump import TrajectoryDumper
from .errors import (BackendError, DataExhaustedError, DatasetError, EpisodeFailuresError, failure_reason,
                     unwrap_single)
from .staleness import StalenessManager
from .types import ModelRequest, ModelResponse

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

logger = logging.getLogger(__name__)

STALENESS_POLICIES = ("drop", "flag")

#: Inside ``arun_episode``: this member's sample index within its group (0 for
#: ``group_size=1``).  Workflows may read it, e.g. to vary a per-sample seed.
sample_index: contextvars.ContextVar[int] = contextvars.ContextVar("sample_index", default=0)
#: Inside an episode: its task id (remote backends route every request of an
#: episode to the same server, to reuse its prefix cache).
episode_id: contextvars.ContextVar[int | None] = contextvars.ContextVar("episode_id", default=None)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine settings (units in the names); validated on construction.

    Attributes:
        max_concurrent_rollouts: episodes running at once (AReaL's ``C``).
        consumer_batch_size: episodes per training batch (AReaL's ``B``); the
            batch size of :meth:`RolloutEngine.prepare_batch`.
        max_head_offpolicyness: AReaL's ``eta``: how many versions generation
            may run ahead of training; ``None`` disables the staleness bound.
        buffer_capacity: trajectories the result buffer holds before finished
            episodes wait to deposit (``None``: ``max(1024, 4 * C)``).
        staleness_policy: for a trajectory whose oldest generated token is more
            than ``eta`` versions behind the current version: ``"drop"`` (the
            episode is rejected, reason ``"stale"``) or ``"flag"`` (kept, with
            ``is_stale [B] bool`` set).  Checked on deposit and on each
            ``set_version``.
        drop_incomplete_group: reject a group with any rejected or failed member
            (reason ``"incomplete_group"``).
        reward_normalization: z-score ``rewards`` within a complete group
            (population std + 1e-8, AReaL) and keep raw values as ``original_rewards``.
        should_accept_timeout_s: deadline of ``should_accept_fn`` (seconds).
        dump_dir: when set, every accepted trajectory is also written as a JSONL
            record under ``dump_dir/<version>/`` (:mod:`engine.dump`).
        reward_timeout_seconds, reward_max_retries, reward_max_workers,
        reward_worker_type, reward_batch_size, reward_max_batch_delay_s: the
            reward pool's policy and micro-batching (see :func:`rewards.open_reward_pool`).
            Batching is on by default and adapts to the load: a reward that finds
            a worker free runs at once, alone; under load a worker job takes what
            waits (at most ``reward_batch_size``, and ~20 ms of measured reward
            work, so slow rewards run alone); ``reward_batch_size=1`` turns it off.
        failure_breaker_consecutive, failure_breaker_window, failure_breaker_rate:
            bounded failure (:mod:`engine._breaker`): stop refilling
            :meth:`RolloutEngine.prepare_batch`'s pipeline, and make it raise
            :class:`~engine.errors.EpisodeFailuresError`, after this many failed
            episodes in a row, or when at least ``failure_breaker_rate`` of the last
            ``failure_breaker_window`` ended episodes failed (``None`` disables a rule).
            Rejections and cancellations are not failures.
        gc_tuning: opt-in (the GC is process-wide): while the engine is open,
            freeze the objects alive at open (``gc.freeze``, only if the host froze
            nothing) and raise the young generation's threshold to 10000; the
            host's previous state is restored exactly at close (:mod:`engine._gc`;
            -25% to -30% CPU per episode at zero latency, ``make bench``'s ``ours_gc``
            row).  ``rollout run`` turns it on; the benchmarks report it as a separate side.
    """

    max_concurrent_rollouts: int = 256
    consumer_batch_size: int = 1
    max_head_offpolicyness: int | None = None
    buffer_capacity: int | None = None
    staleness_policy: str = "drop"
    drop_incomplete_group: bool = False
    reward_normalization: bool = False
    should_accept_timeout_s: float = 30.0
    dump_dir: str | None = None
    reward_timeout_seconds: float = 15.0
    reward_max_retries: int = 3
    reward_max_workers: int | None = None
    reward_worker_type: str = "spawn"
    reward_batch_size: int = 64  # rewards._batch.DEFAULT_BATCH_SIZE
    reward_max_batch_delay_s: float = 0.0
    gc_tuning: bool = False
    failure_breaker_consecutive: int | None = 32
    failure_breaker_window: int = 256
    failure_breaker_rate: float | None = 0.9

    def __post_init__(self) -> None:
        for name in ("max_concurrent_rollouts", "consumer_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_head_offpolicyness is not None and self.max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0 or None, got {self.max_head_offpolicyness}")
        if self.buffer_capacity is not None and self.buffer_capacity < 1:
            raise ValueError(f"buffer_capacity must be >= 1 trajectory, got {self.buffer_capacity}")
        if self.staleness_policy not in STALENESS_POLICIES:
            raise ValueError(f"staleness_policy must be one of {STALENESS_POLICIES}, got {self.staleness_policy!r}")
        for name in ("should_accept_timeout_s", "reward_timeout_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and not math.isnan(value)):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.reward_max_retries < 0:
            raise ValueError(f"reward_max_retries must be >= 0, got {self.reward_max_retries}")
        if self.failure_breaker_consecutive is not None and self.failure_breaker_consecutive < 1:
            raise ValueError(f"failure_breaker_consecutive must be >= 1 or None, got {self.failure_breaker_consecutive}")
        if self.failure_breaker_window < 1:
            raise ValueError(f"failure_breaker_window must be >= 1, got {self.failure_breaker_window}")
        rate = self.failure_breaker_rate
        if rate is not None and not (isinstance(rate, (int, float)) and 0 < rate <= 1):
            raise ValueError(f"failure_breaker_rate must be in (0, 1] or None, got {rate!r}")


@dataclass(frozen=True)
class EpisodeResult:
    """How one submitted episode ended.

    Attributes:
        task_id: the id ``submit`` returned.
        status: ``"accepted"``, ``"rejected"`` or ``"failed"``.
        trajectory: when accepted, the trajectory TensorDict (batch ``[B]``: the
            rows of every accepted group member, by sample index, with
            ``group_id [B] int64`` and ``group_size [B] int32``); else ``None``.
        reason: ``None`` when accepted.  Rejected: ``"workflow_returned_none"``,
            ``"filtered"``, ``"filter_error"``, ``"filter_timeout"``,
            ``"incomplete_group"``, ``"stale"``.  Failed: one of
            :data:`engine.errors.FAILURE_REASONS` or ``"cancelled"``.
        error_type, error_message: the original exception, when failed (or when
            a filter raised).
        member_errors: ``(sample_index, reason, error_type, error_message)`` for
            group members that failed while the group was still accepted.
        data: the dataset item.
        elapsed_s: seconds from admission to the end of the episode.
    """

    task_id: int
    status: str
    trajectory: TensorDict | None = None
    reason: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    member_errors: tuple[tuple[int, str, str, str], ...] = ()
    data: Any = field(default=None, repr=False)
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of the engine (``submitted == queued + running + accepted +
    rejected + failed`` always holds).  Buffer sizes are in trajectories."""

    submitted: int
    queued: int
    running: int
    accepted: int
    rejected: int
    failed: int
    rejected_by_reason: dict[str, int]
    failed_by_reason: dict[str, int]
    results_waiting: int
    buffer_size: int
    buffer_peak: int
    buffer_capacity: float
    capacity: int
    version: int
    paused: bool
    generated_tokens: int
    segments_resumed: int
    reward_fallbacks: int
    backend: dict[str, Any]
    rewards: Any
    #: the failure breaker is open (prepare_batch stopped refilling; see EngineConfig)
    breaker_open: bool = False
    #: times the failure breaker opened
    breaker_trips: int = 0
    #: where prepare_batch is in its dataloader (:meth:`engine.datastream.DataStream.state_dict`), or None
    data_position: dict[str, Any] | None = None
    #: chat-template renderings that differed from the ids sent (:mod:`engine.chat`)
    retokenization_drifts: int = 0


@dataclass(eq=False)
class _Task:
    task_id: int
    workflow: Any
    data: Any
    should_accept_fn: Callable[..., Any] | None
    group_size: int


def _leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _failed(task: _Task, exc: BaseException, reason: str | None = None) -> EpisodeResult:
    return EpisodeResult(task.task_id, "failed", reason=reason or failure_reason(exc),
                         error_type=type(exc).__name__, error_message=str(exc), data=task.data)


@dataclass(eq=False)
class _Feeder:
    """``prepare_batch``'s pipeline: its data stream, the episode spec of the latest
    call, and the episodes it has in flight (queued or running)."""

    stream: DataStream
    workflow: Any
    should_accept_fn: Callable[..., Any] | None
    group_size: int
    ahead: int  # episodes to keep queued or running: (eta + 1) * B (AReaL)
    limit: int  # in flight + accepted results waiting, at most (ahead + B)
    inflight: set[int] = field(default_factory=set)
    error: BaseException | None = None  # raised by the dataloader while refilling


class RolloutEngine:
    """Created by :func:`open_rollout_engine`; do not instantiate directly."""

    def __init__(self, nursery: trio.Nursery, backend: InferenceBackend, jobs: trio.MemorySendChannel,
                 reward_pool: Any, config: EngineConfig, dumper: TrajectoryDumper | None = None) -> None:
        self._nursery = nursery
        self._dumper = dumper
        self.backend = backend
        self._jobs = jobs
        self.reward_pool = reward_pool
        self.config = config
        self._staleness = StalenessManager(config.max_concurrent_rollouts, config.consumer_batch_size,
                                           config.max_head_offpolicyness)
        capacity = config.buffer_capacity or max(1024, 4 * config.max_concurrent_rollouts)
        self._buffer = ResultBuffer(capacity)
        self._queue: collections.deque[_Task] = collections.deque()
        self._admission = trio.lowlevel.ParkingLot()
        self._unpaused = trio.Event()
        self._unpaused.set()
        self._next_id = 0
        self._live_ids: set[int] = set()  # submitted, not yet consumed
        self._closed = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._rejected_by: collections.Counter[str] = collections.Counter()
        self._failed_by: collections.Counter[str] = collections.Counter()
        self._generated_tokens = 0
        self._segments_resumed = 0  # generation segments re-sent after an abort
        self._reward_fallbacks = 0  # reward calls that ended with the pool's fallback value
        self._feeder: _Feeder | None = None
        self._breaker = FailureBreaker(config.failure_breaker_consecutive, config.failure_breaker_window,
                                       config.failure_breaker_rate)
        self._failure_log = FailureLog(logger)
        self._retokenization_drifts = 0  # engine.chat drift events inside episodes
        self._inline = backend.serve_inline if isinstance(backend, PerRequestBackend) else None
        self._workflows: dict[tuple[Any, int], tuple[Any, Any]] = {}  # spec -> (kwargs, instance)

    # -- generation ----------------------------------------------------------
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate a completion for ``req`` on the backend.

        A per-request backend (``SimBackend``, ``MockBackend``, the remote HTTP
        backends) serves it on the caller's task (:meth:`PerRequestBackend.serve_inline`:
        its actor keeps shared state such as the sim's clock); a batching backend
        (``HFBackend``) receives it as a job over the actor's channel.

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
        if self._closed:
            raise trio.ClosedResourceError("the rollout engine is closed")
        budget = req.validate()
        task_id = episode_id.get()
        if task_id is not None and "routing_key" not in req.metadata:  # sticky routing per episode
            req = replace(req, metadata={**req.metadata, "routing_key": f"episode-{task_id}"})
        prompt = list(req.input_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        start = trio.current_time()
        ttft = None
        while True:
            if not self._unpaused.is_set():  # (no schedule point when not paused: the send below has one)
                await self._unpaused.wait()
            segment_req = req if not tokens else replace(
                req, input_ids=prompt + tokens,  # resume: the new segment continues the partial output
                gconfig=req.gconfig.new(min_new_tokens=max(0, req.gconfig.min_new_tokens - len(tokens))))
            resp = await self._send_job(segment_req, budget - len(tokens))
            validate_response(resp, segment_req)
            if ttft is None:
                ttft = resp.ttft
            tokens += resp.output_tokens
            logprobs += resp.output_logprobs
            versions += resp.output_versions
            self._generated_tokens += resp.output_len
            if len(tokens) > resp.output_len:
                self._segments_resumed += 1
            if len(tokens) > budget:
                raise BackendError(f"request {req.rid}: backend returned {len(tokens)} tokens for a budget of {budget}")
            stop_reason = resp.stop_reason
            if stop_reason != "abort":
                break
            if len(tokens) == budget:
                stop_reason = "length"
                break
        return ModelResponse(
            input_tokens=prompt, output_tokens=tokens, output_logprobs=logprobs, output_versions=versions,
            stop_reason=stop_reason, latency=trio.current_time() - start, ttft=ttft,
            tokenizer=req.tokenizer, processor=req.processor,
        )

    async def _send_job(self, req: ModelRequest, budget: int) -> ModelResponse:
        if self._inline is not None:
            return await self._inline(req, budget)
        reply_send, reply_recv = trio.open_memory_channel(1)
        job = GenerationJob(req, budget, reply_send, enqueued_at=trio.current_time())
        try:
            with reply_recv:
                await self._jobs.send(job)
                result = await reply_recv.receive()
        except BaseException:
            job.withdraw()  # skipped if still queued, interrupted if running
            raise
        return result.unwrap()

    # -- version, pause ------------------------------------------------------------
    @property
    def version(self) -> int:
        """The current policy version, owned by the backend (tokens generated now
        are tagged with it)."""
        return self.backend.version

    def set_version(self, version: int) -> None:
        """Set the policy version; wakes admission at once and re-checks the
        staleness of buffered trajectories."""
        self.backend.version = version
        self._recheck_buffer()
        self._admission.unpark_all()

    async def update_weights(self, source: Any, *, version: int, mode: str = "abort") -> None:
        """Swap the policy's weights mid-rollout (partial rollout).

        Dispatch of new episodes and generation segments pauses; the backend
        either aborts in-flight generations (they are resumed afterwards by
        re-sending prompt + partial output) or parks them in place; the weights
        load; the version becomes ``version``; dispatch resumes.  Every episode in
        flight completes, with per-token versions showing the boundary.

        Args:
            source: a state dict or a checkpoint folder (backend-specific).
            mode: ``"abort"`` or ``"in_place"``.

        Raises:
            BackendError: the backend cannot update weights, or the new weights do
                not fit (the old weights and version stay; dispatch resumes).
        """
        update = getattr(self.backend, "update_weights", None)
        if update is None:
            raise BackendError(f"{type(self.backend).__name__} does not support weight updates")
        was_paused = self.paused
        self.pause()
        try:
            await update(source, version=version, mode=mode)
        finally:
            if not was_paused:
                self.resume()
        self.set_version(version)

    def restore(self, version: int) -> None:
        """Resume after loading a checkpoint taken at ``version``: sets the version
        and resets the staleness counter of accepted episodes to ``version * B``
        (AReaL issue #1388)."""
        self._staleness.restore(version)
        self.set_version(version)

    def pause(self) -> None:
        """Stop starting episodes and sending new generation segments; segments in
        flight finish."""
        if self._unpaused.is_set():
            self._unpaused = trio.Event()

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._unpaused.set()
        self._admission.unpark_all()

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

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
            trio.ClosedResourceError: the engine is closed.
        """
        if self._closed:
            raise trio.ClosedResourceError("the rollout engine is closed")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        wf = self._resolve(workflow, workflow_kwargs)
        if task_id is None:
            task_id = self._next_id
        elif task_id in self._live_ids:
            raise ValueError(f"task_id {task_id} is already in use")
        self._next_id = max(self._next_id, task_id + 1)
        self._live_ids.add(task_id)
        self._queue.append(_Task(task_id, wf, data, should_accept_fn, group_size))
        self._counts["submitted"] += 1
        self._counts["queued"] += 1
        self._admission.unpark_all()
        return task_id

    def _resolve(self, workflow: Any, workflow_kwargs: dict[str, Any] | None) -> Any:
        """Resolve a workflow spec; a class or dotted path given again with the same
        kwargs object reuses the instance built the first time (building one can
        load a tokenizer)."""
        from workflows.base import resolve_workflow

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
            await self._admission.park()

    def _admit_now(self) -> None:
        """Start queued episodes while capacity allows (sync: called by the
        admission actor, and by an ending episode so that its successor starts in
        the next pass of the run queue instead of the one after)."""
        while self._queue and not self._closed and not self.paused and self._staleness.capacity(self.version) > 0:
            task = self._queue.popleft()
            self._counts["queued"] -= 1
            self._counts["running"] += 1
            self._staleness.running += 1
            self._nursery.start_soon(self._run_episode, task, name=f"episode-{task.task_id}")

    # -- one episode -------------------------------------------------------------------
    async def _run_episode(self, task: _Task) -> None:
        episode_id.set(task.task_id)
        start = trio.current_time()
        result: EpisodeResult | None = None
        try:
            result = await self._episode_result(task)
            result = replace(self._check_staleness(result), elapsed_s=trio.current_time() - start)
            await self._buffer.put(result)  # backpressure: wait for room
        except trio.Cancelled:
            if result is None:  # unfinished work is cancelled; finished work is kept
                result = EpisodeResult(task.task_id, "failed", reason="cancelled", error_type="Cancelled",
                                       error_message="the episode was cancelled", data=task.data,
                                       elapsed_s=trio.current_time() - start)
            self._buffer._put_now(result, ResultBuffer._rows(result))
            self._ended(result, was_running=True)
            raise
        self._ended(result, was_running=True)

    async def _episode_result(self, task: _Task) -> EpisodeResult:
        from rewards import collect_reward_outcomes

        outcomes: list[Any] = [None] * task.group_size

        async def member(i: int) -> None:
            sample_index.set(i)  # task-local: each member runs in its own task (or context)
            with collect_reward_outcomes() as scored, collect_drift_events() as drifts:
                try:
                    outcomes[i] = await task.workflow.arun_episode(self, task.data)
                except Exception as exc:
                    outcomes[i] = _leaf(exc)
            self._reward_fallbacks += sum(o.is_fallback for o in scored)
            self._retokenization_drifts += len(drifts)

        if task.group_size == 1:
            await member(0)  # the episode task's own context
        else:
            async with trio.open_nursery() as nursery:  # cancelling the group cancels all members
                for i in range(task.group_size):
                    nursery.start_soon(member, i)

        trajs, errors, rejected = [], [], 0
        for i, out in enumerate(outcomes):
            if isinstance(out, BaseException):
                errors.append((i, out))
            elif out is None:
                rejected += 1
            elif not isinstance(out, TensorDict) or out.batch_dims != 1:
                errors.append((i, TypeError(f"arun_episode returned {type(out).__name__}, expected a "
                                            "TensorDict with batch size [B] or None")))
            elif out.batch_size[0] == 0:
                errors.append((i, ValueError("arun_episode returned a TensorDict with 0 rows (batch size [0]); "
                                             "return None to reject an episode")))
            else:
                trajs.append(out)
        for i, exc in errors:
            if self._closed and isinstance(exc, trio.ClosedResourceError):
                continue
            self._failure_log.failed(failure_reason(exc), f"episode {task.task_id} sample {i} failed: "
                                     f"{type(exc).__name__}: {exc}", trio.current_time())
        if not trajs:
            if errors:
                exc = errors[0][1]
                if self._closed and isinstance(exc, trio.ClosedResourceError):  # closing, not a workflow bug
                    return _failed(task, exc, reason="cancelled")
                return _failed(task, exc)
            return EpisodeResult(task.task_id, "rejected", reason="workflow_returned_none", data=task.data)
        complete = not errors and not rejected
        if not complete and self.config.drop_incomplete_group:
            return EpisodeResult(task.task_id, "rejected", reason="incomplete_group", data=task.data)
        try:
            traj = self._finish_group(task, trajs, complete)
        except ValueError as exc:  # members with different key sets/dtypes
            return _failed(task, exc, reason="workflow_error")
        member_errors = tuple((i, failure_reason(e), type(e).__name__, str(e)) for i, e in errors)
        if task.should_accept_fn is not None:
            reason, exc = await self._run_filter(task.should_accept_fn, traj)
            if reason is not None:
                return EpisodeResult(task.task_id, "rejected", reason=reason, data=task.data,
                                     error_type=type(exc).__name__ if exc else None,
                                     error_message=str(exc) if exc else None)
        return EpisodeResult(task.task_id, "accepted", trajectory=traj, data=task.data, member_errors=member_errors)

    def _finish_group(self, task: _Task, trajs: list[TensorDict], complete: bool) -> TensorDict:
        traj = trajs[0] if len(trajs) == 1 else concat_padded_tensors(trajs)
        rows = traj.batch_size[0]
        traj = traj.clone(recurse=False)
        traj["group_id"] = torch.full((rows,), task.task_id, dtype=torch.int64)  # [B]
        traj["group_size"] = torch.full((rows,), rows, dtype=torch.int32)  # [B]
        if self.config.reward_normalization and "rewards" in traj.keys():
            raw = traj["rewards"]  # [B] float32
            traj["original_rewards"] = raw.clone()
            if complete:  # AReaL: population std + 1e-8
                traj["rewards"] = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-8)
        if self.config.staleness_policy == "flag" and self.config.max_head_offpolicyness is not None:
            traj["is_stale"] = torch.zeros(rows, dtype=torch.bool)  # [B]
        return traj

    async def _run_filter(self, fn: Callable[..., Any], traj: TensorDict) -> tuple[str | None, Exception | None]:
        """Run ``should_accept_fn`` under its deadline -> (rejection reason or None, error)."""
        with trio.move_on_after(self.config.should_accept_timeout_s) as scope:
            try:
                if inspect.iscoroutinefunction(fn):
                    ok = await fn(traj)
                else:
                    ok = await trio.to_thread.run_sync(fn, traj, abandon_on_cancel=True)
            except Exception as exc:
                return "filter_error", exc
        if scope.cancelled_caught:
            return "filter_timeout", None
        return (None, None) if ok else ("filtered", None)

    # -- staleness -------------------------------------------------------------------------
    def _is_stale(self, traj: TensorDict) -> torch.Tensor:
        """[B] bool: oldest generated token more than eta versions behind."""
        eta = self.config.max_head_offpolicyness
        versions = traj["versions"]  # [B, T] int32, -1 on prompt and padding
        generated = (traj["loss_mask"] > 0) & traj["attention_mask"]  # [B, T]
        big = torch.iinfo(versions.dtype).max
        oldest = torch.where(generated, versions, torch.full_like(versions, big)).amin(dim=1)  # [B]
        return (oldest != big) & (self.version - oldest > eta)

    def _check_staleness(self, result: EpisodeResult) -> EpisodeResult:
        traj = result.trajectory
        if traj is None or self.config.max_head_offpolicyness is None or "versions" not in traj.keys():
            return result
        stale = self._is_stale(traj)
        if self.config.staleness_policy == "flag":
            traj["is_stale"] = stale
            return result
        if bool(stale.any()):
            return replace(result, status="rejected", trajectory=None, reason="stale")
        return result

    def _recheck_buffer(self) -> None:
        """After a version change: drop or flag trajectories that turned stale."""
        if self.config.max_head_offpolicyness is None:
            return
        for result in self._buffer.results():
            if result.trajectory is None:
                continue
            checked = self._check_staleness(result)
            if checked.status != result.status:  # accepted -> rejected (stale)
                self._buffer.replace(result.task_id, checked)
                self._reclassify(result, checked)

    # -- accounting ------------------------------------------------------------------------
    def _ended(self, result: EpisodeResult, *, was_running: bool) -> None:
        self._counts["running" if was_running else "queued"] -= 1
        if was_running:
            self._staleness.running -= 1
        self._count_end(result, +1)
        self._breaker.record(result)
        if self._feeder is not None:
            self._feeder.inflight.discard(result.task_id)
            self._refill()
        self._admit_now()  # here, not via the admission actor: the successor starts one run-queue pass sooner
        if self._dumper is not None and result.status == "accepted":
            self._dumper.record(result, self.version)

    def _count_end(self, result: EpisodeResult, sign: int) -> None:
        self._counts[result.status] += sign
        if result.status == "accepted":
            self._staleness.accepted += sign
        elif result.status == "rejected":
            self._rejected_by[result.reason] += sign
        else:
            self._failed_by[result.reason] += sign

    def _reclassify(self, old: EpisodeResult, new: EpisodeResult) -> None:
        self._count_end(old, -1)
        self._count_end(new, +1)
        self._admission.unpark_all()

    # -- results -----------------------------------------------------------------------------
    def _take(self, results: list[EpisodeResult]) -> list[EpisodeResult]:
        for r in results:
            self._live_ids.discard(r.task_id)
        return results

    async def _wait_for(self, predicate: Callable[[], bool], timeout: float | None, what: str) -> None:
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await self._buffer.wait_until(predicate)
        if not predicate():
            raise TimeoutError(f"{what} within {timeout} s{self._why_waiting()}")

    def _why_waiting(self) -> str:
        """Explain queued episodes that cannot start (for timeout messages)."""
        queued = self._counts["queued"]
        if not queued:
            return ""
        if self.paused:
            return f"; {queued} episodes are queued because the engine is paused (call resume())"
        if self._staleness.capacity(self.version) <= 0 and self._counts["running"] == 0:
            eta, B = self.config.max_head_offpolicyness, self.config.consumer_batch_size
            return (f"; {queued} episodes are queued and cannot start: the staleness bound "
                    f"(max_head_offpolicyness={eta}, consumer_batch_size={B}, version={self.version}, "
                    f"{self._staleness.accepted} accepted) allows no more until set_version() is called "
                    "after a training step")
        return f"; {queued} episodes are still queued"

    async def wait_results(self, count: int, timeout: float | None = None) -> list[EpisodeResult]:
        """Wait until ``count`` episodes have ended (accepted or not) and take their
        records, oldest completion first.

        Raises:
            TimeoutError: ``timeout`` seconds passed first; nothing is consumed.
            ValueError: ``count`` is negative or more than could ever end.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._live_ids):
            raise ValueError(f"count={count} but only {len(self._live_ids)} episodes are pending or unconsumed")
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
        if task_id not in self._live_ids:
            raise ValueError(f"task_id {task_id} is unknown or already consumed")
        await self._wait_for(lambda: task_id in self._buffer, timeout, f"task {task_id} did not end")
        return self._take([self._buffer.pop(task_id)])[0]

    async def rollout_batch(self, items: Iterable[Any], workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
                            should_accept_fn: Callable[..., Any] | None = None, group_size: int = 1) -> TensorDict:
        """Submit every item, wait for all of them, and return the accepted
        trajectories concatenated (:func:`engine.data.concat_padded_tensors`), in
        submission order.  Rejected and failed episodes are left out.

        Raises:
            EpisodeFailuresError: the failure breaker opened (recent episodes all
                failed): this call's episodes not yet started end as failed
                (``"cancelled"``), the running ones are waited for, then this raises.
            DatasetError: ``items`` is a dict or a string (e.g. a collated batch).
        """
        if isinstance(items, (dict, str, bytes)):
            raise DatasetError(f"rollout_batch: items must be an iterable of dataset items, got "
                               f"{type(items).__name__} (a dict here is usually a collated batch: "
                               "build the DataLoader with collate_fn=lambda rows: rows)")
        if self._breaker.open and self._breaker.reported:
            self._breaker.reset()
        wf = self._resolve(workflow, workflow_kwargs)
        ids = [self.submit(item, wf, should_accept_fn=should_accept_fn, group_size=group_size) for item in items]
        trips = self._breaker.trips
        pos = 0

        def all_ended() -> bool:  # amortised O(len(ids)) over all wake-ups
            nonlocal pos
            while pos < len(ids) and ids[pos] in self._buffer:
                pos += 1
            return pos == len(ids)

        def tripped() -> bool:
            return self._breaker.trips > trips and self._breaker.open

        await self._buffer.wait_until(lambda: all_ended() or tripped())
        if not all_ended():
            self._withdraw_queued(set(ids), "not started: the failure breaker opened")
            await self._buffer.wait_until(all_ended)
        results = self._take([self._buffer.pop(i) for i in ids])
        if self._breaker.open and self._breaker.trips > trips:
            self._raise_breaker("rollout_batch")
        return concat_padded_tensors([r.trajectory for r in results if r.status == "accepted"])

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
        ``max(B, C) + B``).  Refills use the episode spec of the latest call.

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
                one example.  The next call submits again.
            DataExhaustedError: the one-pass dataloader had no more items and all
                its episodes were returned.
            DatasetError: the dataloader yields no items, is a torch ``DataLoader``
                with the default collate, or is a different object than the one
                the engine streams from.
        """
        if self._closed:
            raise trio.ClosedResourceError("the rollout engine is closed")
        B = self.config.consumer_batch_size
        if self._breaker.open and self._breaker.reported:  # called again after the error: submit again
            self._breaker.reset()
        feeder = self._feeder_for(dataloader, workflow, workflow_kwargs, should_accept_fn, group_size)

        def ready() -> bool:
            return (len(self._buffer) if dynamic_bs else self._buffer.accepted_results) >= B

        def drained() -> bool:  # a one-pass dataloader ran out and all its episodes ended
            return feeder.stream.exhausted and not feeder.inflight

        def stop_waiting() -> bool:
            return ready() or self._breaker.open or feeder.error is not None or drained()

        self._refill()
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await self._buffer.wait_until(stop_waiting)
        self._raise_feeder_error(feeder)
        if not ready():
            if self._breaker.open:
                self._raise_breaker("prepare_batch")
            if drained():
                if not len(self._buffer) or (not dynamic_bs and not self._buffer.accepted_results):
                    raise DataExhaustedError(
                        f"prepare_batch: the one-pass dataloader is exhausted after {feeder.stream.items_taken} "
                        "items and every episode it fed has been returned")
                taken = self._take([self._buffer.pop_oldest() for _ in range(len(self._buffer))])
                return concat_padded_tensors([r.trajectory for r in taken if r.status == "accepted"])
            raise TimeoutError(f"prepare_batch: fewer than {B} {'ended' if dynamic_bs else 'accepted'} results "
                               f"within {timeout} s{self._why_waiting()}{self._breaker.recent_failures()}")
        taken: list[EpisodeResult] = []
        accepted = 0
        while (len(taken) < B) if dynamic_bs else (accepted < B):
            taken.append(self._buffer.pop_oldest())
            accepted += taken[-1].status == "accepted"
        self._take(taken)
        self._refill()  # top the pipeline back up at once: the next batch generates while the trainer trains
        return concat_padded_tensors([r.trajectory for r in taken if r.status == "accepted"])

    @property
    def data_stream(self) -> DataStream | None:
        """The :class:`~engine.datastream.DataStream` that ``prepare_batch`` reads, or ``None``."""
        return self._feeder.stream if self._feeder is not None else None

    def reset_data_stream(self) -> None:
        """Forget ``prepare_batch``'s dataloader, so the next call may pass another one.
        Episodes already submitted from the old one still run and are returned."""
        self._feeder = None

    def _feeder_for(self, dataloader: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None,
                    should_accept_fn: Callable[..., Any] | None, group_size: int) -> _Feeder:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        feeder = self._feeder
        if feeder is not None and dataloader is not feeder.stream and dataloader is not feeder.stream.source:
            if not (feeder.stream.exhausted and not feeder.inflight):
                raise DatasetError(
                    f"prepare_batch: dataloader is a different object ({type(dataloader).__name__}) than the one "
                    f"this engine streams from ({feeder.stream!r}); pass the same object every call (a new list "
                    "per call would restart at item 0), call engine.reset_data_stream() to switch, or use "
                    "rollout_batch(items) for a fixed set of items")
            feeder = None
        wf = self._resolve(workflow, workflow_kwargs)
        if feeder is None:
            stream = dataloader if isinstance(dataloader, DataStream) else DataStream(dataloader)
            B, eta = self.config.consumer_batch_size, self.config.max_head_offpolicyness
            ahead = (eta + 1) * B if eta is not None else max(B, self.config.max_concurrent_rollouts)
            feeder = self._feeder = _Feeder(stream, wf, should_accept_fn, group_size, ahead, ahead + B)
        feeder.workflow, feeder.should_accept_fn, feeder.group_size = wf, should_accept_fn, group_size
        return feeder

    def _refill(self) -> None:
        """Submit from ``prepare_batch``'s dataloader while its pipeline has room (sync:
        called after a batch is taken and as each episode ends)."""
        feeder = self._feeder
        if feeder is None or self._closed or self._breaker.open or feeder.error is not None:
            return
        while (len(feeder.inflight) < feeder.ahead
               and len(feeder.inflight) + self._buffer.accepted_results < feeder.limit):
            try:
                ok, item = feeder.stream.take()
            except Exception as exc:  # the user's dataloader raised: prepare_batch re-raises it
                feeder.error = exc
                self._buffer.wake_consumers()
                return
            if not ok:
                self._buffer.wake_consumers()  # a waiting prepare_batch may be drained now
                return
            feeder.inflight.add(self.submit(item, feeder.workflow, should_accept_fn=feeder.should_accept_fn,
                                            group_size=feeder.group_size))
        self._admit_now()

    def _raise_feeder_error(self, feeder: _Feeder) -> None:
        if feeder.error is not None:
            exc, feeder.error = feeder.error, None
            raise exc

    def _raise_breaker(self, where: str) -> None:
        trip = self._breaker.trip
        self._breaker.reported = True  # stays open: nothing is submitted until the caller calls again
        raise EpisodeFailuresError(
            f"{where}: stopped submitting: {trip.describe()}; fix the cause and call {where} again", trip)

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot; sync and cheap."""
        c = self._counts
        return EngineStatistics(
            submitted=c["submitted"], queued=c["queued"], running=c["running"], accepted=c["accepted"],
            rejected=c["rejected"], failed=c["failed"],
            rejected_by_reason={k: v for k, v in self._rejected_by.items() if v},
            failed_by_reason={k: v for k, v in self._failed_by.items() if v},
            results_waiting=len(self._buffer), buffer_size=self._buffer.rows, buffer_peak=self._buffer.peak_rows,
            buffer_capacity=self._buffer.capacity, capacity=self._staleness.capacity(self.version), version=self.version,
            paused=self.paused, generated_tokens=self._generated_tokens,
            segments_resumed=self._segments_resumed, reward_fallbacks=self._reward_fallbacks, backend=self.backend.statistics(),
            rewards=self.reward_pool.statistics() if self.reward_pool is not None else None,
            breaker_open=self._breaker.open, breaker_trips=self._breaker.trips,
            data_position=self._feeder.stream.state_dict() if self._feeder is not None else None,
            retokenization_drifts=self._retokenization_drifts,
        )

    def _withdraw_queued(self, task_ids: set[int], why: str) -> None:
        """End the queued (not yet started) episodes among ``task_ids`` as failed (``"cancelled"``)."""
        keep: collections.deque[_Task] = collections.deque()
        withdrawn = []
        for task in self._queue:
            (withdrawn if task.task_id in task_ids else keep).append(task)
        self._queue = keep
        for task in withdrawn:
            result = EpisodeResult(task.task_id, "failed", reason="cancelled", error_type="Cancelled",
                                   error_message=why, data=task.data)
            self._buffer._put_now(result, 0)
            self._ended(result, was_running=False)

    def _close(self) -> None:
        """Mark closed; episodes never admitted end as failed (``"cancelled"``)."""
        self._closed = True
        while self._queue:
            task = self._queue.popleft()
            result = EpisodeResult(task.task_id, "failed", reason="cancelled", error_type="Cancelled",
                                   error_message="the engine closed before the episode started", data=task.data)
            self._buffer._put_now(result, 0)
            self._ended(result, was_running=False)


@asynccontextmanager
async def open_rollout_engine(backend: InferenceBackend, config: EngineConfig | None = None, *,
                              reward_pool: Any = None, tokenizer: Any = None) -> AsyncIterator[RolloutEngine]:
    """Open an engine: the backend actor, the admission actor, the reward worker
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
            async with _open_engine(backend, config, reward_pool, dumper) as engine:
                yield engine
    except BaseExceptionGroup as group:
        single = unwrap_single(group)
        if single is group:
            raise
    else:
        return
    raise single  # outside the handler: its own __cause__/__context__ stay as they were


@asynccontextmanager
async def _open_engine(backend: InferenceBackend, config: EngineConfig, reward_pool: Any,
                       dumper: TrajectoryDumper | None) -> AsyncIterator[RolloutEngine]:
    from rewards import open_reward_pool

    async with _maybe_pool(reward_pool, config, open_reward_pool) as pool:
        async with trio.open_nursery() as services:
            if dumper is not None:
                await services.start(dumper.run)
            try:
                async with trio.open_nursery() as nursery:
                    jobs_send, jobs_recv = trio.open_memory_channel(config.max_concurrent_rollouts)
                    await nursery.start(backend.run, jobs_recv)
                    engine = RolloutEngine(nursery, backend, jobs_send, pool, config, dumper)
                    nursery.start_soon(engine._admit_forever, name="admission")
                    try:
                        yield engine
                    finally:
                        engine._close()
                        nursery.cancel_scope.cancel()
                        jobs_send.close()
            finally:
                if dumper is not None:
                    dumper.close()  # the writer drains what is queued, then returns
                with trio.CancelScope(shield=True):
                    await backend.aclose()


@asynccontextmanager
async def _maybe_pool(pool: Any, config: EngineConfig, opener: Any) -> AsyncIterator[Any]:
    if pool is not None:
        yield pool
        return
    async with opener(timeout_seconds=config.reward_timeout_seconds, max_retries=config.reward_max_retries,
                      max_workers=config.reward_max_workers, worker_type=config.reward_worker_type,
                      batch_size=config.reward_batch_size,
                      max_batch_delay_s=config.reward_max_batch_delay_s) as opened:
        yield opened
