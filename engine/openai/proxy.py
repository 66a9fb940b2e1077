"""An OpenAI-compatible HTTP proxy over the engine: one episode per session.

::

    async with open_rollout_engine(backend, config) as engine:
        async with open_openai_proxy(engine, tokenizer, ProxyConfig(turn_discount=0.9)) as proxy:
            # an agent in any process or language, with the OpenAI SDK:
            #   POST {proxy.url}/rl/start_session            -> {"session_id", "api_key", "task_id"}
            #   AsyncOpenAI(base_url=proxy.base_url, api_key=api_key).chat.completions.create(...)
            #   POST {proxy.url}/rl/set_reward   {"reward": 1.0}              (bearer: the session key)
            #   POST {proxy.url}/rl/end_session  {"discount": 0.9, "style": "concat"}
            trajs = await proxy.wait_episodes(n)  # the next n sessions' episodes (None: not accepted)

The server is hypercorn's trio worker serving a Starlette app inside the
caller's trio loop (the engine's), bound to ``127.0.0.1`` (port 0 = any free
port; ``proxy.url`` says which).

Routes (errors are OpenAI-style ``{"error": {"message", "type", "code"}}``):

=============================  ===============================================================
``GET /v1/models``             the one model (``ProxyConfig.model``)
``POST /v1/chat/completions``  :meth:`EngineOpenAI.create_chat_completion` in the session
``POST /v1/completions``       :meth:`EngineOpenAI.create_completion` in the session
``POST /rl/start_session``     ``{"data": {...}}`` (optional: the episode's dataset item); submits the
                               episode, waits for the engine to admit it (its staleness and
                               concurrency bounds gate sessions), returns ``session_id``, ``api_key``,
                               ``task_id``.  With ``admin_api_key`` set it needs that bearer key.
``POST /rl/set_reward``        ``{"reward": x, "interaction_id": id?}`` (the last interaction's when no
                               id is given)
``POST /rl/end_session``       ``{"discount": g?, "style": "individual"|"concat"?,
                               "drop_retry_orphans": bool?}``: waits for requests in flight, applies
                               the discount, hands the session's interactions to the engine as its
                               episode's return value; answers with the number exported
=============================  ===============================================================

A session is named by its API key (``Authorization: Bearer <api_key>``, what
an OpenAI SDK sends) or by an ``X-Session-Id`` header.

Accounting: a session *is* an episode of the engine, submitted by
``start_session``, so it ends exactly once: ``accepted`` (or ``rejected``:
filter, staleness, no interactions) after ``end_session``; ``failed`` with
reason ``"session_abandoned"`` (:class:`~engine.errors.SessionAbandonedError`)
when no request came for ``session_idle_timeout_s``, its client went away
before the engine admitted it, or the proxy closed first; ``failed``
(``"cancelled"``) when the engine closes.  A client that disconnects during a
completion cancels that generation (the request is withdrawn from the
backend); the session then ends or idles out.  Drift events of a session's
requests count in ``EngineStatistics.retokenization_drifts`` when its episode ends.
"""

from __future__ import annotations

import collections

import functools
import hmac
import json
import sys
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from ..chat import collect_drift_events, record_drift
from ..errors import BackendError, InvalidRequestError, SessionAbandonedError, WorkflowError, unwrap_single
from ..types import GenerationHyperparameters
from .cache import InteractionCache
from .interaction import EXPORT_STYLES

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["OpenAIProxy", "ProxyConfig", "ProxySession", "ProxyStatistics", "open_openai_proxy"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    """Proxy settings (units in the names); validated on construction.

    Attributes:
        host, port: where to listen (port 0: any free port).  Only a loopback
            host is accepted: the proxy has no TLS and its keys are bearer tokens.
        model: the model name ``/v1/models`` lists and completions carry.
        gconfig: base sampling parameters of every session's client.
        tool_parser, chat_template_kwargs: as :class:`~engine.openai.EngineOpenAI`.
        session_idle_timeout_s: a session with no request in flight and none for
            this long is abandoned.
        admission_timeout_s: how long ``start_session`` waits for the engine to
            admit the episode before answering 503 (``None``: as long as the
            client waits).
        admin_api_key: when set, ``start_session`` needs it as bearer key.
        export_style, turn_discount, drop_retry_orphans: ``end_session``'s
            defaults (``turn_discount`` 1.0 leaves rewards as set).
        graceful_timeout_s: on close, how long requests in flight may finish.
        backlog: the listening socket's queue of connections not yet accepted
            (hundreds of agents connect at once).
        keep_alive_timeout_s: how long an idle connection stays open (hypercorn's
            5 s default races agents that think between calls: a request sent as
            the server closes the connection fails with "server disconnected").
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "default"
    gconfig: GenerationHyperparameters | None = None
    tool_parser: Any = "hermes"
    chat_template_kwargs: Mapping[str, Any] | None = None
    session_idle_timeout_s: float = 300.0
    admission_timeout_s: float | None = None
    admin_api_key: str | None = None
    export_style: str = "individual"
    turn_discount: float = 1.0
    drop_retry_orphans: bool = False
    graceful_timeout_s: float = 1.0
    backlog: int = 4096
    keep_alive_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"host must be a loopback address (127.0.0.1, localhost, ::1), got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        for name in ("session_idle_timeout_s", "graceful_timeout_s", "keep_alive_timeout_s"):
            _positive(name, getattr(self, name))
        if self.admission_timeout_s is not None:
            _positive("admission_timeout_s", self.admission_timeout_s)
        if isinstance(self.backlog, bool) or not isinstance(self.backlog, int) or self.backlog < 1:
            raise ValueError(f"backlog must be an int >= 1, got {self.backlog!r}")
        if self.export_style not in EXPORT_STYLES:
            raise ValueError(f"export_style must be one of {EXPORT_STYLES}, got {self.export_style!r}")
        _discount(self.turn_discount)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _discount(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InvalidRequestError(f"discount must be a number in [0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ProxyStatistics:
    """Counters of the proxy; ``started == active + ended + abandoned + starting``."""

    starting: int
    active: int
    ended: int
    abandoned: int
    started: int
    requests: int
    request_errors: int
    requests_in_flight: int


@dataclass(eq=False)
class ProxySession:
    """One agent session: an episode of the engine and its interaction cache.

    Attributes:
        session_id, api_key: how requests name the session.
        task_id: the engine task id of its episode.
        data: the episode's dataset item.
        cache: its :class:`InteractionCache`.
        client: the :class:`~engine.openai.EngineOpenAI` that serves its requests.
        state: ``"starting"``, ``"active"``, ``"ending"``, ``"ended"`` or ``"abandoned"``.
        abandon_reason: why it was abandoned, if it was.
        exported: interactions handed to the engine at its end.
    """

    session_id: str
    api_key: str
    data: Any
    cache: InteractionCache = field(default_factory=InteractionCache)
    client: Any = None
    task_id: int = -1
    state: str = "starting"
    abandon_reason: str | None = None
    exported: int | None = None
    end_params: dict[str, Any] | None = None
    active_requests: int = 0
    last_activity: float = 0.0
    drift_details: list[str] = field(default_factory=list)
    admitted: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    _wake: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)

    def touch(self) -> None:
        self.last_activity = trio.current_time()
        self._wake.unpark_all()


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


class _SessionEpisode:
    """The workflow of a session's episode: wait for its end, return its interactions."""

    def __init__(self, proxy: OpenAIProxy, session: ProxySession) -> None:
        self.proxy, self.session = proxy, session

    async def arun_episode(self, engine: Any, data: Any) -> Any:
        s = self.session
        try:
            if s.abandon_reason is None:
                s.state = "active"
            s.touch()
            s.admitted.set()
            await self.proxy._await_end(s)
            params = s.end_params or {}
            if params.get("discount") is not None:
                s.cache.apply_reward_discount(params["discount"])
            out = s.cache.export_interactions(params.get("style", "individual"),
                                              drop_retry_orphans=params.get("drop_retry_orphans", False))
            s.exported = len(out)
            s.state = "ended"
            return out or None
        finally:
            for detail in s.drift_details:  # counted by the engine in this episode
                record_drift(detail)
            self.proxy._forget(s)

    def __repr__(self) -> str:
        return f"_SessionEpisode({self.session.session_id})"


class OpenAIProxy:
    """Created by :func:`open_openai_proxy`.

    Attributes:
        url: ``http://127.0.0.1:PORT``; ``base_url`` = ``url + "/v1"`` (for an OpenAI SDK).
        sessions: live sessions by id.
    """

    def __init__(self, engine: Any, tokenizer: Any, config: ProxyConfig) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.url = ""
        self.sessions: dict[str, ProxySession] = {}
        self._by_key: dict[str, ProxySession] = {}
        self._counts = {"started": 0, "ended": 0, "abandoned": 0, "requests": 0, "request_errors": 0}
        self._closed = False
        self._unclaimed: collections.deque[int] = collections.deque()  # task ids of sessions, for wait_episodes
        self._session_started = trio.lowlevel.ParkingLot()
        self._taken: dict[int, Any] = {}  # episodes taken from the engine by a wait_episodes that timed out

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def wait_episodes(self, count: int, timeout: float | None = None) -> list[Any]:
        """Wait for the next ``count`` sessions (in the order they started, including
        sessions not started yet) to end, and take their episodes from the engine:
        the trajectory of each accepted one, ``None`` for a rejected or failed one
        (e.g. ``session_abandoned``).  Unlike ``engine.wait(count)``, it may be called
        before any client has started a session.

        Raises:
            ValueError: ``count < 0``.
            TimeoutError: ``timeout`` seconds passed; sessions not yet taken stay
                claimable by the next call.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while len(self._unclaimed) < count:
                await self._session_started.park()
            ids = [self._unclaimed[i] for i in range(count)]
            for task_id in ids:  # taken ones are kept here, so a timeout loses nothing
                if task_id not in self._taken:
                    self._taken[task_id] = await self.engine.wait_for_task(task_id)
            for _ in ids:
                self._unclaimed.popleft()
            return [self._taken.pop(task_id).trajectory for task_id in ids]
        raise TimeoutError(f"wait_episodes: {count} sessions did not end within {timeout} s "
                           f"({len(self._unclaimed)} started and not yet returned)")

    def statistics(self) -> ProxyStatistics:
        """A snapshot; sync and cheap."""
        states = [s.state for s in self.sessions.values()]
        c = self._counts
        return ProxyStatistics(starting=states.count("starting"), active=len(states) - states.count("starting"),
                               ended=c["ended"], abandoned=c["abandoned"], started=c["started"],
                               requests=c["requests"], request_errors=c["request_errors"],
                               requests_in_flight=sum(s.active_requests for s in self.sessions.values()))

    # -- sessions (in-process API; the HTTP routes call these) ----------------------------
    async def start_session(self, data: Any = None) -> ProxySession:
        """Submit a session's episode and wait until the engine admits it.

        Raises:
            trio.TooSlowError: not admitted within ``admission_timeout_s`` (the
                session is abandoned; its episode fails when it starts).
            trio.ClosedResourceError: the proxy or the engine is closed.
        """
        from .client import EngineOpenAI

        if self._closed:
            raise trio.ClosedResourceError("the OpenAI proxy is closed")
        cfg = self.config
        session = ProxySession(session_id=f"sess-{os.urandom(8).hex()}", api_key=f"sk-session-{os.urandom(16).hex()}",
                               data={} if data is None else data)
        session.task_id = self.engine.submit(session.data, _SessionEpisode(self, session))
        self._unclaimed.append(session.task_id)
        self._session_started.unpark_all()
        session.client = EngineOpenAI(self.engine, self.tokenizer, gconfig=cfg.gconfig, tool_parser=cfg.tool_parser,
                                      chat_template_kwargs=cfg.chat_template_kwargs, cache=session.cache,
                                      model=cfg.model, metadata={"routing_key": f"episode-{session.task_id}"})
        self.sessions[session.session_id] = session
        self._by_key[session.api_key] = session
        self._counts["started"] += 1
        ok = False
        try:
            with trio.fail_after(math.inf if cfg.admission_timeout_s is None else cfg.admission_timeout_s):
                await session.admitted.wait()
            ok = True
        finally:
            if not ok:
                self._abandon(session, "the engine did not admit the session before its client gave up "
                                       "(admission timeout or client disconnect)")
        return session

    def set_reward(self, session: ProxySession, reward: Any, interaction_id: str | None = None) -> None:
        """Set a completion's reward (the session's last one when ``interaction_id`` is None).

        Raises:
            KeyError: no such interaction.  ValueError: not a finite number, or no interaction yet.
        """
        if interaction_id is None:
            session.cache.set_last_reward(reward)
        else:
            session.cache.set_reward(interaction_id, reward)
        session.touch()

    async def end_session(self, session: ProxySession, *, discount: float | None = None, style: str | None = None,
                          drop_retry_orphans: bool | None = None) -> int:
        """End a session: its episode applies ``discount`` (default
        ``turn_discount``), exports in ``style`` and returns to the engine.

        Returns:
            The number of interactions handed to the engine.

        Raises:
            InvalidRequestError: bad ``discount`` or ``style``, or the session already ended.
            SessionAbandonedError: the session was abandoned before.
        """
        cfg = self.config
        style = cfg.export_style if style is None else style
        if style not in EXPORT_STYLES:
            raise InvalidRequestError(f"style must be one of {EXPORT_STYLES}, got {style!r}")
        discount = _discount(cfg.turn_discount if discount is None else discount)
        if session.abandon_reason is not None:
            raise SessionAbandonedError(f"session {session.session_id} was abandoned: {session.abandon_reason}")
        if session.end_params is not None:
            raise InvalidRequestError(f"session {session.session_id} is already ending")
        session.end_params = {"discount": discount if discount != 1.0 else None, "style": style,
                              "drop_retry_orphans": cfg.drop_retry_orphans if drop_retry_orphans is None
                              else bool(drop_retry_orphans)}
        session.state = "ending"
        session.touch()
        await session.done.wait()
        if session.exported is None:
            raise SessionAbandonedError(f"session {session.session_id} did not end: "
                                        f"{session.abandon_reason or 'its episode was cancelled'}")
        return session.exported

    async def _await_end(self, s: ProxySession) -> None:
        idle = self.config.session_idle_timeout_s
        while True:
            if s.abandon_reason is not None:
                raise SessionAbandonedError(f"session {s.session_id} abandoned: {s.abandon_reason}")
            if s.end_params is not None and s.active_requests == 0:
                return
            deadline = math.inf
            if s.active_requests == 0:
                deadline = s.last_activity + idle
                if trio.current_time() >= deadline:
                    self._abandon(s, f"no request for {idle:g} s (session_idle_timeout_s) and no end_session")
                    continue
            with trio.move_on_at(deadline):
                await s._wake.park()

    def _abandon(self, s: ProxySession, reason: str) -> None:
        if s.abandon_reason is None and s.state not in ("ended", "abandoned"):
            s.abandon_reason, s.state = reason, "abandoned"
            logger.info("session %s (task %s) abandoned: %s", s.session_id, s.task_id, reason)
            s._wake.unpark_all()

    def _forget(self, s: ProxySession) -> None:
        """The session's episode returned or raised: drop it from the registry."""
        if self.sessions.pop(s.session_id, None) is not None:
            self._by_key.pop(s.api_key, None)
            if s.state != "ended":
                s.abandon_reason = s.abandon_reason or "its episode was cancelled"
                s.state = "abandoned"
            self._counts["ended" if s.state == "ended" else "abandoned"] += 1
        s.done.set()

    def _close(self) -> None:
        self._closed = True
        for s in list(self.sessions.values()):
            self._abandon(s, "the proxy closed before the session ended")

    # -- HTTP ------------------------------------------------------------------------------------
    def _session_of(self, request: Any, body: Mapping[str, Any] | None = None) -> ProxySession:
        key = _bearer(request)
        session = self._by_key.get(key) if key else None
        if session is None:
            sid = request.headers.get("x-session-id") or (body or {}).get("session_id")
            session = self.sessions.get(sid) if isinstance(sid, str) else None
        if session is None:
            raise _HTTPError(401, "unknown or ended session: send the session's api_key as bearer token "
                                  "(or an X-Session-Id header); start one with POST /rl/start_session",
                             "authentication_error", "invalid_api_key")
        return session

    async def _complete(self, request: Any, create_name: str) -> Any:
        from starlette.responses import JSONResponse, Response

        body = await _json_body(request)
        session = self._session_of(request)
        if session.state != "active":
            raise _HTTPError(409, f"session {session.session_id} is {session.state}; no more requests")
        create = getattr(session.client, create_name)
        self._counts["requests"] += 1
        session.active_requests += 1
        session.touch()
        try:
            with collect_drift_events() as drifts:
                result = await _unless_disconnected(request, functools.partial(create, **body))
            session.drift_details += drifts
        except TypeError as exc:  # e.g. a required argument missing
            raise _HTTPError(400, f"bad arguments: {exc}") from exc
        finally:
            session.active_requests -= 1
            session.touch()
        if result is None:  # the client went away: nobody to answer
            return Response(status_code=499)
        return JSONResponse(result.model_dump(mode="json"))

    async def _chat_completions(self, request: Any) -> Any:
        return await self._complete(request, "create_chat_completion")

    async def _completions(self, request: Any) -> Any:
        return await self._complete(request, "create_completion")

    async def _models(self, request: Any) -> Any:
        from openai.types import Model
        from starlette.responses import JSONResponse

        model = Model(id=self.config.model, created=0, object="model", owned_by="trio-rollout")
        return JSONResponse({"object": "list", "data": [model.model_dump(mode="json")]})

    async def _start_session(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        body = await _json_body(request, allow_empty=True)
        admin = self.config.admin_api_key
        if admin is not None and not hmac.compare_digest((_bearer(request) or "").encode(), admin.encode()):
            raise _HTTPError(401, "start_session needs the proxy's admin_api_key as bearer token",
                             "authentication_error", "invalid_api_key")
        try:
            session = await _unless_disconnected(request, functools.partial(self.start_session, body.get("data")))
        except trio.TooSlowError:
            raise _HTTPError(503, f"the engine did not admit the session within {self.config.admission_timeout_s} s "
                                  "(staleness or concurrency bound); try again later", "server_error") from None
        if session is None:
            return JSONResponse({}, status_code=499)
        return JSONResponse({"session_id": session.session_id, "api_key": session.api_key, "task_id": session.task_id})

    async def _set_reward(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        body = await _json_body(request)
        session = self._session_of(request, body)
        if "reward" not in body:
            raise _HTTPError(400, "set_reward needs 'reward' (a number)")
        iid = body.get("interaction_id")
        try:
            self.set_reward(session, body["reward"], iid)
        except KeyError as exc:
            raise _HTTPError(404, str(exc.args[0]), code="interaction_not_found") from None
        last = session.cache.last
        return JSONResponse({"session_id": session.session_id,
                             "interaction_id": iid or (last.id if last is not None else None),
                             "reward": body["reward"]})

    async def _end_session(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        body = await _json_body(request, allow_empty=True)
        session = self._session_of(request, body)
        n = await self.end_session(session, discount=body.get("discount"), style=body.get("style"),
                                   drop_retry_orphans=body.get("drop_retry_orphans"))
        return JSONResponse({"session_id": session.session_id, "task_id": session.task_id, "interactions": n})

    def app(self) -> Any:
        """The Starlette application."""
        from starlette.applications import Starlette
        from starlette.routing import Route

        wrap = self._endpoint
        return Starlette(routes=[
            Route("/v1/models", wrap(self._models), methods=["GET"]),
            Route("/v1/chat/completions", wrap(self._chat_completions), methods=["POST"]),
            Route("/v1/completions", wrap(self._completions), methods=["POST"]),
            Route("/rl/start_session", wrap(self._start_session), methods=["POST"]),
            Route("/rl/set_reward", wrap(self._set_reward), methods=["POST"]),
            Route("/rl/end_session", wrap(self._end_session), methods=["POST"]),
        ])

    def _endpoint(self, handler: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
        """Map exceptions to OpenAI-style error answers (one place)."""
        from starlette.responses import JSONResponse

        @functools.wraps(handler)
        async def endpoint(request: Any) -> Any:
            try:
                return await handler(request)
            except Exception as exc:
                err = _http_error(exc)
                self._counts["request_errors"] += 1
                if err.status >= 500:
                    logger.warning("%s %s -> %d: %s: %s", request.method, request.url.path, err.status,
                                   type(exc).__name__, exc)
                return JSONResponse({"error": {"message": str(err), "type": err.kind, "param": None,
                                               "code": err.code}}, status_code=err.status)

        return endpoint


def _http_error(exc: Exception) -> _HTTPError:
    if isinstance(exc, _HTTPError):
        return exc
    if isinstance(exc, NotImplementedError):
        return _HTTPError(400, str(exc), code="unsupported_parameter")
    if isinstance(exc, SessionAbandonedError):
        return _HTTPError(409, str(exc), code="session_abandoned")
    if isinstance(exc, (InvalidRequestError, WorkflowError, ValueError)):
        return _HTTPError(400, str(exc))
    if isinstance(exc, BackendError):
        return _HTTPError(502, f"the inference backend failed: {exc}", "server_error")
    if isinstance(exc, trio.ClosedResourceError):
        return _HTTPError(503, f"closed: {exc}", "server_error")
    return _HTTPError(500, f"{type(exc).__name__}: {exc}", "server_error")


def _bearer(request: Any) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


async def _json_body(request: Any, *, allow_empty: bool = False) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip() and allow_empty:
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _HTTPError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _HTTPError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


async def _unless_disconnected(request: Any, fn: Callable[[], Awaitable[Any]]) -> Any:
    """``await fn()``, cancelled if the HTTP client disconnects first (-> ``None``)."""
    result: list[Any] = []
    try:
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            result.append(await fn())
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        single = unwrap_single(group)
        if single is group:
            raise
    else:
        return result[0] if result else None
    raise single  # outside the handler: the error as itself


@asynccontextmanager
async def open_openai_proxy(engine: Any, tokenizer: Any, config: ProxyConfig | None = None
                            ) -> AsyncIterator[OpenAIProxy]:
    """Serve the OpenAI-compatible proxy of ``engine`` while the block runs.

    Open it inside ``open_rollout_engine``'s block (the sessions' episodes live in
    the engine).  Leaving the block abandons the sessions still open (their
    episodes fail, reason ``"session_abandoned"``) and stops the server after
    requests in flight finish (at most ``graceful_timeout_s``).

    Raises:
        OSError: the port cannot be bound.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = config or ProxyConfig()
    proxy = OpenAIProxy(engine, tokenizer, config)
    hconfig = Config()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hconfig.bind = [f"{host}:{config.port}"]
    hconfig.accesslog = None
    hconfig.errorlog = logging.getLogger(__name__ + ".server")  # a logger of ours: no handler is installed
    hconfig.graceful_timeout = config.graceful_timeout_s
    hconfig.backlog = config.backlog
    hconfig.keep_alive_timeout = config.keep_alive_timeout_s
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(serve, proxy.app(), hconfig, shutdown_trigger=stop.wait))
        proxy.url = binds[0]
        started = time.monotonic()
        try:
            yield proxy
        finally:
            proxy._close()
            stop.set()
            logger.debug("proxy %s closing after %.1f s", proxy.url, time.monotonic() - started)
