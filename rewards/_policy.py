"""The retry and fallback policy of one reward call (AReaL's ``AsyncRewardWrapper``).

AReaL (``areal/api/reward_api.py``): a timeout of ``timeout_seconds`` per
attempt, ``max_retries`` retries (so up to ``max_retries + 1`` attempts), a
fallback reward with a warning after the last timed-out attempt, and a user
exception re-raised after the last attempt (never turned into a reward).

Timeouts, worker deaths and exceptions are retried; the failure of the *last*
attempt decides the result: a timeout gives the flagged fallback
(:attr:`~rewards.RewardOutcome.is_fallback`), a death or an exception raises
:class:`~engine.errors.RewardError`.  **Ours**: an exception that cannot go away
on retry -- one of :data:`DETERMINISTIC_ERRORS` (``TypeError`` from a wrong
signature, ``KeyError``/``IndexError`` for missing data, ``AttributeError``,
``NameError``, ``ImportError``, ``NotImplementedError``, ``SyntaxError``) --
raises at once, without retries (AReaL retries every exception).  Timeouts,
dead workers and other exceptions (``OSError``, ``ValueError``,
``RuntimeError``: an I/O-bound judge may recover) keep the retries.  A
:class:`~engine.errors.RewardError` (an invalid value, an unpicklable job) and
``trio.ClosedResourceError`` (a closed pool) are deterministic too: raised at once.

Warnings go to the ``rollout.rewards._policy`` logger.

The pool runs the attempts in its own coroutine (:meth:`~rewards.RewardPool.score_call`:
no coroutine, closure or partial per layer stays alive while a reward runs) and asks
:func:`attempt_failed` about each failure and :func:`give_up` after the last one;
:func:`run_with_policy` is the same loop over attempt callables.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
import trio_parallel

from engine.errors import RewardError

from ._slots import JobTimeout
from ._stats import Counters, RewardOutcome

__all__ = ["DETERMINISTIC_ERRORS", "attempt_failed", "give_up", "run_with_policy"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

#: Exceptions a reward function raises the same way on every attempt (a bug or a
#: data row without a key the function needs): raised at once, never retried.
DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, LookupError, AttributeError, NameError, ImportError, NotImplementedError, SyntaxError,
)

Attempt = Callable[[], Awaitable[float]]

#: why an attempt failed, for :func:`give_up`
TIMEOUT, DIED, RAISED = "timeout", "died", "raised"


def attempt_failed(
    exc: Exception, number: int, attempts: int, name: str, timeout_seconds: float, counters: Counters,
) -> tuple[str, Exception | None] | None:
    """Classify attempt ``number``'s (of ``attempts``) exception; call it in the ``except`` block.

    Returns:
        ``(why, error)`` (:data:`TIMEOUT` / :data:`DIED` / :data:`RAISED`) for a failure the
        policy retries (warned about here; counted in ``counters.timeouts``), or None: the
        exception is deterministic as it is (an invalid value, an unpicklable job, a closed
        pool): re-raise it unchanged.

    Raises:
        RewardError: the reward raised one of :data:`DETERMINISTIC_ERRORS` (chained to it).
    """
    last = number == attempts
    then = "giving up" if last else "retrying"
    if isinstance(exc, JobTimeout):
        counters.timeouts += 1
        if not last:
            logger.warning(
                "reward function %s timed out after %s s (attempt %s/%s); worker killed; retrying",
                name, timeout_seconds, number, attempts,
            )
        return TIMEOUT, None
    if isinstance(exc, trio_parallel.BrokenWorkerError):
        logger.warning(
            "worker process died while running reward function %s (attempt %s/%s): %s; %s",
            name, number, attempts, exc, then,
        )
        return DIED, exc
    if isinstance(exc, (RewardError, trio.ClosedResourceError)):
        return None  # deterministic: invalid value, unpicklable job, closed pool
    if isinstance(exc, RuntimeError) and "bootstrapping phase" in str(exc):
        # multiprocessing's spawn guard: the worker re-ran the top level of an unguarded script,
        # which started an engine of its own; it fails the same way on every attempt
        raise RewardError(
            f"reward function {name}: the reward worker re-ran your script's top level and started another "
            "engine there (spawned workers import __main__): put the code that builds the engine and trains "
            "under `if __name__ == \"__main__\":` (not retried)"
        ) from exc
    if isinstance(exc, DETERMINISTIC_ERRORS):  # raised by the user's function, the same on every attempt
        raise RewardError(
            f"reward function {name} raised {type(exc).__name__}: {exc} (attempt {number}/{attempts}; "
            f"not retried: a {type(exc).__name__} does not go away on retry)"
        ) from exc
    logger.warning(  # raised by the user's reward function
        "reward function %s raised %s: %s (attempt %s/%s); %s",
        name, type(exc).__name__, exc, number, attempts, then,
    )
    return RAISED, exc


def give_up(
    why: str, error: Exception | None, attempts: int, *, name: str, start: float, timeout_seconds: float,
    fallback_reward: float,
) -> RewardOutcome:
    """The end of a call whose last attempt failed (``why``, ``error``: :func:`attempt_failed`'s).

    Returns:
        The flagged fallback :class:`~rewards.RewardOutcome` (every attempt timed out).

    Raises:
        RewardError: the last attempt raised or its worker died (chained to ``error``).
    """
    if why == RAISED:
        raise RewardError(
            f"reward function {name} raised {type(error).__name__}: {error} (attempt {attempts}/{attempts})"
        ) from error
    if why == DIED:
        raise RewardError(
            f"the worker process running reward function {name} died ({error}) (attempt {attempts}/{attempts})"
        ) from error
    logger.warning(
        "reward function %s timed out after %s s on each of %s attempts; returning fallback reward %s",
        name, timeout_seconds, attempts, fallback_reward,
    )
    return RewardOutcome(
        reward=fallback_reward, is_fallback=True, attempts=attempts, latency_s=trio.current_time() - start
    )


async def run_with_policy(
    first: Attempt,
    attempt: Attempt,
    *,
    name: str,
    start: float,
    timeout_seconds: float,
    max_retries: int,
    fallback_reward: float,
    counters: Counters,
) -> RewardOutcome:
    """Run ``first``, then ``attempt`` for each retry, until one returns a reward.

    Args:
        first: the first attempt (a batched one when the pool batches).
        attempt: each retry (always unbatched).
        name: the reward function's name, for messages.
        start: the call's start on trio's clock (for ``latency_s``).
        timeout_seconds: the per-attempt timeout (for messages: the attempts apply it).
        max_retries: retries after the first attempt.
        fallback_reward: the reward returned, flagged, after the last timeout.
        counters: where ``timeouts`` and ``retries`` are counted.

    Returns:
        A :class:`~rewards.RewardOutcome`; ``is_fallback`` when every attempt timed out.

    Raises:
        RewardError: the last attempt raised, its worker died, or an attempt
            raised a deterministic error (see the module docstring).
        trio.ClosedResourceError: the pool closed.
    """
    attempts = max_retries + 1
    why, error = TIMEOUT, None
    for number in range(1, attempts + 1):
        if number > 1:
            counters.retries += 1
        try:
            reward = await (first if number == 1 else attempt)()
        except Exception as exc:
            failed = attempt_failed(exc, number, attempts, name, timeout_seconds, counters)
            if failed is None:
                raise
            why, error = failed
        else:
            return RewardOutcome(
                reward=reward, is_fallback=False, attempts=number, latency_s=trio.current_time() - start
            )
    return give_up(why, error, attempts, name=name, start=start, timeout_seconds=timeout_seconds,
                   fallback_reward=fallback_reward)
