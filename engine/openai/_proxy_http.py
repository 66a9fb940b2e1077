"""The HTTP side of the OpenAI-compatible proxy: Starlette routes over an
:class:`~engine.openai.proxy.OpenAIProxy`, with OpenAI-style error answers
(``{"error": {"message", "type", "param", "code"}}``).  The routes are listed in
:mod:`engine.openai.proxy`'s docstring."""

from __future__ import annotations

import functools
import hmac
import json
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol

import trio

from ..chat import collect_drift_events
from ..errors import BackendError, InvalidRequestError, SessionAbandonedError, WorkflowError, unwrap_single

from ._proxy_session import ProxyConfig, ProxySession
from ._responses import ResponseNotFoundError
from ._streaming import ChunkStream

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

logger = logging.getLogger("rollout.engine.openai.proxy")  # the proxy's log lines, wherever they come from


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


class SessionHost(Protocol):
    """What the routes use of :class:`~engine.openai.proxy.OpenAIProxy`."""

    config: ProxyConfig
    sessions: dict[str, ProxySession]
    _by_key: dict[str, ProxySession]
    _counts: dict[str, int]

    async def start_session(self, data: Any = None) -> ProxySession: ...

    def set_reward(self, session: ProxySession, reward: Any, interaction_id: str | None = None) -> None: ...

    async def end_session(self, session: ProxySession, *, discount: float | None = None, style: str | None = None,
                          drop_retry_orphans: bool | None = None) -> int: ...


class ProxyRoutes:
    """The proxy's HTTP handlers; ``app()`` is the Starlette application."""

    def __init__(self, proxy: SessionHost) -> None:
        self.proxy = proxy

    def _session_of(self, request: Any, body: Mapping[str, Any] | None = None) -> ProxySession:
        """The session whose api_key is the bearer key; the only credential.

        A session id (``X-Session-Id`` header, ``session_id`` in the body) only names
        the session: it is checked against the key's, never used to find one.

        Raises:
            _HTTPError: 401 no bearer key, or one that is no live session's key;
                403 a session id that is not the key's session's.
        """
        key = _bearer(request)
        if key is None:
            raise _HTTPError(401, "no api_key: send the session's api_key as bearer token (Authorization: Bearer "
                                  "<api_key>, what an OpenAI SDK sends); a session id alone does not authenticate; "
                                  "start a session with POST /rl/start_session",
                             "authentication_error", "invalid_api_key")
        session = self.proxy._by_key.get(key)
        if session is None:
            raise _HTTPError(401, "unknown or ended session: the bearer key is no live session's api_key; "
                                  "start one with POST /rl/start_session", "authentication_error", "invalid_api_key")
        for sid in (request.headers.get("x-session-id"), (body or {}).get("session_id")):
            if sid is not None and sid != session.session_id:
                raise _HTTPError(403, "the session id sent (X-Session-Id or session_id) names another session than "
                                      "the api_key's: send the session's own api_key (the id is optional)",
                                 "permission_error", "session_mismatch")
        return session

    async def _complete(self, request: Any, create_name: str) -> Any:
        from starlette.responses import JSONResponse, Response

        body = await _json_body(request)
        session = self._session_of(request, body)
        body.pop("session_id", None)  # checked above; not a sampling parameter
        if session.state != "active":
            raise _HTTPError(409, f"session {session.session_id} is {session.state}; no more requests")
        create = getattr(session.client, create_name)
        self.proxy._counts["requests"] += 1
        session.active_requests += 1
        session.touch()
        result = None
        try:
            with trio.CancelScope() as scope:  # cancelled when an attached session ends
                session.request_scopes.add(scope)
                with collect_drift_events() as drifts:
                    result = await _unless_disconnected(request, functools.partial(create, **body))
                session.drift_details += drifts
        except TypeError as exc:  # e.g. a required argument missing
            raise _HTTPError(400, f"bad arguments: {exc}") from exc
        finally:
            session.request_scopes.discard(scope)
            session.active_requests -= 1
            session.touch()
        if scope.cancelled_caught:
            raise _HTTPError(409, f"session {session.session_id} ended during the request", code="session_ended")
        if result is None:  # the client went away: nobody to answer
            return Response(status_code=499)
        if isinstance(result, ChunkStream):  # stream=True: generated and recorded; sent as server-sent events
            from starlette.responses import StreamingResponse

            return StreamingResponse(_chunks_of(result.sse()), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(result.model_dump(mode="json"))

    async def _chat_completions(self, request: Any) -> Any:
        return await self._complete(request, "create_chat_completion")

    async def _completions(self, request: Any) -> Any:
        return await self._complete(request, "create_completion")

    async def _responses(self, request: Any) -> Any:
        return await self._complete(request, "create_response")

    async def _retrieve_response(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        session = self._session_of(request)
        response = session.client.retrieve_response(request.path_params["response_id"])
        return JSONResponse(response.model_dump(mode="json"))

    async def _models(self, request: Any) -> Any:
        from openai.types import Model
        from starlette.responses import JSONResponse

        model = Model(id=self.proxy.config.model, created=0, object="model", owned_by="trio-rollout")
        return JSONResponse({"object": "list", "data": [model.model_dump(mode="json")]})

    async def _start_session(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        body = await _json_body(request, allow_empty=True)
        admin = self.proxy.config.admin_api_key
        if admin is not None and not hmac.compare_digest((_bearer(request) or "").encode(), admin.encode()):
            raise _HTTPError(401, "start_session needs the proxy's admin_api_key as bearer token",
                             "authentication_error", "invalid_api_key")
        try:
            session = await _unless_disconnected(request, functools.partial(self.proxy.start_session, body.get("data")))
        except trio.TooSlowError:
            raise _HTTPError(503, f"the engine did not admit the session within {self.proxy.config.admission_timeout_s} s "
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
            self.proxy.set_reward(session, body["reward"], iid)
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
        if session.attached:
            raise _HTTPError(409, f"session {session.session_id} belongs to a workflow (open_agent_session); it "
                                  "ends when the workflow's block ends", code="session_attached")
        n = await self.proxy.end_session(session, discount=body.get("discount"), style=body.get("style"),
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
            Route("/v1/responses", wrap(self._responses), methods=["POST"]),
            Route("/v1/responses/{response_id}", wrap(self._retrieve_response), methods=["GET"]),
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
                self.proxy._counts["request_errors"] += 1
                if err.status >= 500:
                    logger.warning("%s %s -> %d: %s: %s", request.method, request.url.path, err.status,
                                   type(exc).__name__, exc)
                return JSONResponse({"error": {"message": str(err), "type": err.kind, "param": None,
                                               "code": err.code}}, status_code=err.status)

        return endpoint


def _http_error(exc: Exception) -> _HTTPError:
    if isinstance(exc, _HTTPError):
        return exc
    if isinstance(exc, ResponseNotFoundError):
        return _HTTPError(404, str(exc.args[0]), code="response_not_found")
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


class _chunks_of:
    """An async iterator over in-memory events (not an async generator: nothing to
    finalize when the client leaves mid-stream)."""

    def __init__(self, events: Iterator[bytes]) -> None:
        self._events = events

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        try:
            return next(self._events)
        except StopIteration:
            raise StopAsyncIteration from None


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
