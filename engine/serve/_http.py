"""HTTP serving under trio: hypercorn's trio worker runs an ASGI app on listening sockets.

* :func:`open_listeners` binds ``host:port`` first, so that a busy port is one
  :class:`OSError` naming the address (not an error inside the server's nursery), and
  ``port=0`` reports the port it got.
* :func:`serve_asgi` serves any ASGI app (``rollout serve``'s Starlette app) on them with
  hypercorn (``hypercorn.trio.run.worker_serve``): HTTP/1.1 keep-alive, no access log,
  hypercorn's own log lines on this package's logger (nothing configured process-wide).
  Every request runs under :class:`CancelOnDisconnect`: once its body is read, a client
  that goes away cancels the handler (``rollout serve`` then withdraws the generation).
* :class:`RequireApiKey` answers 401 to every request without ``Authorization: Bearer
  <key>`` (``rollout serve --api-key``).
* :func:`serve_http` serves a plain ``async handler(HTTPRequest) -> HTTPResponse``
  (:func:`handler_app`), the shape of the test suite's fake SGLang and vLLM servers, which
  also run in-process behind ``httpx.MockTransport``.  A handler raising
  :class:`RequestRejected` answers its status with an SGLang-style error body; any other
  exception answers 500.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

__all__ = [
    "CancelOnDisconnect",
    "HTTPRequest",
    "HTTPResponse",
    "JSONResponse",
    "RequestRejected",
    "RequireApiKey",
    "handler_app",
    "json_response",
    "open_listeners",
    "parse_json",
    "read_body",
    "rejection",
    "serve_asgi",
    "serve_http",
]

logger = logging.getLogger("rollout.engine.serve")  # the package's one logging namespace

#: the largest request body read (larger: HTTP 413)
MAX_BODY_BYTES = 64 * 1024 * 1024
#: how long an idle keep-alive connection stays open (clients pool their connections)
KEEP_ALIVE_TIMEOUT_S = 3600.0

#: an ASGI 3 application ``app(scope, receive, send)``; loosely typed because Starlette and
#: hypercorn each declare their own (mutually incompatible) scope and message types
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


class RequestRejected(Exception):
    """Raised by a handler to answer ``status`` with an SGLang-style error body
    (``{"error": {"message"}, "message", "code"}``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class JSONResponse(Response):
    """A JSON answer encoded as ``json.dumps`` does (NaN and infinities as the ``NaN`` and
    ``Infinity`` tokens, which Python clients read back; Starlette's own refuses them)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


def rejection(exc: RequestRejected) -> JSONResponse:
    """The answer to a :class:`RequestRejected`."""
    return JSONResponse({"error": {"message": exc.message}, "message": exc.message, "code": exc.status},
                        exc.status)


async def read_body(request: Request) -> bytes:
    """The whole request body.

    Raises:
        RequestRejected: 413, the body is larger than :data:`MAX_BODY_BYTES`.
    """
    body = bytearray()
    async with aclosing(request.stream()) as chunks:  # closed at once when the body is refused
        async for chunk in chunks:
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise RequestRejected(413, "body too large")
    return bytes(body)


def parse_json(body: bytes) -> Any:
    """``body`` as JSON (``None`` when empty).  Raises :class:`RequestRejected` (400)."""
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except ValueError as exc:
        raise RequestRejected(400, f"malformed JSON body: {exc}") from None


# -- the handler-level API (test fakes) ----------------------------------------------------


@dataclass(frozen=True)
class HTTPRequest:
    """One request: ``path`` without the query, ``query`` parsed, header names lower-case."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as JSON (``None`` when empty).  Raises :class:`RequestRejected` (400)."""
        return parse_json(self.body)


@dataclass(frozen=True)
class HTTPResponse:
    """One answer: ``status``, the ``body`` bytes and their ``content_type``."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"


def json_response(obj: Any, status: int = 200) -> HTTPResponse:
    """An :class:`HTTPResponse` with ``obj`` as its JSON body."""
    return HTTPResponse(status, json.dumps(obj).encode())


Handler = Callable[[HTTPRequest], Awaitable[HTTPResponse]]


def handler_app(handler: Handler) -> Starlette:
    """An ASGI app that answers every method and path with ``handler``."""

    async def endpoint(request: Request) -> Response:
        try:
            plain = HTTPRequest(request.method, request.url.path,
                                parse_qs(request.scope.get("query_string", b"").decode("latin-1")),
                                {k.lower(): v for k, v in request.headers.items()}, await read_body(request))
            response = await handler(plain)
        except RequestRejected as exc:
            return rejection(exc)
        except Exception as exc:
            logger.exception("handler failed on %s %s", request.method, request.url.path)
            return JSONResponse({"error": {"message": f"internal error: {exc!r}"}}, 500)
        return Response(response.body, response.status, media_type=response.content_type)

    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", endpoint, methods=methods)])


async def serve_http(handler: Handler, host: str = "127.0.0.1", port: int = 0, *,
                     sockets: Sequence[socket.socket] | None = None,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``handler`` (see :func:`handler_app`) like :func:`serve_asgi`."""
    await serve_asgi(handler_app(handler), host, port, sockets=sockets, task_status=task_status)


# -- serving ---------------------------------------------------------------------------------


class CancelOnDisconnect:
    """ASGI middleware: once the request body is read, a client that disconnects cancels
    the rest of the request's handling (hypercorn only reports the disconnect, as an
    ``http.disconnect`` message that a handler busy elsewhere would never read)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        disconnected = trio.Event()
        body_read = False
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                disconnected.set()
                nursery.cancel_scope.cancel()

            async def app_receive() -> dict[str, Any]:
                nonlocal body_read
                if body_read:  # only a disconnect can come now; the watcher reads it
                    await disconnected.wait()
                    return {"type": "http.disconnect"}
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                elif not message.get("more_body", False):
                    body_read = True
                    nursery.start_soon(watch)
                return message

            await self.app(scope, app_receive, send)
            nursery.cancel_scope.cancel()


class RequireApiKey:
    """ASGI middleware: every HTTP request must carry ``Authorization: Bearer <api_key>``
    (the scheme in any case, as vLLM and SGLang take it), on every route and method, else
    it is answered 401 ``{"error": "Unauthorized"}`` with ``WWW-Authenticate: Bearer`` before
    the app sees it (a wrong key and no key look the same).  The key is compared in
    constant time (``hmac.compare_digest`` of SHA-256 digests, so neither its content nor its
    length leaks through timing); the middleware's repr hides it."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def __repr__(self) -> str:
        return f"RequireApiKey({self.app!r}, api_key='***')"

    def authorized(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """Whether the raw ASGI ``headers`` carry the key."""
        values = [value for name, value in headers if name.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].decode("latin-1").partition(" ")
        given = hashlib.sha256(token.strip().encode("latin-1")).digest()
        return hmac.compare_digest(given, self._digest) and scheme.lower() == "bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self.authorized(scope.get("headers") or []):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            response = JSONResponse({"error": "Unauthorized"}, 401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def open_listeners(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on ``host:port`` (``port=0``: any free port).

    Raises:
        OSError: the address cannot be bound (in use, not ours); the message names it.
    """
    try:
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=1024)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return [socket.socket(fileno=listener.socket.detach()) for listener in listeners]


async def serve_asgi(app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *,
                     sockets: Sequence[socket.socket] | None = None,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI ``app`` with hypercorn's trio worker on ``host:port`` (or on
    ``sockets`` already listening, see :func:`open_listeners`) until cancelled.

    ``task_status.started(port)`` reports the bound port once connections are accepted.

    Raises:
        OSError: ``host:port`` cannot be bound.
    """
    if sockets is None:
        sockets = await open_listeners(host, port)
    config = Config()
    config.accesslog = None
    config.errorlog = logger  # hypercorn's lines go to our logger; no handler installed
    config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    config.include_server_header = False
    wrapped = wrap_app(cast(Any, CancelOnDisconnect(app)), config.wsgi_max_body_size, "asgi")
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(worker_serve, wrapped, config,
                                              sockets=Sockets([], list(sockets), [])))
        task_status.started(sockets[0].getsockname()[1])
