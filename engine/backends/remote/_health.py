"""Health of a server pool: start-up (:meth:`HealthMonitor.wait_ready`) and the probes that
eject and re-admit servers while the backend is open.

Every ``health_interval_s`` each server's health route is probed.  A server is ejected
after ``eject_after_failures`` consecutive failed probes or attempts, and at once when it
refuses a connection; an ejection by probes (the server stopped answering: presumed hung)
cancels its attempts in flight, which fail over (on a dead server they fail on their own).
HTTP 401/403 ejects a server for good.  A successful probe re-admits a server, after
replaying a weight update it missed (``replay``, from the control plane).

While no server is healthy (an outage), a warning names each server and its last error at
once, then every :data:`NO_SERVER_WARNING_INTERVAL_S` seconds, and when
``no_server_timeout_s`` passes (requests then fail ``backend_unavailable``: the request
machine, ``_backend``, enforces the window).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable

import trio

from ...errors import BackendError
from ._config import RemoteTimeouts
from ._errors import RemoteCallError
from ._http import ServerClient
from ._routing import Server, ServerPool

__all__ = ["HealthMonitor", "NO_SERVER_WARNING_INTERVAL_S"]

#: While no server is healthy, a warning at least this often (seconds).
NO_SERVER_WARNING_INTERVAL_S = 30.0

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace


class HealthMonitor:
    """Probes the health route of every server of ``pool`` (see the module docstring).

    Args:
        kind: the backend's name, for error messages.
        health_path: the route probed (any 2xx is healthy, whatever the body).
        replay: ``await replay(server)`` re-sends the weight update a stale server missed;
            ``False`` when that failed (the server stays out).
        stats: the backend's counters (``health_failures`` is counted here).
    """

    def __init__(self, pool: ServerPool, http: ServerClient, timeouts: RemoteTimeouts, *, kind: str,
                 health_path: str, replay: Callable[[Server], Awaitable[bool]], stats: Counter[str]) -> None:
        self.pool = pool
        self.http = http
        self.timeouts = timeouts
        self.kind = kind
        self.health_path = health_path
        self._replay = replay
        self._stats = stats

    async def wait_ready(self, after_startup: Callable[[], Awaitable[None]]) -> None:
        """Probe until a server is healthy, then run ``after_startup``; both within
        ``startup_timeout_s``.  A refused connection ejects a server at once.

        Raises:
            RemoteCallError: every server refuses access (HTTP 401/403: at once, no
                waiting; ``access_denied``).
            BackendError: no server answered within ``startup_timeout_s``.
        """
        with trio.move_on_after(self.timeouts.startup_timeout_s):
            first = True
            while True:
                await self.check(eject_now=True)
                if self.pool.healthy:
                    await after_startup()
                    return
                if self.pool.all_denied:  # (typed: a front end adds how to pass the key)
                    raise RemoteCallError(f"{self.kind} backend: every server refused access: "
                                          + "; ".join(f"{s.denied}" for s in self.pool.servers), access_denied=True)
                if first:
                    logger.warning("waiting up to %s s for a healthy server among %s", self.timeouts.startup_timeout_s,
                                   [s.url for s in self.pool.servers])
                    first = False
                await trio.sleep(min(1.0, self.timeouts.health_interval_s))
        details = "; ".join(f"{s.url}: {s.last_error}" for s in self.pool.servers)
        raise BackendError(f"{self.kind} backend: no server answered {self.health_path} within "
                           f"startup_timeout_s={self.timeouts.startup_timeout_s} s ({details})")

    async def run(self) -> None:
        """Probe every ``health_interval_s``, and warn through outages, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._warn_through_outages)
            while True:
                await trio.sleep(self.timeouts.health_interval_s)
                await self.check()

    async def _warn_through_outages(self) -> None:
        """While no server is healthy: a warning at once, then every
        :data:`NO_SERVER_WARNING_INTERVAL_S`, and one when ``no_server_timeout_s`` passes."""
        window = self.timeouts.no_server_timeout_s
        while True:
            await self.pool.wait_outage()
            since = self.pool.no_server_since
            if since is None:
                continue
            next_at, said_past = trio.current_time(), False
            while self.pool.no_server_since == since:
                now = trio.current_time()
                past = now >= since + window
                if now >= next_at or (past and not said_past):
                    self._warn_outage(now - since, past)
                    said_past = said_past or past
                    next_at = now + NO_SERVER_WARNING_INTERVAL_S
                with trio.move_on_at(next_at if said_past else min(next_at, since + window)):
                    await self.pool.wait_readmission()

    def _warn_outage(self, down_s: float, past: bool) -> None:
        window = self.timeouts.no_server_timeout_s
        if past:
            logger.warning("no healthy %s server for %.1f s, past no_server_timeout_s=%s s: requests fail "
                           "backend_unavailable until a server is re-admitted (%s)", self.kind, down_s, window,
                           self.pool.describe_down())
        else:
            logger.warning("no healthy %s server for %.1f s: requests wait up to no_server_timeout_s=%s s, then "
                           "fail backend_unavailable (%s)", self.kind, down_s, window, self.pool.describe_down())

    async def check(self, *, eject_now: bool = False) -> dict[str, bool]:
        """Probe every server once (concurrently); eject and re-admit accordingly.

        Returns ``{url: healthy}`` after the round.
        """
        async with trio.open_nursery() as nursery:
            for server in self.pool.servers:
                nursery.start_soon(self._probe, server, eject_now)
        return {s.url: s.healthy for s in self.pool.servers}

    async def _probe(self, server: Server, eject_now: bool) -> None:
        try:
            await self.http.call(server.url, "GET", self.health_path, timeout_s=self.timeouts.health_timeout_s,
                                 decode=False)  # 200 is healthy, whatever the body ("OK" from a router)
        except RemoteCallError as exc:
            self._stats["health_failures"] += 1
            if exc.access_denied:
                self.pool.deny(server, f"health probe: {exc}")
                return
            self.pool.record_failure(server, f"health probe: {exc}", eject_now=eject_now or exc.server_down,
                                     probe=True)
            return
        if server.denied is not None:
            return  # healthy, but it refuses our requests: never back in rotation
        if not server.healthy and server.stale_weights and not await self._replay(server):
            return
        self.pool.record_success(server)
        self.pool.readmit(server)
