"""A remote backend's settings: every deadline (:class:`RemoteTimeouts`), the retry and
ejection policy (:class:`RetryPolicy`), frozen objects validated when built, and the servers'
API key (:class:`ApiKey`)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields
from typing import Any

from ...errors import InvalidRequestError

__all__ = ["ApiKey", "RemoteTimeouts", "RetryPolicy", "check_seconds"]


def check_seconds(owner: str, name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise :class:`InvalidRequestError` naming ``owner.name`` unless ``value`` is a finite
    number of seconds > 0 (or ``None`` with ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidRequestError(f"{owner}.{name} must be a finite number of seconds > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RemoteTimeouts:
    """Every deadline of a remote backend, in seconds.

    Every value is a finite number of seconds > 0 (``attempt_timeout_s`` may be ``None``);
    anything else raises :class:`~engine.errors.InvalidRequestError` naming the field.

    Attributes:
        connect_timeout_s: opening a TCP connection.
        request_timeout_s: one :meth:`RemoteBackend.generate` call from start to answer:
            pause and re-admission waits, every attempt, backoff and failover; past it the
            request fails with :class:`~engine.errors.BackendTimeoutError`.
        attempt_timeout_s: one HTTP generation attempt (a server that accepts the request
            and never answers): the attempt is aborted on that server and retried, on
            another healthy server at once if there is one; when the last attempt timed
            out the request fails with :class:`~engine.errors.BackendTimeoutError`
            (reason ``"backend_timeout"``).  Default 1800 s: a long non-streaming
            generation legitimately takes many minutes, and half of ``request_timeout_s``
            leaves room for a failover.  ``None``: bounded by ``request_timeout_s`` only.
        no_server_timeout_s: how long requests wait while no server of the pool is healthy
            (every one ejected), counted from the moment the last healthy server was lost;
            a server re-admitted meanwhile serves them.  Then the waiting requests, and
            every new one until a server is re-admitted, fail with
            :class:`~engine.errors.BackendUnavailableError` (reason
            ``"backend_unavailable"``); while it lasts a warning every 30 s names each
            down server and its last error.  Default 300 s (five minutes: a restart of a
            server that loads its model again fits).
        health_interval_s: between two rounds of health probes.
        health_timeout_s: one health probe.
        abort_timeout_s: one abort call (sent shielded when a request is cancelled).
        control_timeout_s: one control call (pause, continue, weight update).
        startup_timeout_s: how long ``run`` waits for the first healthy server.
    """

    connect_timeout_s: float = 10.0
    request_timeout_s: float = 3600.0
    attempt_timeout_s: float | None = 1800.0
    no_server_timeout_s: float = 300.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 10.0
    abort_timeout_s: float = 5.0
    control_timeout_s: float = 600.0
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for f in fields(self):
            check_seconds("RemoteTimeouts", f.name, getattr(self, f.name), allow_none=f.name == "attempt_timeout_s")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Retries and ejection.

    Attributes:
        max_attempts: attempts per segment, the first included, across all servers.
        backoff_initial_s, backoff_multiplier, backoff_max_s: retry ``k`` (1 = the first
            retry) waits ``min(backoff_max_s, backoff_initial_s * backoff_multiplier**(k-1))``
            less a random share of up to ``jitter_fraction`` of it.  A failover to a healthy
            server the request has not tried yet does not wait.
        jitter_fraction: in ``[0, 1]``.
        eject_after_failures: consecutive failed probes or attempts that eject a server (a
            refused connection ejects at once).
    """

    max_attempts: int = 6
    backoff_initial_s: float = 0.25
    backoff_multiplier: float = 2.0
    backoff_max_s: float = 10.0
    jitter_fraction: float = 0.5
    eject_after_failures: int = 3

    def __post_init__(self) -> None:
        for name in ("max_attempts", "eject_after_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"RetryPolicy.{name} must be an int >= 1, got {value!r}")
        check_seconds("RetryPolicy", "backoff_initial_s", self.backoff_initial_s)
        check_seconds("RetryPolicy", "backoff_max_s", self.backoff_max_s)
        if not (math.isfinite(self.backoff_multiplier) and self.backoff_multiplier >= 1):
            raise InvalidRequestError(f"RetryPolicy.backoff_multiplier must be >= 1, got {self.backoff_multiplier!r}")
        if not (0.0 <= self.jitter_fraction <= 1.0):
            raise InvalidRequestError(f"RetryPolicy.jitter_fraction must be in [0, 1], got {self.jitter_fraction!r}")

    def backoff_s(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (>= 1)."""
        base = min(self.backoff_max_s, self.backoff_initial_s * self.backoff_multiplier ** min(retry - 1, 60))
        return base * (1.0 - self.jitter_fraction * rng.random())


# -- API key (servers started with --api-key) --------------------------------------------


@dataclass(frozen=True)
class ApiKey:
    """The key of servers started with ``--api-key`` (vLLM, SGLang, ``rollout serve``),
    sent as ``Authorization: Bearer <key>`` on every call.  Its ``repr`` and ``str`` hide
    the value (``ApiKey('***')``), so it never reaches a log line, an error message or a
    configuration dump; :attr:`value` is the only way to read it.

    Raises:
        InvalidRequestError: ``value`` is not a non-empty string of visible ASCII
            characters (no spaces or line breaks: it travels in an HTTP header).
    """

    value: str = field(repr=False)

    def __post_init__(self) -> None:
        value = self.value
        if not isinstance(value, str) or not value or not all(33 <= ord(c) <= 126 for c in value):
            raise InvalidRequestError("api_key must be a non-empty string of visible ASCII characters (no spaces, "
                                      "no line breaks)")

    def __repr__(self) -> str:
        return "ApiKey('***')"

    __str__ = __repr__

    @property
    def authorization(self) -> str:
        """The ``Authorization`` header's value: ``Bearer <key>``."""
        return f"Bearer {self.value}"
