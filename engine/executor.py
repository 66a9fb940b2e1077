"""The rollout engine: one trio task per episode under the engine's nursery.

::

    async with open_rollout_engine(backend, config=EngineConfig(...)) as engine:
        task_id = engine.submit(data, workflow)           # returns at once
        results = await engine.wait_results(count=1)      # EpisodeResult records
        batch = await engine.rollout_batch(items, workflow)  # padded TensorDict

Accounting (ours, always true): ``submitted == queued + running + accepted +
rejected + failed``; every submitted episode ends exactly once as ``accepted``
(the workflow returned a trajectory), ``rejected`` (it returned ``None``) or
``failed`` (it raised, or was cancelled), with a reason.  One failing episode
never stops the run.  Contract names follow AReaL ``WorkflowExecutor``
(``areal/infra/workflow_executor.py``).
"""

from __future__ import annotations

import logging
import math
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from tensordict import TensorDict

from .backends.base import GenerationJob, InferenceBackend, validate_response
from .data import concat_padded_tensors
from .errors import BackendError, failure_reason
from .types import ModelRequest, ModelResponse

__all__ = ["EngineConfig", "EngineStatistics", "EpisodeResult", "RolloutEngine", "open_rollout_engine"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Engine settings (units in the names).

    Attributes:
        max_concurrent_rollouts: episodes running at once (AReaL's ``C``).
        reward_timeout_seconds: per-attempt reward deadline; the worker is killed.
        reward_max_retries: retries after the first attempt (AReaL default 3).
        reward_max_workers: reward worker processes (``None``: AReaL's derivation).
        reward_worker_type: ``"spawn"`` or ``"forkserver"`` (never fork with torch).
    """

    max_concurrent_rollouts: int = 256
    reward_timeout_seconds: float = 15.0
    reward_max_retries: int = 3
    reward_max_workers: int | None = None
    reward_worker_type: str = "spawn"

    def __post_init__(self) -> None:
        if self.max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {self.max_concurrent_rollouts}")
        if not (math.isfinite(self.reward_timeout_seconds) and self.reward_timeout_seconds > 0):
            raise ValueError(f"reward_timeout_seconds must be a finite number > 0, got {self.reward_timeout_seconds}")
        if self.reward_max_retries < 0:
            raise ValueError(f"reward_max_retries must be >= 0, got {self.reward_max_retries}")


@dataclass(frozen=True)
class EpisodeResult:
    """How one submitted episode ended.

    Attributes:
        task_id: the id ``submit`` returned.
        status: ``"accepted"``, ``"rejected"`` or ``"failed"``.
        trajectory: the trajectory (batch ``[B]``) when accepted, else ``None``.
        reason: ``None`` when accepted; ``"workflow_returned_none"`` when
            rejected; one of :data:`engine.errors.FAILURE_REASONS` or
            ``"cancelled"`` when failed.
        error_type, error_message: the original exception, when failed.
        data: the dataset item the episode ran on.
        elapsed_s: seconds from start to end of the episode.
    """

    task_id: int
    status: str
    trajectory: TensorDict | None = None
    reason: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    data: Any = field(default=None, repr=False)
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of the engine's accounting (``submitted == queued + running +
    accepted + rejected + failed``)."""

    submitted: int
    queued: int
    running: int
    accepted: int
    rejected: int
    failed: int
    rejected_by_reason: dict[str, int]
    failed_by_reason: dict[str, int]
    results_waiting: int
    version: int
    backend: dict[str, Any]
    rewards: Any


def _leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


class RolloutEngine:
    """Created by :func:`open_rollout_engine`; do not instantiate directly."""

    def __init__(self, nursery: trio.Nursery, backend: InferenceBackend, jobs: trio.MemorySendChannel,
                 reward_pool: Any, config: EngineConfig) -> None:
        self._nursery = nursery
        self.backend = backend
        self._jobs = jobs
        self.reward_pool = reward_pool
        self.config = config
        self._limiter = trio.CapacityLimiter(config.max_concurrent_rollouts)
        self._next_id = 0
        self._closed = False
        self._counts: Counter[str] = Counter()
        self._rejected_by: Counter[str] = Counter()
        self._failed_by: Counter[str] = Counter()
        self._done: OrderedDict[int, EpisodeResult] = OrderedDict()  # completion order
        self._pending: set[int] = set()
        self._wakeup = trio.lowlevel.ParkingLot()

    # -- generation ----------------------------------------------------------
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate a completion for ``req`` through the backend actor.

        An interrupted generation (stop reason ``"abort"``, e.g. during a weight
        update) is resumed by re-sending prompt + partial output with the budget
        lowered; an abort that lands exactly at the budget is reported as
        ``"length"`` with all tokens kept.  Cancelling the caller withdraws the
        request from the backend.

        Raises:
            InvalidRequestError: the request is malformed or its budget is <= 0.
            BackendError: the backend failed or its response broke the evidence
                rules (``validate_response``).
            trio.ClosedResourceError: the engine is closed.
        """
        if self._closed:
            raise trio.ClosedResourceError("the rollout engine is closed")
        budget = req.validate()
        prompt = list(req.input_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        start = trio.current_time()
        ttft = None
        while True:
            segment_req = req if not tokens else ModelRequest(
                rid=req.rid, input_ids=prompt + tokens, gconfig=req.gconfig, metadata=req.metadata,
                tokenizer=req.tokenizer, image_data=req.image_data, processor=req.processor,
            )
            resp = await self._send_job(segment_req, budget - len(tokens))
            validate_response(resp, segment_req)
            if ttft is None:
                ttft = resp.ttft
            tokens += resp.output_tokens
            logprobs += resp.output_logprobs
            versions += resp.output_versions
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
        reply_send, reply_recv = trio.open_memory_channel(1)
        job = GenerationJob(req, budget, reply_send, enqueued_at=trio.current_time())
        try:
            with reply_recv:
                await self._jobs.send(job)
                result = await reply_recv.receive()
        except BaseException:
            job.withdraw()  # withdraw: skipped if queued, interrupted if running
            raise
        return result.unwrap()

    @property
    def version(self) -> int:
        """The current policy version (tokens generated now are tagged with it)."""
        return self.backend.version

    def set_version(self, version: int) -> None:
        """Set the policy version tagged on tokens of segments sent from now on."""
        self.backend.version = version

    # -- episodes --------------------------------------------------------------
    def submit(self, data: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
               task_id: int | None = None) -> int:
        """Start an episode of ``workflow`` on ``data``; returns its task id at once.

        ``workflow`` is an instance, a class (with ``workflow_kwargs``), a dotted
        path, or an object with ``async run(engine, data)``
        (see :func:`workflows.resolve_workflow`).  At most
        ``max_concurrent_rollouts`` episodes run; the rest queue in FIFO order.

        Raises:
            WorkflowError: the workflow spec cannot be resolved.
            ValueError: ``task_id`` is already in use.
            trio.ClosedResourceError: the engine is closed.
        """
        from workflows.base import resolve_workflow

        if self._closed:
            raise trio.ClosedResourceError("the rollout engine is closed")
        wf = resolve_workflow(workflow, workflow_kwargs)
        if task_id is None:
            task_id = self._next_id
        if task_id in self._pending or task_id in self._done:
            raise ValueError(f"task_id {task_id} is already in use")
        self._next_id = max(self._next_id, task_id + 1)
        self._pending.add(task_id)
        self._counts["submitted"] += 1
        self._counts["queued"] += 1
        self._nursery.start_soon(self._run_episode, task_id, wf, data, name=f"episode-{task_id}")
        return task_id

    async def _run_episode(self, task_id: int, workflow: Any, data: Any) -> None:
        started = False
        start = trio.current_time()
        try:
            async with self._limiter:
                self._counts["queued"] -= 1
                self._counts["running"] += 1
                started = True
                start = trio.current_time()
                try:
                    traj = await workflow.arun_episode(self, data)
                except Exception as exc:
                    leaf = _leaf(exc)
                    result = EpisodeResult(task_id, "failed", reason=failure_reason(leaf),
                                           error_type=type(leaf).__name__, error_message=str(leaf), data=data)
                    logger.warning("episode %s failed (%s): %s: %s", task_id, result.reason,
                                   result.error_type, result.error_message)
                else:
                    if traj is None:
                        result = EpisodeResult(task_id, "rejected", reason="workflow_returned_none", data=data)
                    elif not isinstance(traj, TensorDict) or traj.batch_dims != 1:
                        result = EpisodeResult(
                            task_id, "failed", reason="workflow_error", error_type="TypeError",
                            error_message=f"arun_episode returned {type(traj).__name__}, expected a TensorDict "
                                          "with batch size [B] or None", data=data)
                    else:
                        result = EpisodeResult(task_id, "accepted", trajectory=traj, data=data)
        except trio.Cancelled:
            self._finish(EpisodeResult(task_id, "failed", reason="cancelled", error_type="Cancelled",
                                       error_message="the episode was cancelled", data=data,
                                       elapsed_s=trio.current_time() - start), started)
            raise
        self._finish(EpisodeResult(**{**result.__dict__, "elapsed_s": trio.current_time() - start}), started)

    def _finish(self, result: EpisodeResult, started: bool) -> None:
        self._counts["running" if started else "queued"] -= 1
        self._counts[result.status] += 1
        if result.status == "rejected":
            self._rejected_by[result.reason] += 1
        elif result.status == "failed":
            self._failed_by[result.reason] += 1
        self._pending.discard(result.task_id)
        self._done[result.task_id] = result
        self._wakeup.unpark_all()

    # -- results -------------------------------------------------------------------
    async def wait_results(self, count: int, timeout: float | None = None) -> list[EpisodeResult]:
        """Wait until ``count`` episodes have ended (accepted or not) and return
        their records, oldest completion first; they are consumed.

        Raises:
            TimeoutError: ``timeout`` seconds passed first; nothing is consumed, so
                a later call still gets every result.
            ValueError: ``count`` is negative or more than could ever complete.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._done) + len(self._pending):
            raise ValueError(f"count={count} but only {len(self._done) + len(self._pending)} episodes "
                             "are running or unconsumed")
        with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
            while len(self._done) < count:
                await self._wakeup.park()
        if scope.cancelled_caught:
            raise TimeoutError(f"{len(self._done)} of {count} episodes ended within {timeout} s")
        return [self._done.popitem(last=False)[1] for _ in range(count)]

    async def wait(self, count: int, timeout: float | None = None) -> list[TensorDict | None]:
        """AReaL's ``wait``: ``count`` completions, oldest first, trajectories of
        accepted episodes and ``None`` for rejected or failed ones."""
        return [r.trajectory for r in await self.wait_results(count, timeout)]

    async def rollout_batch(self, items: Iterable[Any], workflow: Any,
                            workflow_kwargs: dict[str, Any] | None = None) -> TensorDict:
        """Submit every item, wait for all, and return the accepted trajectories
        concatenated into one padded batch (:func:`engine.data.concat_padded_tensors`)."""
        from workflows.base import resolve_workflow

        wf = resolve_workflow(workflow, workflow_kwargs)
        ids = [self.submit(item, wf) for item in items]
        results = [await self.wait_for_task(i) for i in ids]
        return concat_padded_tensors([r.trajectory for r in results if r.status == "accepted"])

    async def wait_for_task(self, task_id: int, timeout: float | None = None) -> EpisodeResult:
        """Wait for one episode and consume its record.

        Raises:
            ValueError: ``task_id`` is unknown or was already consumed.
            TimeoutError: ``timeout`` seconds passed first (the record stays).
        """
        if task_id not in self._pending and task_id not in self._done:
            raise ValueError(f"task_id {task_id} is unknown or already consumed")
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while task_id not in self._done:
                await self._wakeup.park()
        if task_id not in self._done:
            raise TimeoutError(f"task {task_id} did not end within {timeout} s")
        return self._done.pop(task_id)

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of the accounting; sync and cheap."""
        c = self._counts
        return EngineStatistics(
            submitted=c["submitted"], queued=c["queued"], running=c["running"], accepted=c["accepted"],
            rejected=c["rejected"], failed=c["failed"], rejected_by_reason=dict(self._rejected_by),
            failed_by_reason=dict(self._failed_by), results_waiting=len(self._done), version=self.version,
            backend=self.backend.statistics(),
            rewards=self.reward_pool.statistics() if self.reward_pool is not None else None,
        )


@asynccontextmanager
async def open_rollout_engine(backend: InferenceBackend, config: EngineConfig | None = None, *,
                              reward_pool: Any = None) -> AsyncIterator[RolloutEngine]:
    """Open an engine: backend actor, reward worker pool and episode tasks live in
    this scope.  Leaving it cancels episodes still running (recorded as failed,
    reason ``"cancelled"``), stops the backend actor and the reward workers.

    Args:
        backend: an :class:`InferenceBackend` (``SimBackend``, ``HFBackend``, ...).
        config: :class:`EngineConfig`; defaults if omitted.
        reward_pool: an already-open reward pool to share; by default one is
            opened with the ``reward_*`` settings of ``config``.

    Raises:
        Whatever the backend's start-up raises (e.g. the model cannot be loaded).
    """
    from rewards import open_reward_pool

    config = config or EngineConfig()
    async with _maybe_pool(reward_pool, config, open_reward_pool) as pool:
        async with trio.open_nursery() as nursery:
            jobs_send, jobs_recv = trio.open_memory_channel(config.max_concurrent_rollouts)
            await nursery.start(backend.run, jobs_recv)
            engine = RolloutEngine(nursery, backend, jobs_send, pool, config)
            try:
                yield engine
            finally:
                engine._closed = True
                nursery.cancel_scope.cancel()
                jobs_send.close()
        with trio.CancelScope(shield=True):
            await backend.aclose()


@asynccontextmanager
async def _maybe_pool(pool: Any, config: EngineConfig, opener: Any) -> AsyncIterator[Any]:
    if pool is not None:
        yield pool
        return
    async with opener(timeout_seconds=config.reward_timeout_seconds, max_retries=config.reward_max_retries,
                      max_workers=config.reward_max_workers, worker_type=config.reward_worker_type) as opened:
        yield opened
