"""The control plane of a server pool: the client-side pause gate, and the control calls
(pause, continue, weight update) broadcast to the servers.

Pausing closes the gate (nothing is sent while paused: a request sent to a paused vLLM
would block) and pauses every healthy server; continuing resumes them, then opens the gate
(even if a server failed).  A client-only pause (:meth:`PoolControl.pause_client`, what a
LoRA adapter update needs) closes the gate and aborts only this client's own requests in
flight, by id: the servers keep serving their other clients (other tenants, other runs),
which a server-wide pause would abort or block.

A weight update sends the wire protocol's calls in order to every healthy server; a server
that fails a step (or is ejected at the time) is ejected and marked stale, and the same calls
are replayed to it before the health probes re-admit it (:meth:`PoolControl.replay`), so no
server serves old weights under the new version.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import trio

from ...errors import BackendError, InvalidRequestError
from ..base import check_sync_mode
from ._errors import RemoteCallError, check_success
from ._http import ServerClient
from ._routing import Server, ServerPool
from ._wire import WireCall, WireProtocol

__all__ = ["PoolControl", "checkpoint_folder", "raise_if_any"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

#: seconds between two rounds of aborts of a client-only pause (an abort that reached the
#: server before its request did is a no-op there; the next round catches the request)
ABORT_ROUND_S = 0.25


def raise_if_any(kind: str, errors: dict[str, RemoteCallError], what: str) -> None:
    """Raise one :class:`BackendError` naming every server of ``errors`` and its failure."""
    if errors:
        raise BackendError(f"{kind} {what} failed on {len(errors)} server(s): "
                           + "; ".join(f"{u}: {e}" for u, e in errors.items()))


def checkpoint_folder(kind: str, source: Any, mode: str) -> str:
    """The folder a weight update of a remote pool loads: ``source`` as a path string.

    Raises:
        InvalidRequestError: unknown mode.
        BackendError: ``mode="in_place"`` (a server does not report at which token its
            weights changed, so the tokens after the swap could not carry the new
            version), or ``source`` is not a folder path (a state dict, an empty string).
    """
    check_sync_mode(f"{kind} backend update_weights", mode)
    if mode != "abort":
        raise BackendError(f"{kind} backend: update_weights mode {mode!r} is not supported: a server does "
                           "not report at which token its weights changed, so the tokens after the swap could "
                           "not carry the new version; use mode='abort'")
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source:
        raise BackendError(f"{kind} backend: update_weights needs a checkpoint folder (a path every server "
                           f"can read), got {type(source).__name__}")
    return source


class PoolControl:
    """Pause gate and control calls of one pool (see the module docstring).

    Args:
        kind: the backend's name, for error messages.
        stats: the backend's counters (``weight_updates`` is counted here).
    """

    def __init__(self, pool: ServerPool, http: ServerClient, wire: WireProtocol, *, kind: str,
                 stats: Counter[str]) -> None:
        self.pool = pool
        self.http = http
        self.wire = wire
        self.kind = kind
        self._stats = stats
        self._paused = False
        self.epoch = 0  #: pauses so far (a request compares it to see whether a pause hit it)
        self._unpaused = trio.Event()
        self._unpaused.set()
        self._weight_update: list[WireCall] | None = None  # the last update's calls, replayed to stale servers
        self._client_only = False  # the pause on now is pause_client's (resume touches no server)
        self._in_flight: dict[str, str] = {}  # wire id -> server URL of this client's attempts
        self._returned = trio.Event()  # set when an attempt ends (a client-only pause waits on it)

    @property
    def paused(self) -> bool:
        """The client-side pause is on: segments wait in :meth:`wait_unpaused`."""
        return self._paused

    async def wait_unpaused(self) -> None:
        """Return once the client-side pause is off."""
        while self._paused:
            await self._unpaused.wait()

    @property
    def client_only(self) -> bool:
        """The pause on now is :meth:`pause_client`'s: no server is paused."""
        return self._paused and self._client_only

    def begin(self, wire_id: str, url: str) -> None:
        """An attempt with ``wire_id`` goes to ``url`` (what :meth:`pause_client` aborts)."""
        self._in_flight[wire_id] = url

    def end(self, wire_id: str) -> None:
        """The attempt with ``wire_id`` returned (answered, failed or cancelled)."""
        if self._in_flight.pop(wire_id, None) is not None:
            self._returned.set()

    def _close_gate(self, *, client_only: bool) -> None:
        self.epoch += 1
        if not self._paused:
            self._paused = True
            self._unpaused = trio.Event()
            self._client_only = client_only
        else:  # paused already: a server-wide pause stays one (its resume resumes the servers)
            self._client_only = self._client_only and client_only

    def _open_gate(self) -> None:
        self._paused = self._client_only = False
        self._unpaused.set()

    async def pause_client(self, mode: str, *, abort_timeout_s: float, timeout_s: float) -> None:
        """Close the gate without pausing any server; with ``mode="abort"``, abort this
        client's attempts in flight by id (the wire protocol's ``abort_call``, a round every
        :data:`ABORT_ROUND_S` for those still running) and return once they all returned,
        or after ``timeout_s`` (then the stragglers run on: each holds the version it was
        sent with, so its tokens stay tagged right).  Any other mode only closes the gate:
        attempts in flight run on.  Undo with :meth:`open_client`.

        Raises:
            InvalidRequestError: unknown mode (an engine sync mode: ``"abort"``, ``"in_place"``).
        """
        check_sync_mode(f"{self.kind} backend pause", mode)
        self._close_gate(client_only=True)
        if mode != "abort":
            return
        pending = set(self._in_flight)
        with trio.move_on_after(timeout_s):
            while pending:
                await self._abort(pending, abort_timeout_s)
                with trio.move_on_after(ABORT_ROUND_S):
                    while pending := pending & set(self._in_flight):
                        self._returned = trio.Event()
                        await self._returned.wait()
                pending &= set(self._in_flight)
        if pending:
            logger.warning("%s: %d request(s) still running %.0f s after their abort: they finish on the "
                           "version they were sent with", self.kind, len(pending), timeout_s)

    async def _abort(self, wire_ids: set[str], timeout_s: float) -> None:
        async def one(wire_id: str) -> None:
            url = self._in_flight.get(wire_id)
            if url is None:
                return
            method, path, body, params = self.wire.abort_call(wire_id)
            self._stats["aborts_sent"] += 1
            try:
                await self.http.call(url, method, path, json=body, params=params, timeout_s=timeout_s)
            except RemoteCallError as exc:  # a server without the route: the request runs on
                self._stats["aborts_failed"] += 1
                logger.debug("abort of %s on %s failed: %s", wire_id, url, exc)

        async with trio.open_nursery() as nursery:
            for wire_id in sorted(wire_ids):
                nursery.start_soon(one, wire_id)

    def open_client(self) -> None:
        """Undo :meth:`pause_client` (no server call)."""
        self._open_gate()

    def _targets(self, servers: Sequence[str] | None) -> list[str]:
        return [s.url for s in self.pool.healthy] if servers is None else list(servers)

    async def pause_generation(self, mode: str = "abort", *, servers: Sequence[str] | None = None) -> dict[str, Any]:
        """Close the gate, then pause every healthy server (or ``servers``) with ``mode``
        (one of the wire protocol's ``pause_modes``).

        Returns ``{url: answer}``.

        Raises:
            InvalidRequestError: unknown mode.
            BackendError: a server failed (the gate stays closed).
        """
        if mode not in self.wire.pause_modes:
            raise InvalidRequestError(f"{self.kind}: pause mode must be one of {self.wire.pause_modes}, got {mode!r}")
        self._close_gate(client_only=False)
        method, path, body, params = self.wire.pause_call(mode)
        answers, errors = await self.http.broadcast(self._targets(servers), method, path, json=body, params=params)
        raise_if_any(self.kind, errors, "pause")
        return answers

    async def continue_generation(self, *, servers: Sequence[str] | None = None) -> dict[str, Any]:
        """Resume every healthy server (or ``servers``), then open the gate (even if a
        server failed; then :class:`BackendError` names it)."""
        method, path, body, params = self.wire.continue_call()
        try:
            answers, errors = await self.http.broadcast(self._targets(servers), method, path, json=body,
                                                        params=params)
        finally:
            self._open_gate()
        raise_if_any(self.kind, errors, "continue")
        return answers

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
        targets = self._targets(servers)
        errors: dict[str, RemoteCallError] = {}
        answers: dict[str, Any] = {}
        for method, path, body, params in calls:
            answers, failed = await self.http.broadcast(targets, method, path, json=body, params=params)
            for url, answer in list(answers.items()):
                try:
                    check_success(url, path, answer)
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

    async def replay(self, server: Server) -> bool:
        """Re-send the last weight update to ``server``, which missed it; ``False`` (and
        ``server.last_error`` says why) when that failed."""
        if self._weight_update is None:
            return True
        try:
            for method, path, body, params in self._weight_update:
                check_success(server.url, path, await self.http.call(server.url, method, path, json=body,
                                                                     params=params))
        except RemoteCallError as exc:
            server.last_error = f"replaying the missed weight update failed: {exc}"
            return False
        server.stale_weights = False
        logger.warning("server %s: replayed the weight update it missed", server.url)
        return True
