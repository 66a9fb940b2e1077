"""What a remote backend counts, and the frozen record :meth:`RemoteBackend.statistics
<engine.backends.remote.RemoteBackend.statistics>` returns: :class:`RemoteStatistics` (the
request machine's, health probes' and control plane's counters, one shared ``Counter``
keyed by :data:`COUNTERS`) with one :class:`~._routing.ServerStatistics` per server."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import BackendStatistics
from ._routing import ServerStatistics

__all__ = ["COUNTERS", "RemoteStatistics"]


@dataclass(frozen=True, kw_only=True)
class RemoteStatistics(BackendStatistics):
    """:class:`~engine.backends.base.BackendStatistics` of a :class:`RemoteBackend`.

    Attributes:
        attempts, retries, failovers: HTTP attempts, retries after a transient failure,
            and retries sent at once to another server.
        requests_failed, deadline_exceeded, attempt_timeouts: segments failed, segments
            past ``request_timeout_s``, attempts past ``attempt_timeout_s``.
        empty_aborts: answers ``abort`` with no token (retried, never returned).
        aborts_sent, aborts_failed: abort calls for cancelled attempts.
        health_failures, waits_for_server: failed probes; waits for a re-admission.
        requests_unavailable: segments failed because no server was healthy for
            ``no_server_timeout_s`` (``backend_unavailable``; also in ``requests_failed``).
        weight_version_mismatches: answers whose numeric server weight version differed
            from the version the tokens were tagged with.
        weight_updates: weight updates applied (:meth:`RemoteBackend.update_weights`).
        paused: the client-side pause is on.
        servers: one :class:`ServerStatistics` per server, in the order given.
    """

    aborts_failed: int = 0
    aborts_sent: int = 0
    attempt_timeouts: int = 0
    attempts: int = 0
    deadline_exceeded: int = 0
    empty_aborts: int = 0
    failovers: int = 0
    health_failures: int = 0
    requests_failed: int = 0
    requests_unavailable: int = 0
    retries: int = 0
    waits_for_server: int = 0
    weight_version_mismatches: int = 0
    weight_updates: int = 0
    paused: bool = False
    servers: tuple[ServerStatistics, ...] = ()


#: counters reported by :meth:`RemoteBackend.statistics` (0 until something happens)
COUNTERS = ("aborts_failed", "aborts_sent", "attempt_timeouts", "attempts", "deadline_exceeded", "empty_aborts",
            "failovers", "health_failures", "requests_failed", "requests_unavailable", "retries", "waits_for_server",
            "weight_version_mismatches", "weight_updates")
