"""Shared HTTP machinery of the remote backends (``sglang``, ``vllm``).

::

    backend = make_remote_backend("sglang", ["http://10.0.0.1:30000", "http://10.0.0.2:30000"],
                                  request_timeout_s=900, max_attempts=5)
    async with open_rollout_engine(backend) as engine:
        ...
        await engine.update_weights("/ckpt/step3", version=3)  # pause, load on every server, resume

One call of :meth:`RemoteBackend.generate` serves one segment the engine sends:

1. wait while the client-side pause is on (:meth:`~RemoteBackend.pause_generation` ..
   :meth:`~RemoteBackend.continue_generation`), so nothing is sent to a paused server;
2. pick a server (:class:`ServerPool`): the sticky one of the request's routing key
   (``request.metadata["routing_key"]``, else ``request.rid``; later segments and turns reuse
   its prefix cache) when it is healthy and has not failed this request, otherwise the healthy
   server with the fewest outstanding tokens (``prompt_len + budget`` summed over its requests
   in flight); wait for a re-admission when every server is ejected;
3. POST once, non-streaming, under a unique wire id ``<rid>@<seq>`` (an sglang-router URL is
   one server; see ``engine/backends/sglang.py`` for what it forwards);
4. on a transient failure (refused or lost connection, HTTP 408/429/5xx, malformed JSON,
   ``attempt_timeout_s``, the server ejected under it) try again: at once on a healthy server
   this request has not tried yet (failover), otherwise after a capped exponential backoff
   with jitter (:class:`RetryPolicy`); ``max_attempts`` attempts in all;
5. HTTP 401/403 (access denied: our credentials) is permanent and server-level: the server is
   ejected for good and the request fails over at once; when every server refuses, requests
   fail at once, and start-up (:meth:`~RemoteBackend.wait_ready`) fails at once;
6. anything else (another 4xx, a body of the wrong shape) fails the request with a
   :class:`RemoteCallError` (a :class:`~engine.errors.BackendError`) naming request, server
   and cause.  The whole call, waits and backoff included, is bounded by
   ``request_timeout_s``.

Failover and resumption (documented choice).  A non-streaming call returns nothing when its
server dies, so a failed attempt is re-sent whole to another server.  Its ``input_ids``
already hold every token of earlier segments, so those are never regenerated: the engine's
interruptible loop (``RolloutEngine.agenerate``) owns resumption.  A server that answers
``abort`` *with* partial tokens (pause, abort, drain) hands them to the engine as stop reason
``"abort"``; the engine re-sends prompt + partial output with a lowered budget, and that
segment is routed like any other (back to the same server unless it was ejected).  An
``abort`` with *no* token is retried here (after the pause, if we paused), never returned, so
the engine loop cannot spin on it.  Evidence (logprob counts, NaN, -9999) is checked by the
engine's ``validate_response``.

Health.  Every ``health_interval_s`` each server's health route is probed.  A server is
ejected after ``eject_after_failures`` consecutive failed probes or attempts, and at once when
it refuses a connection; an ejection by probes (the server stopped answering: presumed hung)
cancels its attempts in flight, which fail over (on a dead server they fail on their own).  A
successful probe re-admits it (after replaying a weight update it missed, see
:meth:`RemoteBackend.update_weights`).

Weight updates (:class:`~engine.backends.base.WeightSync`).  :meth:`RemoteBackend.pause`
pauses client-side (nothing is sent while paused) and on every healthy server (mode
``"abort"``: in-flight requests come back ``abort`` with their partial tokens, which the
engine re-sends after the update); :meth:`RemoteBackend.update_weights` sends the wire
protocol's update calls (:meth:`RemoteBackend.weight_update_calls`) to every healthy
server, in order; a server that fails a step (or is ejected at the time) is ejected and
marked stale, and the same calls are replayed to it before it is re-admitted, so no
server serves old weights under the new version; :meth:`RemoteBackend.resume` continues
every server, then the client.  Only mode ``"abort"``: after an in-place swap a server
does not report at which token the weights changed, so tokens could not carry the right
version.

Cancellation.  When an attempt is cancelled (its episode cancelled, the deadline or the
attempt timeout passed) the server is told to abort the wire id, inside a shielded scope
bounded by ``abort_timeout_s``; the dropped connection also makes SGLang and vLLM stop.
Wire errors are classified in one place, :func:`map_exceptions`.

Versions.  Tokens carry ``self.version`` (the engine's, told by ``set_version``) read just
before their attempt is sent (AReaL PR #1569); the server's own ``weight_version`` (SGLang ``meta_info``) is recorded per server in
:meth:`statistics`, and a numeric one that disagrees is counted as ``weight_version_mismatches``.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import httpx
import trio

from ..errors import BackendError, InvalidRequestError
from ..types import ModelRequest, ModelResponse
from .base import BackendStatistics, PerRequestBackend, check_sync_mode

__all__ = [
    "RemoteBackend",
    "RemoteCallError",
    "RemoteStatistics",
    "RemoteTimeouts",
    "RetryPolicy",
    "ServerPool",
    "ServerStatistics",
    "make_remote_backend",
    "map_exceptions",
]

logger = logging.getLogger(__name__)

def _check_seconds(owner: str, name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidRequestError(f"{owner}.{name} must be a finite number of seconds > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RemoteTimeouts:
    """Every deadline of a remote backend, in seconds.

    Attributes:
        connect_timeout_s: opening a TCP connection.
        request_timeout_s: one :meth:`RemoteBackend.generate` call from start to answer:
            pause and re-admission waits, every attempt, backoff and failover.
        attempt_timeout_s: one HTTP attempt; ``None`` = bounded by ``request_timeout_s``
            only (a long generation legitimately takes minutes).
        health_interval_s: between two rounds of health probes.
        health_timeout_s: one health probe.
        abort_timeout_s: one abort call (sent shielded when a request is cancelled).
        control_timeout_s: one control call (pause, continue, weight update).
        startup_timeout_s: how long ``run`` waits for the first healthy server.
    """

    connect_timeout_s: float = 10.0
    request_timeout_s: float = 3600.0
    attempt_timeout_s: float | None = None
    health_interval_s: float = 5.0
    health_timeout_s: float = 10.0
    abort_timeout_s: float = 5.0
    control_timeout_s: float = 600.0
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_seconds("RemoteTimeouts", f.name, getattr(self, f.name), allow_none=f.name == "attempt_timeout_s")


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
        _check_seconds("RetryPolicy", "backoff_initial_s", self.backoff_initial_s)
        _check_seconds("RetryPolicy", "backoff_max_s", self.backoff_max_s)
        if not (math.isfinite(self.backoff_multiplier) and self.backoff_multiplier >= 1):
            raise InvalidRequestError(f"RetryPolicy.backoff_multiplier must be >= 1, got {self.backoff_multiplier!r}")
        if not (0.0 <= self.jitter_fraction <= 1.0):
            raise InvalidRequestError(f"RetryPolicy.jitter_fraction must be in [0, 1], got {self.jitter_fraction!r}")

    def backoff_s(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (>= 1)."""
        base = min(self.backoff_max_s, self.backoff_initial_s * self.backoff_multiplier ** min(retry - 1, 60))
        return base * (1.0 - self.jitter_fraction * rng.random())


class RemoteCallError(BackendError):
    """One HTTP exchange with a server failed.

    Attributes:
        url: the server's base URL.
        retryable: a transient fault (worth another attempt, possibly elsewhere).
        server_down: the server could not be reached at all (eject it now).
        server_fault: the fault counts against the server's health (a 4xx does not).
        access_denied: HTTP 401/403: the server refuses *us* (credentials), on every
            request alike; permanent and server-level (the server is ejected for good).
    """

    def __init__(self, message: str, *, url: str = "", retryable: bool = False, server_down: bool = False,
                 server_fault: bool = True, access_denied: bool = False) -> None:
        super().__init__(message)
        self.url = url
        self.retryable = retryable
        self.server_down = server_down
        self.server_fault = server_fault
        self.access_denied = access_denied


@contextmanager
def map_exceptions(url: str) -> Iterator[None]:
    """Translate what one HTTP exchange with ``url`` can raise into :class:`RemoteCallError`.

    The one place where transport errors are classified (httpx ``map_httpcore_exceptions``):
    refused/unreachable -> retryable, server down; timeout, lost connection, OS error ->
    retryable; any other httpx error (bad URL, protocol misuse) -> not retryable.
    """
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise RemoteCallError(f"cannot connect to {url}: {_describe(exc)}", url=url, retryable=True,
                              server_down=True) from exc
    except httpx.TimeoutException as exc:
        raise RemoteCallError(f"timeout talking to {url}: {_describe(exc)}", url=url, retryable=True) from exc
    except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
        raise RemoteCallError(f"connection to {url} lost: {_describe(exc)}", url=url, retryable=True) from exc
    except httpx.HTTPError as exc:
        raise RemoteCallError(f"HTTP error with {url}: {_describe(exc)}", url=url, server_fault=False) from exc
    except httpx.InvalidURL as exc:
        raise RemoteCallError(f"invalid URL {url}: {exc}", url=url, server_fault=False) from exc
    except OSError as exc:
        raise RemoteCallError(f"I/O error with {url}: {_describe(exc)}", url=url, retryable=True) from exc


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _excerpt(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def decode_json(response: httpx.Response, url: str, what: str, *, allow_empty: bool = False,
                decode: bool = True) -> Any:
    """Check an HTTP status and decode the JSON body (``decode=False``: the status only).

    Raises:
        RemoteCallError: 408/429/5xx (retryable), 401/403 (``access_denied``: permanent),
            another non-2xx (not retryable, not the server's fault), or a body that is not
            JSON (retryable: a truncated answer).
    """
    status = response.status_code
    if status in (408, 429) or status >= 500:
        raise RemoteCallError(f"{url}{what}: HTTP {status}: {_excerpt(response.text)}", url=url, retryable=True)
    if status in (401, 403):
        raise RemoteCallError(f"{url}{what}: HTTP {status} (access denied; check the credentials, e.g. an "
                              f"Authorization header): {_excerpt(response.text)}", url=url, access_denied=True)
    if not 200 <= status < 300:
        raise RemoteCallError(f"{url}{what}: HTTP {status}: {_excerpt(response.text)}", url=url, server_fault=False)
    if not decode or (allow_empty and not response.content.strip()):
        return None
    try:
        return response.json()
    except ValueError:
        raise RemoteCallError(f"{url}{what}: malformed JSON in the answer: {_excerpt(response.text)!r}", url=url,
                              retryable=True) from None


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


class _Server:
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


def _normalize_url(url: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise InvalidRequestError(f"server URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


class ServerPool:
    """Servers, their health and load, and the routing rule.  Sync: no I/O here.

    Routing (:meth:`choose`): the sticky server of the key if it is healthy and not in
    ``avoid``; else the healthy server with the fewest outstanding tokens, then the fewest
    requests in flight, ties broken round-robin; servers in ``avoid`` are used only when no
    other healthy server is left.
    """

    def __init__(self, urls: Sequence[str], *, eject_after_failures: int = 3, sticky_cache_size: int = 100_000) -> None:
        normalized = [_normalize_url(u) for u in urls]
        if not normalized:
            raise InvalidRequestError("servers: at least one server URL is needed")
        if len(set(normalized)) != len(normalized):
            raise InvalidRequestError(f"servers: duplicate URL in {normalized}")
        if sticky_cache_size < 1:
            raise InvalidRequestError(f"sticky_cache_size must be >= 1, got {sticky_cache_size}")
        self.servers = [_Server(u, i) for i, u in enumerate(normalized)]
        self.eject_after_failures = eject_after_failures
        self._sticky: OrderedDict[str, _Server] = OrderedDict()
        self._sticky_cache_size = sticky_cache_size
        self._next = 0
        self._readmitted = trio.lowlevel.ParkingLot()

    def __getitem__(self, url: str) -> _Server:
        for s in self.servers:
            if s.url == url:
                return s
        raise KeyError(url)

    @property
    def healthy(self) -> list[_Server]:
        return [s for s in self.servers if s.healthy]

    def choose(self, key: str | None, avoid: Collection[str] = ()) -> _Server | None:
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

    def bind(self, key: str, server: _Server) -> None:
        """Make ``server`` the sticky server of ``key`` (LRU-bounded)."""
        self._sticky[key] = server
        self._sticky.move_to_end(key)
        while len(self._sticky) > self._sticky_cache_size:
            self._sticky.popitem(last=False)

    def sticky_server(self, key: str) -> str | None:
        s = self._sticky.get(key)
        return None if s is None else s.url

    def begin(self, server: _Server, cost: int) -> None:
        server.in_flight += 1
        server.outstanding_tokens += cost
        server.requests += 1

    def end(self, server: _Server, cost: int) -> None:
        server.in_flight -= 1
        server.outstanding_tokens -= cost

    def record_success(self, server: _Server) -> None:
        server.consecutive_failures = 0

    def record_failure(self, server: _Server, reason: str, *, eject_now: bool = False, probe: bool = False) -> None:
        """Count a failed attempt or health ``probe``; eject at the threshold (or at once)."""
        server.failures += 1
        server.consecutive_failures += 1
        server.last_error = reason
        if server.healthy and (eject_now or server.consecutive_failures >= self.eject_after_failures):
            self.eject(server, reason, cancel_in_flight=probe)

    def eject(self, server: _Server, reason: str, *, cancel_in_flight: bool = True) -> None:
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

    def deny(self, server: _Server, reason: str) -> None:
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

    def readmit(self, server: _Server) -> None:
        if server.healthy or server.denied is not None:
            return
        server.healthy = True
        server.consecutive_failures = 0
        logger.warning("server %s re-admitted", server.url)
        self._readmitted.unpark_all()

    async def wait_readmission(self) -> None:
        """Block until some server is re-admitted."""
        await self._readmitted.park()

    def statistics(self) -> list[ServerStatistics]:
        return [s.snapshot() for s in self.servers]


@dataclass
class ParsedGeneration:
    """What a backend's parser extracts from one generate answer."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    weight_version: str | None = None


class RemoteBackend(PerRequestBackend):
    """A pool of inference servers behind one backend (see the module docstring).

    Subclasses set ``kind``, ``generate_path``, ``health_path``, ``pause_modes``,
    ``sync_pause_modes`` and implement :meth:`build_payload`, :meth:`parse_generation`,
    :meth:`abort_call`, :meth:`pause_call`, :meth:`continue_call`,
    :meth:`weight_update_calls`.

    Args:
        servers: base URLs (``http://host:port``); an sglang-router URL counts as one server.
        timeouts: :class:`RemoteTimeouts` (defaults if omitted).
        retry: :class:`RetryPolicy` (defaults if omitted).
        max_concurrency: segments in flight at once (``None`` = bounded by the engine).
        transport: an ``httpx.AsyncBaseTransport`` (tests pass ``httpx.MockTransport``).
        headers: sent with every call (e.g. an ``Authorization`` header).
        seed: seeds the backoff jitter.
        sticky_cache_size: routing keys remembered for stickiness (LRU).
    """

    kind: ClassVar[str] = "remote"
    generate_path: ClassVar[str] = "/generate"
    health_path: ClassVar[str] = "/health"
    pause_modes: ClassVar[tuple[str, ...]] = ("abort",)
    #: :meth:`pause` modes (the engine's names) -> this server's pause modes
    sync_pause_modes: ClassVar[dict[str, str]] = {"abort": "abort", "in_place": "in_place"}

    def __init__(
        self,
        servers: Sequence[str] | str,
        *,
        timeouts: RemoteTimeouts | None = None,
        retry: RetryPolicy | None = None,
        max_concurrency: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: dict[str, str] | None = None,
        seed: int | None = None,
        sticky_cache_size: int = 100_000,
    ) -> None:
        super().__init__(max_concurrency=max_concurrency)
        if isinstance(servers, str):
            servers = [servers]
        self.timeouts = timeouts or RemoteTimeouts()
        self.retry = retry or RetryPolicy()
        self._ready = False  # wait_ready has run (it runs once)
        self.pool = ServerPool(list(servers), eject_after_failures=self.retry.eject_after_failures,
                               sticky_cache_size=sticky_cache_size)
        self._transport = transport
        self._headers = dict(headers or {})
        self._client: httpx.AsyncClient | None = None
        self._rng = random.Random(seed)
        self._wire_seq = itertools.count()
        self._paused = False
        self._pause_epoch = 0
        self._unpaused = trio.Event()
        self._unpaused.set()
        self._weight_update: list[WireCall] | None = None  # the last update's calls, replayed to stale servers
        self._stats: Counter[str] = Counter()

    # -- HTTP plumbing ------------------------------------------------------------
    @property
    def client(self) -> httpx.AsyncClient:
        """The shared ``httpx.AsyncClient`` (created on first use, closed by :meth:`aclose`)."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                transport=self._transport,
                timeout=httpx.Timeout(None, connect=self.timeouts.connect_timeout_s),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                headers=self._headers,
                trust_env=False,
            )
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def call(self, url: str, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                   timeout_s: float | None = None, allow_empty: bool = True, decode: bool = True) -> Any:
        """One control call to one server; returns the decoded JSON (``None`` if empty, or
        with ``decode=False``, which checks the status only).

        Raises:
            RemoteCallError: transport failure, bad status, malformed body, or no answer
                within ``timeout_s`` (default ``control_timeout_s``).
        """
        timeout_s = self.timeouts.control_timeout_s if timeout_s is None else timeout_s
        with trio.move_on_after(timeout_s):
            with map_exceptions(url):
                response = await self.client.request(method, url + path, json=json, params=params)
            return decode_json(response, url, path, allow_empty=allow_empty, decode=decode)
        raise RemoteCallError(f"{url}{path}: no answer within {timeout_s} s", url=url, retryable=True)

    async def broadcast(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                        servers: Sequence[str] | None = None) -> tuple[dict[str, Any], dict[str, RemoteCallError]]:
        """The same control call to several servers (default: the healthy ones), concurrently.

        Returns ``(answers, errors)``, both keyed by URL.
        """
        urls = [s.url for s in self.pool.healthy] if servers is None else list(servers)
        answers: dict[str, Any] = {}
        errors: dict[str, RemoteCallError] = {}

        async def one(url: str) -> None:
            try:
                answers[url] = await self.call(url, method, path, json=json, params=params)
            except RemoteCallError as exc:
                errors[url] = exc

        async with trio.open_nursery() as nursery:
            for url in urls:
                nursery.start_soon(one, url)
        return answers, errors

    # -- lifetime -----------------------------------------------------------------
    @asynccontextmanager
    async def open(self) -> AsyncIterator[RemoteBackend]:
        """Wait for a healthy server (``startup_timeout_s``), then serve with health
        probes running in the background.

        Raises:
            BackendError: no server answered its health route in time.
        """
        await self.wait_ready()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._health_loop)
            yield self
            nursery.cancel_scope.cancel()

    async def wait_ready(self) -> None:
        """Wait until a server answers its health route, then run :meth:`after_startup`.

        :meth:`open` calls it; a caller may call it first (e.g. to ask the servers which
        model they serve, :meth:`served_models`); it then runs once only.

        Raises:
            BackendError: every server refuses access (HTTP 401/403: at once, no waiting),
                or no server answered within ``startup_timeout_s``.
        """
        if self._ready:
            return
        with trio.move_on_after(self.timeouts.startup_timeout_s):
            first = True
            while True:
                await self.check_health(eject_now=True)
                if self.pool.healthy:
                    await self.after_startup()
                    self._ready = True
                    return
                if self.pool.all_denied:
                    raise BackendError(f"{self.kind} backend: every server refused access: "
                                       + "; ".join(f"{s.denied}" for s in self.pool.servers))
                if first:
                    logger.warning("waiting up to %s s for a healthy server among %s", self.timeouts.startup_timeout_s,
                                   [s.url for s in self.pool.servers])
                    first = False
                await trio.sleep(min(1.0, self.timeouts.health_interval_s))
        details = "; ".join(f"{s.url}: {s.last_error}" for s in self.pool.servers)
        raise BackendError(f"{self.kind} backend: no server answered {self.health_path} within "
                           f"startup_timeout_s={self.timeouts.startup_timeout_s} s ({details})")

    async def after_startup(self) -> None:
        """Hook run once a server is healthy, before jobs are served."""

    async def served_models(self) -> dict[str, str | None]:
        """Ask every healthy server which model it serves: ``{url: name or path}``
        (``None`` where a server does not say).  SGLang: ``GET /get_model_info``
        (``tokenizer_path``, else ``model_path``); vLLM: ``GET /v1/models``
        (``data[0].root``, else ``data[0].id``)."""
        answers: dict[str, str | None] = {}

        async def one(server: _Server) -> None:
            method, path = self.model_info_call()
            try:
                answer = await self.call(server.url, method, path, timeout_s=self.timeouts.health_timeout_s)
                name = self.parse_model_name(answer)
            except (RemoteCallError, TypeError, KeyError, IndexError, ValueError, AttributeError):
                name = None
            answers[server.url] = str(name) if name else None

        async with trio.open_nursery() as nursery:
            for server in self.pool.healthy:
                nursery.start_soon(one, server)
        return {s.url: answers[s.url] for s in self.pool.servers if s.url in answers}

    def model_info_call(self) -> tuple[str, str]:
        """``(method, path)`` of the route that names the served model."""
        raise NotImplementedError

    def parse_model_name(self, answer: Any) -> str | None:
        """The served model's name or path in the answer of :meth:`model_info_call`."""
        raise NotImplementedError

    async def _health_loop(self) -> None:
        while True:
            await trio.sleep(self.timeouts.health_interval_s)
            await self.check_health()

    async def check_health(self, *, eject_now: bool = False) -> dict[str, bool]:
        """Probe every server once (concurrently); eject and re-admit accordingly.

        Returns ``{url: healthy}`` after the round.
        """
        async with trio.open_nursery() as nursery:
            for server in self.pool.servers:
                nursery.start_soon(self._probe, server, eject_now)
        return {s.url: s.healthy for s in self.pool.servers}

    async def _probe(self, server: _Server, eject_now: bool) -> None:
        try:
            await self.call(server.url, "GET", self.health_path, timeout_s=self.timeouts.health_timeout_s,
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
        if not server.healthy and server.stale_weights and self._weight_update is not None:
            try:
                for method, path, body, params in self._weight_update:
                    _check_success(server.url, path, await self.call(server.url, method, path, json=body,
                                                                     params=params))
            except RemoteCallError as exc:
                server.last_error = f"replaying the missed weight update failed: {exc}"
                return
            server.stale_weights = False
            logger.warning("server %s: replayed the weight update it missed", server.url)
        self.pool.record_success(server)
        self.pool.readmit(server)

    # -- generation ---------------------------------------------------------------
    async def _generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        """Serve one segment with routing, retries, failover and a deadline.

        Raises:
            RemoteCallError: a non-retryable failure, or ``max_attempts`` transient ones.
            BackendError: no answer within ``request_timeout_s``.
        """
        key = str(request.metadata.get("routing_key", request.rid))
        cost = len(request.input_ids) + budget
        start = trio.current_time()
        failed: list[str] = []
        history: list[str] = []
        attempts = 0
        with trio.move_on_after(self.timeouts.request_timeout_s):
            while True:
                await self._wait_unpaused()
                server = await self._choose(key, failed)
                attempts += 1
                self._stats["attempts"] += 1
                epoch = self._pause_epoch
                version = self.version  # read before the segment is sent (AReaL PR #1569)
                self.pool.bind(key, server)
                sent = trio.current_time()
                try:
                    await self.prepare(server)
                    parsed = await self._attempt(server, request, budget, cost)
                except RemoteCallError as exc:
                    history.append(f"attempt {attempts} on {server.url}: {exc}")
                    if exc.access_denied:  # the server refuses us, whatever the request: out of rotation
                        self.pool.deny(server, str(exc))
                        if not self.pool.all_denied and attempts < self.retry.max_attempts:
                            self._stats["retries"] += 1
                            self._stats["failovers"] += 1
                            failed.append(server.url)
                            continue
                        self._stats["requests_failed"] += 1
                        raise RemoteCallError(f"request {request.rid}: {_history(history)}", url=server.url,
                                              access_denied=True) from exc
                    if exc.server_fault:
                        self.pool.record_failure(server, str(exc), eject_now=exc.server_down)
                    if not exc.retryable or attempts >= self.retry.max_attempts:
                        self._stats["requests_failed"] += 1
                        raise RemoteCallError(f"request {request.rid}: {_history(history)}", url=server.url,
                                              retryable=exc.retryable, server_down=exc.server_down,
                                              server_fault=exc.server_fault) from exc
                    self._stats["retries"] += 1
                    failed.append(server.url)
                    if self.pool.has_fresh(failed):
                        self._stats["failovers"] += 1
                    else:
                        await trio.sleep(self.retry.backoff_s(len(failed), self._rng))
                    continue
                self.pool.record_success(server)
                self._note_weight_version(server, parsed.weight_version, version)
                if parsed.stop_reason == "abort" and not parsed.tokens:
                    # Aborted before any token: never hand an empty abort to the engine loop.
                    self._stats["empty_aborts"] += 1
                    if self._pause_epoch != epoch or self._paused:
                        attempts -= 1  # our own pause: not a failure, wait for continue
                        continue
                    history.append(f"attempt {attempts} on {server.url}: aborted before any token")
                    if attempts >= self.retry.max_attempts:
                        self._stats["requests_failed"] += 1
                        raise RemoteCallError(f"request {request.rid}: {_history(history)}", url=server.url)
                    await trio.sleep(self.retry.backoff_s(attempts, self._rng))
                    continue
                latency = trio.current_time() - start
                return ModelResponse(
                    input_tokens=list(request.input_ids),
                    output_tokens=parsed.tokens,
                    output_logprobs=parsed.logprobs,
                    output_versions=[version] * len(parsed.tokens),
                    stop_reason=parsed.stop_reason,  # type: ignore[arg-type]
                    latency=latency,
                    ttft=trio.current_time() - sent,  # non-streaming: an upper bound
                )
        self._stats["deadline_exceeded"] += 1
        raise BackendError(f"request {request.rid}: no answer within request_timeout_s="
                           f"{self.timeouts.request_timeout_s} s after {attempts} attempt(s)"
                           + (f" ({_history(history)})" if history else ""))

    async def _wait_unpaused(self) -> None:
        while self._paused:
            await self._unpaused.wait()

    async def _choose(self, key: str, failed: Sequence[str]) -> _Server:
        while True:
            server = self.pool.choose(key, failed)
            if server is not None:
                return server
            if self.pool.all_denied:  # nothing will ever be re-admitted: fail now, not at the deadline
                self._stats["requests_failed"] += 1
                raise RemoteCallError(f"{self.kind}: every server refused access: "
                                      + "; ".join(f"{s.denied}" for s in self.pool.servers), access_denied=True)
            self._stats["waits_for_server"] += 1
            await self.pool.wait_readmission()

    async def prepare(self, server: _Server) -> None:
        """Hook run before an attempt (e.g. discover the served model name)."""

    async def _attempt(self, server: _Server, request: ModelRequest, budget: int, cost: int) -> ParsedGeneration:
        wire_id = f"{request.rid}@{next(self._wire_seq):08d}"
        payload = self.build_payload(request, budget, wire_id)
        timeout = self.timeouts.attempt_timeout_s
        self.pool.begin(server, cost)
        eject_scope = trio.CancelScope()
        server.attempt_scopes.add(eject_scope)
        try:
            with eject_scope:
                with trio.move_on_after(math.inf if timeout is None else timeout):
                    try:
                        with map_exceptions(server.url):
                            response = await self.client.post(server.url + self.generate_path, json=payload)
                    except trio.Cancelled:
                        if not eject_scope.cancel_called:  # cancelled, deadline, attempt timeout: server may be busy
                            await self._abort_shielded(server, wire_id)
                        raise
                    body = decode_json(response, server.url, self.generate_path)
                    try:
                        return self.parse_generation(body)
                    except RemoteCallError as exc:
                        exc.url = exc.url or server.url
                        raise
                    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
                        raise RemoteCallError(
                            f"{server.url}{self.generate_path}: unexpected answer ({_describe(exc)}): "
                            f"{_excerpt(str(body))}", url=server.url) from exc
            if eject_scope.cancelled_caught:
                raise RemoteCallError(f"{server.url} was ejected while the request was in flight", url=server.url,
                                      retryable=True, server_fault=False)
            self._stats["attempt_timeouts"] += 1
            raise RemoteCallError(f"{server.url}: no answer within attempt_timeout_s={timeout} s", url=server.url,
                                  retryable=True)
        finally:
            server.attempt_scopes.discard(eject_scope)
            self.pool.end(server, cost)

    async def _abort_shielded(self, server: _Server, wire_id: str) -> None:
        """Tell ``server`` to stop working on ``wire_id``; runs even while being cancelled."""
        method, path, body, params = self.abort_call(wire_id)
        with trio.CancelScope(shield=True):
            self._stats["aborts_sent"] += 1
            try:
                await self.call(server.url, method, path, json=body, params=params,
                                timeout_s=self.timeouts.abort_timeout_s)
            except RemoteCallError as exc:
                # a router or a server without the route: the dropped connection aborts it anyway
                self._stats["aborts_failed"] += 1
                logger.debug("abort of %s on %s failed: %s", wire_id, server.url, exc)

    def _note_weight_version(self, server: _Server, weight_version: str | None, version: int) -> None:
        if weight_version is None:
            return
        server.weight_version = weight_version
        try:
            numeric = int(weight_version)
        except ValueError:
            return
        if numeric != version:
            self._stats["weight_version_mismatches"] += 1
            logger.debug("server %s reports weight_version %s, tokens tagged %d", server.url, weight_version, version)

    # -- control ------------------------------------------------------------------
    async def pause_generation(self, mode: str = "abort", *, servers: Sequence[str] | None = None) -> dict[str, Any]:
        """Stop sending segments (client side) and pause every healthy server.

        With ``mode="abort"`` the servers return in-flight requests at once (``abort`` with
        their partial tokens); those are re-sent after :meth:`continue_generation`.
        ``servers`` overrides the targets (e.g. the workers behind a router, which does not
        forward control calls: ``servers=await backend.router_workers()``).

        Returns ``{url: answer}``.  Raises :class:`BackendError` if a server failed (the
        client side stays paused).
        """
        if mode not in self.pause_modes:
            raise InvalidRequestError(f"{self.kind}: pause mode must be one of {self.pause_modes}, got {mode!r}")
        self._pause_epoch += 1
        if not self._paused:
            self._paused = True
            self._unpaused = trio.Event()
        method, path, body, params = self.pause_call(mode)
        answers, errors = await self.broadcast(method, path, json=body, params=params, servers=servers)
        self._raise_if_any(errors, "pause")
        return answers

    async def continue_generation(self, *, servers: Sequence[str] | None = None) -> dict[str, Any]:
        """Resume every healthy server (or ``servers``), then let segments flow again (even if
        a server failed)."""
        method, path, body, params = self.continue_call()
        try:
            answers, errors = await self.broadcast(method, path, json=body, params=params, servers=servers)
        finally:
            self._paused = False
            self._unpaused.set()
        self._raise_if_any(errors, "continue")
        return answers

    @property
    def paused(self) -> bool:
        return self._paused

    # -- weight sync (engine.backends.base.WeightSync) --------------------------------
    async def pause(self, mode: str = "abort") -> None:
        """:meth:`pause_generation` with the engine's mode names (``"abort"``, and
        ``"in_place"`` as this server calls it: :attr:`sync_pause_modes`).

        Raises:
            InvalidRequestError: unknown mode.
            BackendError: a server failed to pause (the client side stays paused).
        """
        check_sync_mode(f"{self.kind} backend pause", mode)
        await self.pause_generation(self.sync_pause_modes[mode])

    async def resume(self) -> None:
        """:meth:`continue_generation` on every healthy server, then the client."""
        await self.continue_generation()

    async def update_weights(self, source: Any, *, version: int, mode: str = "abort") -> None:
        """Load the checkpoint folder ``source`` on every server (see the module
        docstring); the servers are told ``version`` as their weight version.  Call it
        between :meth:`pause` and :meth:`resume` (``engine.update_weights`` does).

        Raises:
            InvalidRequestError: unknown mode.
            BackendError: ``mode="in_place"``; ``source`` is not a folder path; or no
                server succeeded (the error names each server's failure).
        """
        check_sync_mode(f"{self.kind} backend update_weights", mode)
        if mode != "abort":
            raise BackendError(f"{self.kind} backend: update_weights mode {mode!r} is not supported: a server does "
                               "not report at which token its weights changed, so the tokens after the swap could "
                               "not carry the new version; use mode='abort'")
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        if not isinstance(source, str) or not source:
            raise BackendError(f"{self.kind} backend: update_weights needs a checkpoint folder (a path every server "
                               f"can read), got {type(source).__name__}")
        await self.apply_weight_update(self.weight_update_calls(source, version), what=source)

    async def apply_weight_update(self, calls: list[WireCall], *, what: str,
                                  servers: Sequence[str] | None = None) -> dict[str, Any]:
        """Send ``calls`` in order to every healthy server (or ``servers``); a server that
        fails one is skipped for the rest.  With the default targets, every pool server
        that did not complete them (failed, or ejected now) is ejected and marked stale:
        the calls are replayed to it before it is re-admitted.

        Returns ``{url: answer to the last call}`` of the servers that completed them.

        Raises:
            BackendError: no server completed them.
        """
        targets = [s.url for s in self.pool.healthy] if servers is None else list(servers)
        errors: dict[str, RemoteCallError] = {}
        answers: dict[str, Any] = {}
        for method, path, body, params in calls:
            answers, failed = await self.broadcast(method, path, json=body, params=params, servers=targets)
            for url, answer in list(answers.items()):
                try:
                    _check_success(url, path, answer)
                except RemoteCallError as exc:
                    failed[url] = exc
                    del answers[url]
            errors.update(failed)
            targets = [u for u in targets if u in answers]
        if not answers:
            raise BackendError(f"{self.kind}: the weight update to {what} failed on every server: "
                               + ("; ".join(f"{u}: {e}" for u, e in errors.items()) or "no healthy server"))
        self._weight_update = list(calls)
        self._stats["weight_updates"] += 1
        if servers is None:
            for server in self.pool.servers:
                if server.url in answers:
                    server.stale_weights = False
                else:
                    server.stale_weights = True
                    self.pool.eject(server, f"missed the weight update to {what}: {errors.get(server.url)}")
        return answers

    async def router_workers(self, url: str | None = None) -> list[str]:
        """The worker URLs behind an sglang-router / SGLang Model Gateway (``GET /workers``)
        at ``url`` (default: the first server), for control calls the router does not forward."""
        url = _normalize_url(url) if url else self.pool.servers[0].url
        answer = await self.call(url, "GET", "/workers")
        try:
            return [_normalize_url(w["url"]) for w in answer["workers"]]
        except (TypeError, KeyError):
            raise BackendError(f"{url}/workers: not a router's worker list: {_excerpt(str(answer))}") from None

    def _raise_if_any(self, errors: dict[str, RemoteCallError], what: str) -> None:
        if errors:
            raise BackendError(f"{self.kind} {what} failed on {len(errors)} server(s): "
                               + "; ".join(f"{u}: {e}" for u, e in errors.items()))

    # -- subclass interface ---------------------------------------------------------
    def build_payload(self, request: ModelRequest, budget: int, wire_id: str) -> dict[str, Any]:
        raise NotImplementedError

    def parse_generation(self, body: Any) -> ParsedGeneration:
        """Parse a 2xx answer; raise :class:`RemoteCallError` (or TypeError/ValueError/
        KeyError for a wrong shape, reported as an unexpected answer)."""
        raise NotImplementedError

    def abort_call(self, wire_id: str) -> tuple[str, str, Any, dict[str, Any] | None]:
        """``(method, path, json, params)`` of the call that aborts ``wire_id``."""
        raise NotImplementedError

    def pause_call(self, mode: str) -> tuple[str, str, Any, dict[str, Any] | None]:
        raise NotImplementedError

    def continue_call(self) -> tuple[str, str, Any, dict[str, Any] | None]:
        raise NotImplementedError

    def weight_update_calls(self, folder: str, version: int) -> list[WireCall]:
        """The calls that load ``folder`` on one server and set its weight version."""
        raise BackendError(f"{self.kind} backend: loading weights on its servers is not implemented")

    # -- statistics -----------------------------------------------------------------
    def statistics(self) -> RemoteStatistics:
        return RemoteStatistics(**self._base_stats(), **{name: self._stats[name] for name in _COUNTERS},
                                paused=self._paused, servers=tuple(self.pool.statistics()))


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
    retries: int = 0
    waits_for_server: int = 0
    weight_version_mismatches: int = 0
    weight_updates: int = 0
    paused: bool = False
    servers: tuple[ServerStatistics, ...] = ()


#: counters reported by :meth:`RemoteBackend.statistics` (0 until something happens)
_COUNTERS = ("aborts_failed", "aborts_sent", "attempt_timeouts", "attempts", "deadline_exceeded", "empty_aborts",
             "failovers", "health_failures", "requests_failed", "retries", "waits_for_server",
             "weight_version_mismatches", "weight_updates")

#: one control call: ``(method, path, json body, query params)``
WireCall = tuple[str, str, Any, "dict[str, Any] | None"]


def _check_success(url: str, path: str, answer: Any) -> None:
    """An answer ``{"success": false, "message": ...}`` (SGLang, vLLM) is a failure."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise RemoteCallError(f"{url}{path}: {answer.get('message') or answer}", url=url)


def _history(history: list[str], keep: int = 3) -> str:
    if len(history) <= keep:
        return "; ".join(history)
    return f"{len(history) - keep} earlier failure(s); " + "; ".join(history[-keep:])


_KINDS = {"sglang": ("engine.backends.sglang", "SGLangBackend"), "vllm": ("engine.backends.vllm", "VLLMBackend")}


def make_remote_backend(kind: str, servers: Sequence[str], **opts: Any) -> RemoteBackend:
    """Build the ``sglang`` or ``vllm`` backend for ``servers``.

    ``opts`` may mix constructor arguments (``max_concurrency``, ``model`` for vLLM, ...)
    with any field of :class:`RemoteTimeouts` or :class:`RetryPolicy` given flat
    (``request_timeout_s=600, max_attempts=4``); ``None`` values are ignored.

    Raises:
        InvalidRequestError: unknown kind, no server, or an invalid option value.
    """
    import importlib

    if kind not in _KINDS:
        raise InvalidRequestError(f"remote backend kind must be one of {sorted(_KINDS)}, got {kind!r}")
    opts = {k: v for k, v in opts.items() if v is not None}
    timeout_names = {f.name for f in fields(RemoteTimeouts)}
    retry_names = {f.name for f in fields(RetryPolicy)}
    t_opts = {k: opts.pop(k) for k in list(opts) if k in timeout_names}
    r_opts = {k: opts.pop(k) for k in list(opts) if k in retry_names}
    if t_opts:
        base = opts.pop("timeouts", None) or RemoteTimeouts()
        opts["timeouts"] = RemoteTimeouts(**{**asdict(base), **t_opts})
    if r_opts:
        base = opts.pop("retry", None) or RetryPolicy()
        opts["retry"] = RetryPolicy(**{**asdict(base), **r_opts})
    module, name = _KINDS[kind]
    cls = getattr(importlib.import_module(module), name)
    return cls(list(servers), **opts)
