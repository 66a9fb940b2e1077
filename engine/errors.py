"""The engine's exception tree (one place; every boundary maps into it).

::

    RolloutError                      base of everything the engine raises on purpose
    ├── InvalidRequestError(ValueError)   a request/config is malformed (names the field)
    ├── DatasetError(ValueError)          a dataset file/row is malformed (names file and line)
    ├── BackendError                      the inference backend failed or sent bad evidence
    ├── RewardError                       a reward function raised, returned a non-finite
    │                                     or non-numeric value, or cannot be pickled
    ├── WorkflowError                     a workflow could not be resolved/instantiated
    ├── SessionAbandonedError             an OpenAI-proxy session was never ended (idle
    │                                     timeout, client gone, proxy closed)
    ├── EpisodeFailuresError              recent episodes all failed (the failure breaker
    │                                     opened); names the dominant reason
    └── DataExhaustedError                a one-pass dataloader has no more items

Episode failures are recorded as data, not raised: each failed episode keeps a
``reason`` (one of :data:`FAILURE_REASONS`) and the original exception's type and
message (see :class:`engine.executor.EpisodeResult`).
"""

from __future__ import annotations

import sys

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "BackendError",
    "DataExhaustedError",
    "DatasetError",
    "EpisodeFailuresError",
    "FAILURE_REASONS",
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


class EpisodeFailuresError(RolloutError):
    """Recent episodes all failed, so the engine stopped submitting (its failure
    breaker opened: :mod:`engine._breaker`).  The message names the dominant failure
    reason with one example; ``trip`` holds the counts.  Calling ``prepare_batch``
    again resumes submitting (fix the cause first)."""

    def __init__(self, message: str, trip: object = None) -> None:
        super().__init__(message)
        self.trip = trip


class DataExhaustedError(RolloutError):
    """``prepare_batch``'s one-pass dataloader (a generator or other iterator) has
    no more items and every episode it fed has been returned."""


#: Reasons an episode can fail with (``EpisodeResult.reason`` when status is "failed").
FAILURE_REASONS = ("backend_error", "invalid_request", "reward_error", "session_abandoned", "workflow_error")


def failure_reason(exc: BaseException) -> str:
    """Map an exception raised inside an episode to its failure reason."""
    if isinstance(exc, RewardError):
        return "reward_error"
    if isinstance(exc, BackendError):
        return "backend_error"
    if isinstance(exc, InvalidRequestError):
        return "invalid_request"
    if isinstance(exc, SessionAbandonedError):
        return "session_abandoned"
    return "workflow_error"


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
