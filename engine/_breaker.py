"""Bounded failure: a circuit breaker over ending episodes, and rate-limited failure logs.

When every episode fails (a reward that cannot run, a workflow that always raises),
a loop that refills the pipeline as episodes end would submit without bound.  The
breaker watches how episodes end and *opens* when recent episodes fail:

* ``consecutive_failures`` failed episodes in a row, or
* a failure rate of at least ``failure_rate`` over the last ``window`` episodes.

Only ``failed`` episodes count as failures (a rejection by a filter is a normal
outcome: DAPO-style filtering rejects most episodes on purpose), and ``cancelled``
ones count as nothing.  While open, the engine stops refilling ``prepare_batch``'s
pipeline; ``prepare_batch`` / ``rollout_batch`` raise
:class:`~engine.errors.EpisodeFailuresError` naming the dominant reason with one
example.  It stays open (nothing more is submitted) until the caller calls again:
that call closes it (:meth:`FailureBreaker.reset`), so the run continues once the
cause is fixed.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["BreakerTrip", "FailureBreaker", "FailureLog"]


@dataclass(frozen=True)
class BreakerTrip:
    """Why the breaker opened: ``failed`` of the last ``seen`` episodes failed,
    ``by_reason`` counts them, ``example`` is ``"task 17: KeyError: 'answer'"``."""

    failed: int
    seen: int
    by_reason: dict[str, int]
    example: str
    rule: str

    @property
    def dominant_reason(self) -> str:
        return max(self.by_reason.items(), key=lambda kv: kv[1])[0]

    def describe(self) -> str:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.by_reason.items(), key=lambda kv: -kv[1]))
        return (f"{self.rule}; dominant reason {self.dominant_reason} ({reasons}), e.g. {self.example}")


def _example(result: Any) -> str:
    return f"task {result.task_id}: {result.error_type}: {result.error_message}"


class FailureBreaker:
    """Opens when recent episodes fail (see the module docstring).

    Args:
        consecutive_failures: open after this many failed episodes in a row
            (``None``: no such rule).
        window, failure_rate: open when at least ``failure_rate`` (0-1] of the last
            ``window`` ended episodes failed (``failure_rate=None``: no such rule).
    """

    def __init__(self, consecutive_failures: int | None, window: int, failure_rate: float | None) -> None:
        self.consecutive_failures = consecutive_failures
        self.window = window
        self.failure_rate = failure_rate
        self._recent: collections.deque[tuple[bool, str | None]] = collections.deque(maxlen=window)
        self._run = 0  # failed episodes in a row
        self._run_reasons: collections.Counter[str] = collections.Counter()
        self._last_failure: Any = None
        self.trip: BreakerTrip | None = None
        self.trips = 0
        self.reported = False  # the trip was raised to the caller (the next call resets the breaker)
        self.watermark = 0  # episodes with a lower task id were submitted before the last reset: ignored

    @property
    def open(self) -> bool:
        return self.trip is not None

    def record(self, result: Any) -> None:
        """Count one ended episode (an :class:`~engine.executor.EpisodeResult`)."""
        if (result.status == "failed" and result.reason == "cancelled") or result.task_id < self.watermark:
            return
        failed = result.status == "failed"
        self._recent.append((failed, result.reason if failed else None))
        if not failed:
            self._run = 0
            self._run_reasons.clear()
            return
        self._run += 1
        self._run_reasons[result.reason] += 1
        self._last_failure = result
        if self.trip is not None:
            return
        if self.consecutive_failures is not None and self._run >= self.consecutive_failures:
            self._open(self._run, self._run, dict(self._run_reasons), f"{self._run} consecutive episodes failed")
        elif self.failure_rate is not None and len(self._recent) == self.window:
            failures = [reason or "unknown" for f, reason in self._recent if f]
            if len(failures) >= self.failure_rate * self.window:
                self._open(len(failures), self.window, dict(collections.Counter(failures)),
                           f"{len(failures)} of the last {self.window} episodes failed")

    def _open(self, failed: int, seen: int, by_reason: dict[str, int], rule: str) -> None:
        self.trip = BreakerTrip(failed, seen, by_reason, _example(self._last_failure), rule)
        self.trips += 1

    def reset(self, watermark: int | None = None) -> None:
        """Close the breaker and forget the history (after the error was raised).
        Episodes with a task id below ``watermark`` (submitted before the cause could
        be fixed, still in flight) are not counted afterwards."""
        if watermark is not None:
            self.watermark = watermark
        self.trip = None
        self.reported = False
        self._recent.clear()
        self._run = 0
        self._run_reasons.clear()

    def recent_failures(self) -> str:
        """``"; 12 of the last 20 ended episodes failed (reward_error: 12)"`` or ``""``."""
        failures = [reason for f, reason in self._recent if f]
        if not failures:
            return ""
        reasons = ", ".join(f"{k}: {v}" for k, v in collections.Counter(failures).most_common())
        return f"; {len(failures)} of the last {len(self._recent)} ended episodes failed ({reasons})"


class FailureLog:
    """Failure warnings with library manners at any volume: the first failure of
    each reason is logged with its error; after that at most one summary line per
    ``interval_s`` seconds with counts by reason."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._seen: set[str] = set()
        self._pending: collections.Counter[str] = collections.Counter()
        self._last_summary: float | None = None

    def failed(self, reason: str, what: str, now: float) -> None:
        """Record one failure (``what``: ``"episode 3 sample 1 failed: KeyError: 'x'"``)."""
        if reason not in self._seen:
            self._seen.add(reason)
            self._logger.warning("%s (further %s failures are summarised)", what, reason)
            if self._last_summary is None:
                self._last_summary = now
            return
        self._pending[reason] += 1
        if self._last_summary is None or now - self._last_summary >= self._interval_s:
            self.flush(now)

    def flush(self, now: float) -> None:
        if self._pending:
            counts = ", ".join(f"{k}: {v}" for k, v in self._pending.most_common())
            self._logger.warning("%d more episode failures (%s)", sum(self._pending.values()), counts)
            self._pending.clear()
        self._last_summary = now
