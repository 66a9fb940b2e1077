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

Routes (errors are OpenAI-style ``{"error": {"message", "type", "code"}}``; with
``"stream": true`` the completion routes answer with server-sent events in
OpenAI's format, generated and recorded first, :mod:`engine.openai._streaming`):

=============================  ===============================================================
``GET /v1/models``             the one model (``ProxyConfig.model``)
``POST /v1/chat/completions``  :meth:`EngineOpenAI.create_chat_completion` in the session
``POST /v1/completions``       :meth:`EngineOpenAI.create_completion` in the session
``POST /v1/responses``         :meth:`EngineOpenAI.create_response` in the session (the Responses API;
                               ``previous_response_id`` names a response of the same session)
``GET /v1/responses/{id}``     a stored response of the session
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

A session is authenticated by its API key alone (``Authorization: Bearer
<api_key>``, what an OpenAI SDK sends): no key or an unknown one is answered 401
(``invalid_api_key``).  A session id (an ``X-Session-Id`` header, ``session_id`` in
the body) is a name, not a credential; when sent it must be the key's session's,
else 403 (``session_mismatch``): never rerouted.  Session ids appear in answers and
log lines; keys never do (not in ``repr`` either).

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
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from ..chat import record_drift
from ..errors import InvalidRequestError, SessionAbandonedError
from ._proxy_http import ProxyRoutes
from ._proxy_session import ProxyConfig, ProxySession, ProxyStatistics, _discount
from .interaction import EXPORT_STYLES

__all__ = ["OpenAIProxy", "ProxyConfig", "ProxySession", "ProxyStatistics", "open_openai_proxy"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace


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

    def attach_session(self, client: Any) -> ProxySession:
        """A session served by ``client`` (an :class:`~engine.openai.EngineOpenAI` of a
        running episode) instead of an episode of its own: it is active at once, its
        requests record into ``client.cache``, and it ends with :meth:`detach_session`
        (``/rl/end_session`` refuses it).  :func:`engine.openai.open_agent_session` wraps both.

        Raises:
            trio.ClosedResourceError: the proxy is closed.
        """
        if self._closed:
            raise trio.ClosedResourceError("the OpenAI proxy is closed")
        session = ProxySession(session_id=f"sess-{os.urandom(8).hex()}", api_key=f"sk-session-{os.urandom(16).hex()}",
                               data={}, cache=client.cache, client=client, state="active", attached=True)
        session.touch()
        self.sessions[session.session_id] = session
        self._by_key[session.api_key] = session
        self._counts["started"] += 1
        return session

    def detach_session(self, session: ProxySession) -> list[str]:
        """End an attached session: its requests still in flight are cancelled (their
        generations withdrawn) and its key stops working.

        Returns:
            the drift events of its requests (for the caller to record in its episode).
        """
        for scope in list(session.request_scopes):
            scope.cancel()
        if session.state != "abandoned":
            session.state = "ended"
        self._forget(session)
        return list(session.drift_details)

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
        binds = await nursery.start(functools.partial(serve, ProxyRoutes(proxy).app(), hconfig, shutdown_trigger=stop.wait))
        proxy.url = binds[0]
        started = time.monotonic()
        try:
            yield proxy
        finally:
            proxy._close()
            stop.set()
            logger.debug("proxy %s closing after %.1f s", proxy.url, time.monotonic() - started)
