"""The engine's exception tree (one place; every boundary maps into it).

::

    RolloutError                      base of everything the engine raises on purpose
    ├── InvalidRequestError(ValueError)   a request/config is malformed (names the field)
    ├── DatasetError(ValueError)          a dataset file/row is malformed (names file and line)
    ├── BackendError                      the inference backend failed or sent bad evidence
    │   ├── BackendUnavailableError       no healthy server for ``no_server_timeout_s``
    │   └── BackendTimeoutError           a generation got no answer in time (attempt or
    │                                     request deadline)
    ├── RewardError                       a reward function raised, returned a non-finite
    │                                     or non-numeric value, or cannot be pickled
    ├── WorkflowError                     a workflow could not be resolved/instantiated
    ├── SessionAbandonedError             an OpenAI-proxy session was never ended (idle
    │                                     timeout, client gone, proxy closed)
    ├── EpisodeTimeoutError               an episode ran past ``episode_timeout_s``
    ├── EpisodeFailuresError              recent episodes all failed (the failure breaker
    │                                     opened), or a batch call accepted none
    │                                     because they failed; names the dominant reason
    └── DataExhaustedError                a one-pass dataloader has no more items

Episode failures are recorded as data, not raised: each failed episode keeps a
``reason`` (one of :data:`FAILURE_REASONS`) and the original exception's type and
message (see :class:`engine.executor.EpisodeResult`).
"""

from __future__ import annotations

import enum
import sys

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "BackendError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "DataExhaustedError",
    "DatasetError",
    "EpisodeFailuresError",
    "EpisodeTimeoutError",
    "FAILURE_REASONS",
    "FailReason",
    "InvalidRequestError",
    "RewardError",
    "RolloutError",
    "SessionAbandonedError",
    "WorkflowError",
    "failure_reason",
    "unwrap_single",
]


class RolloutError(Exception):
    """Base class of errors raised by trio-rollout."""


class InvalidRequestError(RolloutError, ValueError):
    """A request or configuration value is out of range; the message names it."""


class DatasetError(RolloutError, ValueError):
    """A dataset file or row is malformed; the message names the file and line."""


class BackendError(RolloutError):
    """The inference backend failed, or its response broke the evidence rules
    (logprob count != token count, NaN/inf/bool logprob, vLLM's -9999 sentinel)."""


class BackendUnavailableError(BackendError):
    """No server of a remote pool was healthy for ``no_server_timeout_s`` (counted from the
    moment the last healthy one was lost): the requests that waited, and every new one until
    a server is re-admitted, fail with it (reason ``"backend_unavailable"``).  The message
    names each server and its last error.  ``rollout run`` keeps what completed and runs
    these episodes again on ``--resume``."""


class BackendTimeoutError(BackendError):
    """A generation got no answer in time: its last attempt ran past ``attempt_timeout_s``
    (a server that accepts the request and never answers) on every try, or the whole request
    ran past ``request_timeout_s`` (reason ``"backend_timeout"``)."""


class RewardError(RolloutError):
    """A reward function raised after all retries, returned something that is not
    a finite real number, or could not be sent to a worker process."""


class WorkflowError(RolloutError):
    """A workflow spec could not be resolved or instantiated."""


class SessionAbandonedError(RolloutError):
    """A session of the OpenAI-compatible proxy (:mod:`engine.openai.proxy`) ended
    without its ``end_session`` call: no request within its idle timeout, its
    client went away before it was admitted, or the proxy closed.  Its episode
    fails with reason ``"session_abandoned"``; the message says which."""


class EpisodeTimeoutError(RolloutError):
    """An episode ran past ``EngineConfig.episode_timeout_s``: it was cancelled (its requests
    withdrawn, its reward jobs killed) and fails with reason ``"episode_timeout"``."""


class EpisodeFailuresError(RolloutError):
    """Recent episodes all failed, so the engine stopped submitting (its failure
    breaker opened: :mod:`engine._breaker`).  The message names the dominant failure
    reason with one example; ``trip`` holds the counts.  Calling ``prepare_batch``
    again resumes submitting (fix the cause first).

    Also raised by ``rollout_batch`` (and ``prepare_batch``) when the episodes it would
    return hold none accepted and some failed: the message names the counts by reason
    and the first failures; ``trip`` holds the counts (``rule``: ``"none of N episodes
    was accepted: ..."``)."""

    def __init__(self, message: str, trip: object = None) -> None:
        super().__init__(message)
        self.trip = trip


class DataExhaustedError(RolloutError):
    """``prepare_batch``'s one-pass dataloader (a generator or other iterator) has
    no more items and every episode it fed has been returned."""


class _Vocabulary(str, enum.Enum):
    """A closed set of names that are also plain strings: ``FailReason.REWARD_ERROR ==
    "reward_error"``, JSON writes the string, ``str()`` and f-strings give the value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class FailReason(_Vocabulary):
    """Why an episode failed (``EpisodeResult.reason`` when ``status == "failed"``)."""

    BACKEND_ERROR = "backend_error"  #: :class:`BackendError` (the server, transport or response evidence)
    BACKEND_UNAVAILABLE = "backend_unavailable"  #: :class:`BackendUnavailableError` (no healthy server in time)
    BACKEND_TIMEOUT = "backend_timeout"  #: :class:`BackendTimeoutError` (a generation got no answer in time)
    EPISODE_TIMEOUT = "episode_timeout"  #: :class:`EpisodeTimeoutError` (the episode ran past its deadline)
    INVALID_REQUEST = "invalid_request"  #: :class:`InvalidRequestError` (a malformed request)
    REWARD_ERROR = "reward_error"  #: :class:`RewardError` (the reward failed and no fallback applied)
    SESSION_ABANDONED = "session_abandoned"  #: :class:`SessionAbandonedError` (proxy sessions)
    WORKFLOW_ERROR = "workflow_error"  #: anything else the workflow raised
    CANCELLED = "cancelled"  #: the episode was cancelled or withdrawn (engine closing, breaker, rollout_batch)


#: Reasons an episode can fail with because something raised (all but ``"cancelled"``).
FAILURE_REASONS = tuple(r.value for r in FailReason if r is not FailReason.CANCELLED)


def failure_reason(exc: BaseException) -> FailReason:
    """Map an exception raised inside an episode to its failure reason."""
    if isinstance(exc, RewardError):
        return FailReason.REWARD_ERROR
    if isinstance(exc, BackendUnavailableError):
        return FailReason.BACKEND_UNAVAILABLE
    if isinstance(exc, BackendTimeoutError):
        return FailReason.BACKEND_TIMEOUT
    if isinstance(exc, BackendError):
        return FailReason.BACKEND_ERROR
    if isinstance(exc, EpisodeTimeoutError):
        return FailReason.EPISODE_TIMEOUT
    if isinstance(exc, InvalidRequestError):
        return FailReason.INVALID_REQUEST
    if isinstance(exc, SessionAbandonedError):
        return FailReason.SESSION_ABANDONED
    return FailReason.WORKFLOW_ERROR


def unwrap_single(exc: BaseException) -> BaseException:
    """``exc`` without the exception groups that wrap a single exception.

    trio nurseries wrap whatever crosses them in a ``BaseExceptionGroup``; at a
    public boundary one error should reach the caller as itself.  Nested groups
    of one are peeled until an exception that is not a group, or a group of
    several (returned as it is: several errors stay a group).
    """
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
