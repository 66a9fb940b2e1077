"""Routing over a pool of servers: least outstanding tokens, sticky keys, ejection.

:class:`ServerPool` holds the servers, their load (``prompt_len + budget`` summed over the
requests in flight: the outstanding tokens) and health, and picks the server of each
attempt.  Sync, no I/O: the request machine (``_backend``) and the health probes
(``_health``) tell it what happened, and it decides.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import trio

from ...errors import InvalidRequestError

__all__ = ["Server", "ServerPool", "ServerStatistics", "normalize_url"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace


@dataclass(frozen=True)
class ServerStatistics:
    """A snapshot of one server as the pool sees it."""

    url: str
    healthy: bool
    outstanding_tokens: int
    in_flight: int
    requests: int
    failures: int
    ejections: int
    weight_version: str | None
    last_error: str | None
    access_denied: bool = False


class Server:
    """One server as the pool tracks it (mutable; :meth:`snapshot` is the frozen view)."""

    def __init__(self, url: str, index: int) -> None:
        self.url = url
        self.index = index
        self.healthy = True
        self.outstanding_tokens = 0
        self.in_flight = 0
        self.consecutive_failures = 0
        self.requests = 0
        self.failures = 0
        self.ejections = 0
        self.weight_version: str | None = None
        self.last_error: str | None = None
        self.stale_weights = False  # missed a weight update; replayed before re-admission
        self.denied: str | None = None  # why it refuses us (HTTP 401/403): ejected for good
        self.attempt_scopes: set[trio.CancelScope] = set()

    def snapshot(self) -> ServerStatistics:
        return ServerStatistics(self.url, self.healthy, self.outstanding_tokens, self.in_flight, self.requests,
                                self.failures, self.ejections, self.weight_version, self.last_error,
                                self.denied is not None)


def normalize_url(url: str) -> str:
    """``url`` without a trailing slash.  Raises :class:`InvalidRequestError` unless it is
    ``http://`` or ``https://``."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise InvalidRequestError(f"server URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


class ServerPool:
    """Servers, their health and load, and the routing rule.  Sync: no I/O here.

    Routing (:meth:`choose`): the sticky server of the key if it is healthy and not in
    ``avoid``; else the healthy server with the fewest outstanding tokens, then the fewest
    requests in flight, ties broken round-robin; servers in ``avoid`` are used only when no
    other healthy server is left.

    Outages: :attr:`no_server_since` is the trio time at which the last healthy server was
    lost (``None`` while one is healthy); :meth:`wait_outage` and :meth:`wait_readmission`
    wake on the two edges.
    """

    def __init__(self, urls: Sequence[str], *, eject_after_failures: int = 3, sticky_cache_size: int = 100_000) -> None:
        normalized = [normalize_url(u) for u in urls]
        if not normalized:
            raise InvalidRequestError("servers: at least one server URL is needed")
        if len(set(normalized)) != len(normalized):
            raise InvalidRequestError(f"servers: duplicate URL in {normalized}")
        if sticky_cache_size < 1:
            raise InvalidRequestError(f"sticky_cache_size must be >= 1, got {sticky_cache_size}")
        self.servers = [Server(u, i) for i, u in enumerate(normalized)]
        self.eject_after_failures = eject_after_failures
        self._sticky: OrderedDict[str, Server] = OrderedDict()
        self._sticky_cache_size = sticky_cache_size
        self._next = 0
        self._readmitted = trio.lowlevel.ParkingLot()
        self._outage = trio.lowlevel.ParkingLot()
        self.no_server_since: float | None = None

    def __getitem__(self, url: str) -> Server:
        for s in self.servers:
            if s.url == url:
                return s
        raise KeyError(url)

    @property
    def healthy(self) -> list[Server]:
        return [s for s in self.servers if s.healthy]

    def choose(self, key: str | None, avoid: Collection[str] = ()) -> Server | None:
        """The server for the next attempt of ``key``, or ``None`` if none is healthy."""
        healthy = self.healthy
        if not healthy:
            return None
        if key is not None:
            sticky = self._sticky.get(key)
            if sticky is not None and sticky.healthy and sticky.url not in avoid:
                self._sticky.move_to_end(key)
                return sticky
        fresh = [s for s in healthy if s.url not in avoid] or healthy
        n = len(self.servers)
        best = min(fresh, key=lambda s: (s.outstanding_tokens, s.in_flight, (s.index - self._next) % n))
        self._next = (best.index + 1) % n
        return best

    def has_fresh(self, avoid: Collection[str]) -> bool:
        """Whether a healthy server outside ``avoid`` exists (failover needs no backoff)."""
        return any(s.url not in avoid for s in self.healthy)

    def bind(self, key: str, server: Server) -> None:
        """Make ``server`` the sticky server of ``key`` (LRU-bounded)."""
        self._sticky[key] = server
        self._sticky.move_to_end(key)
        while len(self._sticky) > self._sticky_cache_size:
            self._sticky.popitem(last=False)

    def sticky_server(self, key: str) -> str | None:
        s = self._sticky.get(key)
        return None if s is None else s.url

    def begin(self, server: Server, cost: int) -> None:
        server.in_flight += 1
        server.outstanding_tokens += cost
        server.requests += 1

    def end(self, server: Server, cost: int) -> None:
        server.in_flight -= 1
        server.outstanding_tokens -= cost

    def record_success(self, server: Server) -> None:
        server.consecutive_failures = 0

    def record_failure(self, server: Server, reason: str, *, eject_now: bool = False, probe: bool = False) -> None:
        """Count a failed attempt or health ``probe``; eject at the threshold (or at once)."""
        server.failures += 1
        server.consecutive_failures += 1
        server.last_error = reason
        if server.healthy and (eject_now or server.consecutive_failures >= self.eject_after_failures):
            self.eject(server, reason, cancel_in_flight=probe)

    def eject(self, server: Server, reason: str, *, cancel_in_flight: bool = True) -> None:
        """Stop routing to ``server``; with ``cancel_in_flight`` (it stopped answering health
        probes: presumed hung) also cancel its attempts in flight, which fail over.  Attempts on
        a server that died fail on their own (lost connection)."""
        if not server.healthy:
            return
        server.healthy = False
        server.ejections += 1
        server.last_error = reason
        scopes = list(server.attempt_scopes) if cancel_in_flight else []
        logger.warning("server %s ejected: %s (%d attempts in flight cancelled, they fail over)", server.url, reason,
                       len(scopes))
        for scope in scopes:
            scope.cancel()
        if self.no_server_since is None and not self.healthy:
            self.no_server_since = trio.current_time()
            self._outage.unpark_all()

    def deny(self, server: Server, reason: str) -> None:
        """``server`` refuses our credentials (HTTP 401/403): eject it for good (probes
        do not re-admit it) and wake requests waiting for a server, so that they fail
        at once when no server is left."""
        server.denied = reason
        server.failures += 1
        self.eject(server, reason, cancel_in_flight=False)
        self._readmitted.unpark_all()

    @property
    def all_denied(self) -> bool:
        """Whether every server refuses us: nothing can ever be served."""
        return all(s.denied is not None for s in self.servers)

    def readmit(self, server: Server) -> None:
        if server.healthy or server.denied is not None:
            return
        server.healthy = True
        server.consecutive_failures = 0
        self.no_server_since = None
        logger.warning("server %s re-admitted", server.url)
        self._readmitted.unpark_all()

    async def wait_readmission(self) -> None:
        """Block until some server is re-admitted (or one is denied: see :meth:`deny`)."""
        await self._readmitted.park()

    async def wait_outage(self) -> None:
        """Block until no server is healthy (at once if none is now)."""
        if self.no_server_since is None:
            await self._outage.park()
        else:
            await trio.lowlevel.checkpoint()

    def describe_down(self) -> str:
        """Each server with its last error, ``"url: error; url: error"`` (for messages)."""
        return "; ".join(f"{s.url}: {s.denied or s.last_error or 'no error recorded'}" for s in self.servers)

    def statistics(self) -> list[ServerStatistics]:
        return [s.snapshot() for s in self.servers]
