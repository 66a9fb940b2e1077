"""HTTP plumbing of a remote backend: one pooled ``httpx.AsyncClient`` for every server, one
control call to one server with its deadline, and the same call broadcast to several.

Every exchange goes through :func:`~engine.backends.remote._errors.map_exceptions` and
:func:`~engine.backends.remote._errors.decode_json`, so callers see only
:class:`~engine.backends.remote.RemoteCallError`.

A control call whose connection is lost before an answer arrives (``httpx.ReadError``,
``WriteError``, ``RemoteProtocolError``) is sent once more, at once, on a new connection: a
pooled keep-alive connection may have been closed by the server since its last answer (vLLM
0.32's uvicorn closes it after a 500 that escaped the app, e.g. a refused ``/collective_rpc``
weight reload, without ``Connection: close``; the ``/resume`` sent next then failed and the
server stayed paused).  Every control route is idempotent (pause, resume, abort, reload the
same folder, set the same version, probes).  Generation requests have their own retries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import trio

from ._config import RemoteTimeouts
from ._errors import RemoteCallError, RemoteTimeoutError, decode_json, map_exceptions

__all__ = ["ServerClient"]

#: the connection went away before the answer (not a refused connection, not a timeout)
_LOST_CONNECTION = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class ServerClient:
    """The HTTP side of a server pool.

    Args:
        timeouts: ``connect_timeout_s`` for every connection, ``control_timeout_s`` as the
            default deadline of :meth:`call`.
        transport: an ``httpx.AsyncBaseTransport`` (tests pass ``httpx.MockTransport``).
        headers: sent with every call (e.g. an ``Authorization`` header; kept as
            ``httpx.Headers``, whose repr masks it).
    """

    def __init__(self, timeouts: RemoteTimeouts, *, transport: httpx.AsyncBaseTransport | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.timeouts = timeouts
        self._transport = transport
        self._headers = httpx.Headers(headers or {})
        self._client: httpx.AsyncClient | None = None

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
        """Close the client (a later call opens a new one).  Idempotent."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def call(self, url: str, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                   timeout_s: float | None = None, allow_empty: bool = True, decode: bool = True) -> Any:
        """One control call to one server; returns the decoded JSON (``None`` if empty, or
        with ``decode=False``, which checks the status only).

        A lost connection is retried once at once (the module docstring).

        Raises:
            RemoteCallError: transport failure, bad status, malformed body, or no answer
                within ``timeout_s`` (default ``control_timeout_s``).
        """
        timeout_s = self.timeouts.control_timeout_s if timeout_s is None else timeout_s
        with trio.move_on_after(timeout_s):
            with map_exceptions(url):
                try:
                    response = await self.client.request(method, url + path, json=json, params=params)
                except _LOST_CONNECTION:  # a pooled connection the server closed: once more, on a new one
                    response = await self.client.request(method, url + path, json=json, params=params)
            return decode_json(response, url, path, allow_empty=allow_empty, decode=decode)
        raise RemoteTimeoutError(f"{url}{path}: no answer within {timeout_s} s", url=url)

    async def broadcast(self, urls: Sequence[str], method: str, path: str, *, json: Any = None,
                        params: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, RemoteCallError]]:
        """The same control call to every server of ``urls``, concurrently.

        Returns ``(answers, errors)``, both keyed by URL.
        """
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
