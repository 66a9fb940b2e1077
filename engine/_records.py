"""How episodes are recorded: ``EpisodeResult`` (one per submitted episode),
``EngineStatistics`` (a snapshot of the engine), the queued/running ``Task``, the
``EngineCalls`` the executor's parts call back, and the helpers that turn an exception
raised inside an episode into a failed result."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from tensordict import TensorDict

from .backends.base import BackendStatistics
from .context import episode_id, sample_index
from .errors import FailReason, _Vocabulary, failure_reason

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["EngineCalls", "EngineStatistics", "EpisodeResult", "EpisodeStatus", "FailReason", "RejectReason", "Submit", "Task",
           "episode_id", "failed_result", "is_cancellation", "leaf_exception", "raised_at", "sample_index"]


class EpisodeStatus(_Vocabulary):
    """How an episode ended (``EpisodeResult.status``); compares equal to its string."""

    ACCEPTED = "accepted"  #: its trajectory is in the result buffer (or was taken)
    REJECTED = "rejected"  #: it ran, and its result was dropped for a :class:`RejectReason`
    FAILED = "failed"  #: something raised or it was cancelled: a :class:`~engine.errors.FailReason`


class RejectReason(_Vocabulary):
    """Why an episode was rejected (``EpisodeResult.reason`` when ``status == "rejected"``)."""

    WORKFLOW_RETURNED_NONE = "workflow_returned_none"  #: the workflow returned ``None`` (AReaL's "reject")
    FILTERED = "filtered"  #: ``should_accept_fn`` returned false
    FILTER_ERROR = "filter_error"  #: ``should_accept_fn`` raised
    FILTER_TIMEOUT = "filter_timeout"  #: ``should_accept_fn`` ran past ``should_accept_timeout_s``
    INCOMPLETE_GROUP = "incomplete_group"  #: fewer group members succeeded than ``min_group_size``
    STALE = "stale"  #: past ``max_head_offpolicyness`` when it ended or while it waited in the buffer
    MISSING_REWARD = "missing_reward"  #: interaction dicts without a reward (:mod:`engine.openai.interaction`)
    #: cut from a short round by ``scheduling="tail_batching"``: its prompt runs again in a long round
    DEFERRED = "deferred"



@dataclass(frozen=True)
class EpisodeResult:
    """How one submitted episode ended.

    Attributes:
        task_id: the id ``submit`` returned.
        status: an :class:`EpisodeStatus` (``"accepted"``, ``"rejected"`` or ``"failed"``).
        trajectory: when accepted, the trajectory TensorDict (batch ``[B]``: the
            rows of every accepted group member, by sample index, with
            ``group_id [B] int64`` and ``group_size [B] int32``); else ``None``.
        reason: ``None`` when accepted; a :class:`RejectReason` when rejected, a
            :class:`~engine.errors.FailReason` when failed (both compare equal to
            their strings, e.g. ``"stale"``, ``"reward_error"``, ``"cancelled"``).
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
    backend: BackendStatistics
    rewards: Any
    #: the failure breaker is open (prepare_batch stopped refilling; see EngineConfig)
    breaker_open: bool = False
    #: times the failure breaker opened
    breaker_trips: int = 0
    #: where prepare_batch is in its dataloader (:meth:`engine.datastream.DataStream.state_dict`), or None
    data_position: dict[str, Any] | None = None
    #: chat-template renderings that differed from the ids sent (:mod:`engine.chat`)
    retokenization_drifts: int = 0
    #: the scheduling policy's counters (:mod:`engine._scheduling`; ``{"policy": name, ...}``), None under ``"fcfs"``
    #: without ``scheduling_max_segments``
    scheduling: dict[str, Any] | None = None


@dataclass(eq=False)
class Task:
    task_id: int
    workflow: Any
    data: Any
    should_accept_fn: Callable[..., Any] | None
    group_size: int


class Submit(Protocol):
    """:meth:`engine.executor.RolloutEngine.submit`'s signature."""

    def __call__(self, data: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
                 should_accept_fn: Callable[..., Any] | None = None, group_size: int = 1,
                 task_id: int | None = None) -> int: ...


@dataclass(frozen=True, eq=False)
class EngineCalls:
    """The composing engine's own operations that its parts call back: bound methods of
    the :class:`~engine.executor.RolloutEngine`, so that a sharded engine's overrides
    (:class:`engine.shards.ShardedRolloutEngine`: submit, dispatch, refill, take) apply."""

    submit: Submit  #: queue an episode (``RolloutEngine.submit``)
    resolve: Callable[[Any, dict[str, Any] | None], Any]  #: a workflow spec and its kwargs -> the instance (cached)
    admit: Callable[[], None]  #: start (or dispatch) queued episodes while capacity allows
    refill: Callable[[], None]  #: top ``prepare_batch``'s run-ahead pipeline up
    take: Callable[[list[EpisodeResult]], list[EpisodeResult]]  #: results taken out of the buffer are consumed
    withdraw: Callable[[set[int], str], None]  #: end the queued episodes among these ids as failed (``"cancelled"``)
    restore: Callable[[int], None]  #: set the version after a checkpoint load (``RolloutEngine.restore``)


def leaf_exception(exc: BaseException) -> BaseException:
    """The first non-group exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def is_cancellation(exc: BaseException) -> bool:
    """``trio.Cancelled``, or a group holding one (a workflow's or a group's child
    nursery re-raises its members' ``Cancelled`` inside an exception group)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[0] is not None
    return isinstance(exc, trio.Cancelled)


def raised_at(exc: BaseException) -> str:
    """`` (raised at path.py:12 in fn)``: where the innermost frame of ``exc`` was, for logs."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if not frames:
        return ""
    last = frames[-1]
    return f" (raised at {last.filename}:{last.lineno} in {last.name})"


def failed_result(task: Task, exc: BaseException, reason: str | None = None) -> EpisodeResult:
    return EpisodeResult(task.task_id, EpisodeStatus.FAILED, reason=reason or failure_reason(exc),
                         error_type=type(exc).__name__, error_message=str(exc), data=task.data)
