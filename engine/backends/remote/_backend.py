"""The request machine of a remote backend: one segment in, one answer out, over a pool.

:class:`RemoteBackend` composes the pool's parts (routing ``_routing``, health ``_health``,
control plane ``_control``, HTTP ``_http``) with a :class:`~._wire.WireProtocol`, and owns
what happens to one segment: wait for the pause gate, pick a server, send once under a
unique wire id, classify the failure, retry or fail over or fail, abort the server's work
when cancelled, tag the tokens with the version read before sending.  It also implements
:class:`~engine.backends.base.WeightSync` over the control plane.  The whole story is in the
package docstring (:mod:`engine.backends.remote`).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import httpx
import trio

from ...errors import BackendError, BackendTimeoutError, BackendUnavailableError, InvalidRequestError
from ...types import ModelRequest, ModelResponse
from ..base import PerRequestBackend, check_sync_mode
from ..lora import DEFAULT_LORA_NAME, check_lora_name, is_adapter_source
from ._config import ApiKey, RemoteTimeouts, RetryPolicy
from ._control import PoolControl, checkpoint_folder
from ._errors import RemoteCallError, RemoteTimeoutError, decode_json, describe, excerpt, history, map_exceptions
from ._health import HealthMonitor
from ._http import ServerClient
from ._lora import RemoteAdapters
from ._routing import Server, ServerPool, normalize_url
from ._stats import COUNTERS, RemoteStatistics
from ._wire import ParsedGeneration, WireCall, WireProtocol

__all__ = ["RemoteBackend"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace


def _api_key(api_key: ApiKey | str | None, headers: dict[str, str] | None) -> ApiKey | None:
    if api_key is None:
        return None
    if any(name.lower() == "authorization" for name in headers or {}):
        raise InvalidRequestError("RemoteBackend: give api_key or an Authorization header in headers, not both")
    return api_key if isinstance(api_key, ApiKey) else ApiKey(api_key)


class RemoteBackend(PerRequestBackend):
    """A pool of inference servers behind one backend, speaking ``wire`` (see
    :mod:`engine.backends.remote`).

    Args:
        servers: base URLs (``http://host:port``); an sglang-router URL counts as one server.
        wire: the servers' :class:`~._wire.WireProtocol`.
        timeouts: :class:`RemoteTimeouts` (defaults if omitted).
        retry: :class:`RetryPolicy` (defaults if omitted).
        max_concurrency: segments in flight at once (``None`` = bounded by the engine).
        transport: an ``httpx.AsyncBaseTransport`` (tests pass ``httpx.MockTransport``).
        headers: sent with every call.
        api_key: the key of servers started with ``--api-key``: every call carries
            ``Authorization: Bearer <key>`` (an :class:`~._config.ApiKey` or the key as a
            string; never printed).  A server that answers 401/403 refuses it (or its
            absence): see ``Raises`` of :meth:`wait_ready`.
        seed: seeds the backoff jitter.
        sticky_cache_size: routing keys remembered for stickiness (LRU).
        lora: a LoRA adapter to serve (an adapter folder, a peft model, ...), loaded on
            every server when the backend opens as ``{lora_name}-v{version}``; every
            segment then samples the current version (:mod:`._lora`).  A backend opened
            without one starts serving one at its first adapter update.
        lora_name: the adapter's name (default ``"lora"``).
        lora_dir: where each version's folder is written (the servers must read it;
            default: a temporary folder).
        check_lora_base: refuse an adapter trained on another base model than the servers'.

    Attributes:
        weights_shared_across_clients: True: the weights live in the servers, not in this
            client, so several clients of the same servers (the shards of
            :func:`engine.shards.open_sharded_engine`) share them: a weight update loads
            once for all of them (:mod:`engine.shards._weights`; the base class says False:
            a model in its own process, each copy loads).

    Raises:
        InvalidRequestError: no server, a URL that is not ``http(s)://``, a duplicate; an
            ``api_key`` that is not a visible-ASCII string, or one given together with an
            ``Authorization`` header.
    """

    kind = "remote"
    weights_shared_across_clients: ClassVar[bool] = True

    def __init__(
        self,
        servers: Sequence[str] | str,
        *,
        wire: WireProtocol,
        timeouts: RemoteTimeouts | None = None,
        retry: RetryPolicy | None = None,
        max_concurrency: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: dict[str, str] | None = None,
        api_key: ApiKey | str | None = None,
        seed: int | None = None,
        sticky_cache_size: int = 100_000,
        lora: Any = None,
        lora_name: str = DEFAULT_LORA_NAME,
        lora_dir: str | None = None,
        check_lora_base: bool = True,
    ) -> None:
        super().__init__(max_concurrency=max_concurrency)
        if isinstance(servers, str):
            servers = [servers]
        self.wire = wire
        self.timeouts = timeouts or RemoteTimeouts()
        self.retry = retry or RetryPolicy()
        self.pool = ServerPool(list(servers), eject_after_failures=self.retry.eject_after_failures,
                               sticky_cache_size=sticky_cache_size)
        self.api_key = _api_key(api_key, headers)
        if self.api_key is not None:
            headers = {**(headers or {}), "Authorization": self.api_key.authorization}
        self.http = ServerClient(self.timeouts, transport=transport, headers=headers)
        self._stats: Counter[str] = Counter()
        self.control = PoolControl(self.pool, self.http, wire, kind=self.kind, stats=self._stats)
        self.health = HealthMonitor(self.pool, self.http, self.timeouts, kind=self.kind,
                                    health_path=wire.health_path, replay=self._replay, stats=self._stats)
        self._lora_name = check_lora_name(type(self).__name__, lora_name)
        self._lora_dir, self._check_lora_base = lora_dir, check_lora_base
        self.adapters: RemoteAdapters | None = None
        if lora is not None:
            self._enable_adapters(lora)
        self._adapter_nursery: trio.Nursery | None = None
        self._ready = False  # wait_ready has run (it runs once)
        self._rng = random.Random(seed)
        self._wire_seq = itertools.count()

    # -- HTTP ---------------------------------------------------------------------
    @property
    def client(self) -> httpx.AsyncClient:
        """The shared ``httpx.AsyncClient`` (created on first use, closed by :meth:`aclose`)."""
        return self.http.client

    async def aclose(self) -> None:
        await self.http.aclose()

    async def call(self, url: str, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                   timeout_s: float | None = None, allow_empty: bool = True, decode: bool = True) -> Any:
        """One control call to one server (:meth:`ServerClient.call <._http.ServerClient.call>`):
        the decoded JSON answer.  Raises :class:`RemoteCallError`."""
        return await self.http.call(url, method, path, json=json, params=params, timeout_s=timeout_s,
                                    allow_empty=allow_empty, decode=decode)

    async def broadcast(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None,
                        servers: Sequence[str] | None = None) -> tuple[dict[str, Any], dict[str, RemoteCallError]]:
        """The same control call to several servers (default: the healthy ones), concurrently.

        Returns ``(answers, errors)``, both keyed by URL.
        """
        urls = [s.url for s in self.pool.healthy] if servers is None else list(servers)
        return await self.http.broadcast(urls, method, path, json=json, params=params)

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
            nursery.start_soon(self.health.run)
            self._adapter_nursery = nursery
            try:
                if self.adapters is not None:
                    await nursery.start(self.adapters.run)
                    if self.adapters.source is not None and self.adapters.versions.current() is None:
                        await self.adapters.load(self.adapters.source, self.version)
                yield self
            finally:
                self._adapter_nursery = None
                if self.adapters is not None:
                    await self.adapters.aclose()  # shielded, bounded
            nursery.cancel_scope.cancel()

    def _enable_adapters(self, source: Any = None) -> RemoteAdapters:
        self.adapters = RemoteAdapters(self.pool, self.http, self.wire, self.timeouts, kind=self.kind,
                                       name=self._lora_name, source=source, lora_dir=self._lora_dir,
                                       check_base=self._check_lora_base)
        self.lora = self.adapters.versions
        return self.adapters

    async def _replay(self, server: Server) -> bool:
        """What a stale server missed, before it is re-admitted: the last weight update,
        then the current LoRA adapter."""
        if not await self.control.replay(server):
            return False
        return self.adapters is None or await self.adapters.replay(server)

    async def wait_ready(self) -> None:
        """Wait until a server answers its health route, then run :meth:`after_startup`
        (:meth:`HealthMonitor.wait_ready <._health.HealthMonitor.wait_ready>`).

        :meth:`open` calls it; a caller may call it first (e.g. to ask the servers which
        model they serve, :meth:`served_models`); it then runs once only.

        Raises:
            RemoteCallError: every server refuses access (HTTP 401/403, on the health
                route or on the model route, which servers started with ``--api-key``
                guard): at once, with ``access_denied`` (``backend.pool.all_denied``).
            BackendError: no server answered within ``startup_timeout_s``.
        """
        if self._ready:
            return
        await self.health.wait_ready(self._after_health)
        self._ready = True

    async def _after_health(self) -> None:
        await self._check_access()
        await self.after_startup()

    async def after_startup(self) -> None:
        """Hook run once a server is healthy, before segments are served."""

    # -- access (servers started with --api-key) ------------------------------------
    async def _check_access(self) -> None:
        """Ask every healthy server for its model (the wire protocol's ``model_info_call``):
        servers started with ``--api-key`` guard that route but not the health route
        (vLLM guards only ``/v1/...``, SGLang everything but ``/health`` and ``/metrics``), so
        a missing or wrong key shows here, before any segment.  A 401/403 ejects the server
        for good (:meth:`ServerPool.deny <._routing.ServerPool.deny>`); other failures are
        left to the requests and probes.

        Raises:
            RemoteCallError: no healthy server is left because each refused access
                (``access_denied``).
        """
        method, path = self.wire.model_info_call()

        async def one(server: Server) -> None:
            try:
                await self.call(server.url, method, path, timeout_s=self.timeouts.health_timeout_s)
            except RemoteCallError as exc:
                if exc.access_denied:
                    self.pool.deny(server, str(exc))

        async with trio.open_nursery() as nursery:
            for server in self.pool.healthy:
                nursery.start_soon(one, server)
        if not self.pool.healthy:
            raise RemoteCallError(f"{self.kind} backend: every server refused access: "
                                  + "; ".join(f"{s.denied or s.last_error}" for s in self.pool.servers),
                                  access_denied=True)

    async def check_health(self, *, eject_now: bool = False) -> dict[str, bool]:
        """Probe every server once; returns ``{url: healthy}`` after the round."""
        return await self.health.check(eject_now=eject_now)

    async def served_models(self) -> dict[str, str | None]:
        """Ask every healthy server which model it serves: ``{url: name or path}``
        (``None`` where a server does not say).  SGLang: ``GET /get_model_info``
        (``tokenizer_path``, else ``model_path``); vLLM: ``GET /v1/models``
        (``data[0].root``, else ``data[0].id``)."""
        answers: dict[str, str | None] = {}

        async def one(server: Server) -> None:
            method, path = self.wire.model_info_call()
            try:
                answer = await self.call(server.url, method, path, timeout_s=self.timeouts.health_timeout_s)
                name = self.wire.parse_model_name(answer)
            except (RemoteCallError, TypeError, KeyError, IndexError, ValueError, AttributeError):
                name = None
            answers[server.url] = str(name) if name else None

        async with trio.open_nursery() as nursery:
            for server in self.pool.healthy:
                nursery.start_soon(one, server)
        return {s.url: answers[s.url] for s in self.pool.servers if s.url in answers}

    # -- generation ---------------------------------------------------------------
    async def _generate(self, request: ModelRequest, budget: int) -> ModelResponse:
        """Serve one segment with routing, retries, failover and a deadline.

        Raises:
            RemoteCallError: a non-retryable failure, or ``max_attempts`` transient ones
                (a :class:`RemoteTimeoutError` when the last one ran past ``attempt_timeout_s``).
            BackendTimeoutError: no answer within ``request_timeout_s``.
            BackendUnavailableError: no server was healthy for ``no_server_timeout_s``.
        """
        key = str(request.metadata.get("routing_key", request.rid))
        cost = len(request.input_ids) + budget
        start = trio.current_time()
        failed: list[str] = []
        failures: list[str] = []
        attempts = 0
        with trio.move_on_after(self.timeouts.request_timeout_s):
            while True:
                await self.control.wait_unpaused()
                server = await self._choose(key, failed)
                attempts += 1
                self._stats["attempts"] += 1
                epoch = self.control.epoch
                version = self.version  # read before the segment is sent (AReaL PR #1569)
                lease = None if self.adapters is None else self.adapters.versions.acquire(request.lora_name)
                self.pool.bind(key, server)
                sent = trio.current_time()
                try:
                    await self.prepare(server)
                    parsed = await self._attempt(server, request, budget, cost,
                                                 None if lease is None else lease.served_name)
                except RemoteCallError as exc:
                    failures.append(f"attempt {attempts} on {server.url}: {exc}")
                    if exc.access_denied:  # the server refuses us, whatever the request: out of rotation
                        self.pool.deny(server, str(exc))
                        if not self.pool.all_denied and attempts < self.retry.max_attempts:
                            self._stats["retries"] += 1
                            self._stats["failovers"] += 1
                            failed.append(server.url)
                            continue
                        self._stats["requests_failed"] += 1
                        raise RemoteCallError(f"request {request.rid}: {history(failures)}", url=server.url,
                                              access_denied=True) from exc
                    if exc.server_fault:
                        self.pool.record_failure(server, str(exc), eject_now=exc.server_down)
                    if not exc.retryable or attempts >= self.retry.max_attempts:
                        self._stats["requests_failed"] += 1
                        if isinstance(exc, BackendTimeoutError):  # the last word was a timeout: a typed one
                            raise RemoteTimeoutError(f"request {request.rid}: {history(failures)}",
                                                     url=server.url) from exc
                        raise RemoteCallError(f"request {request.rid}: {history(failures)}", url=server.url,
                                              retryable=exc.retryable, server_down=exc.server_down,
                                              server_fault=exc.server_fault) from exc
                    self._stats["retries"] += 1
                    failed.append(server.url)
                    if self.pool.has_fresh(failed):
                        self._stats["failovers"] += 1
                    else:
                        await trio.sleep(self.retry.backoff_s(len(failed), self._rng))
                    continue
                finally:
                    if lease is not None:  # the segment no longer needs its adapter version
                        self.adapters.versions.release(lease)  # type: ignore[union-attr]
                self.pool.record_success(server)
                self._note_weight_version(server, parsed.weight_version, version)
                if parsed.stop_reason == "abort" and not parsed.tokens:
                    # Aborted before any token: never hand an empty abort to the engine loop.
                    self._stats["empty_aborts"] += 1
                    if self.control.epoch != epoch or self.control.paused:
                        attempts -= 1  # our own pause: not a failure, wait for continue
                        continue
                    failures.append(f"attempt {attempts} on {server.url}: aborted before any token")
                    if attempts >= self.retry.max_attempts:
                        self._stats["requests_failed"] += 1
                        raise RemoteCallError(f"request {request.rid}: {history(failures)}", url=server.url)
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
        raise BackendTimeoutError(f"request {request.rid}: no answer within request_timeout_s="
                           f"{self.timeouts.request_timeout_s} s after {attempts} attempt(s)"
                           + (f" ({history(failures)})" if failures else ""))

    async def _choose(self, key: str, failed: Sequence[str]) -> Server:
        """The server of the next attempt; while none is healthy, wait for a re-admission
        until ``no_server_timeout_s`` after the last healthy server was lost.

        Raises:
            RemoteCallError: every server refuses access (at once).
            BackendUnavailableError: the window passed with no healthy server.
        """
        while True:
            server = self.pool.choose(key, failed)
            if server is not None:
                return server
            if self.pool.all_denied:  # nothing will ever be re-admitted: fail now, not at the deadline
                self._stats["requests_failed"] += 1
                raise RemoteCallError(f"{self.kind}: every server refused access: "
                                      + "; ".join(f"{s.denied}" for s in self.pool.servers), access_denied=True)
            window = self.timeouts.no_server_timeout_s
            since = self.pool.no_server_since
            if since is None:  # (every server is ejected, so the pool dated it; never trust that blindly)
                since = self.pool.no_server_since = trio.current_time()
            if trio.current_time() >= since + window:
                self._stats["requests_failed"] += 1
                self._stats["requests_unavailable"] += 1
                raise BackendUnavailableError(
                    f"no healthy {self.kind} server for {trio.current_time() - since:.1f} s "
                    f"(no_server_timeout_s={window} s): {self.pool.describe_down()}")
            self._stats["waits_for_server"] += 1
            with trio.move_on_at(since + window):
                await self.pool.wait_readmission()

    async def prepare(self, server: Server) -> None:
        """Hook run before an attempt (e.g. discover the served model name)."""

    async def _attempt(self, server: Server, request: ModelRequest, budget: int, cost: int,
                       adapter: str | None = None) -> ParsedGeneration:
        wire_id = f"{request.rid}@{next(self._wire_seq):08d}"
        payload = self.wire.build_payload(request, budget, wire_id)
        if adapter is not None:
            payload = self.wire.with_adapter(payload, adapter)
        path = self.wire.generate_path
        timeout = self.timeouts.attempt_timeout_s
        self.pool.begin(server, cost)
        self.control.begin(wire_id, server.url)
        eject_scope = trio.CancelScope()
        server.attempt_scopes.add(eject_scope)
        try:
            with eject_scope:
                with trio.move_on_after(math.inf if timeout is None else timeout):
                    try:
                        with map_exceptions(server.url):
                            response = await self.client.post(server.url + path, json=payload)
                    except trio.Cancelled:
                        if not eject_scope.cancel_called:  # cancelled, deadline, attempt timeout: server may be busy
                            await self._abort_shielded(server, wire_id)
                        raise
                    body = decode_json(response, server.url, path)
                    try:
                        return self.wire.parse_generation(body)
                    except RemoteCallError as exc:
                        exc.url = exc.url or server.url
                        raise
                    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
                        raise RemoteCallError(f"{server.url}{path}: unexpected answer ({describe(exc)}): "
                                              f"{excerpt(str(body))}", url=server.url) from exc
            if eject_scope.cancelled_caught:
                raise RemoteCallError(f"{server.url} was ejected while the request was in flight", url=server.url,
                                      retryable=True, server_fault=False)
            self._stats["attempt_timeouts"] += 1
            raise RemoteTimeoutError(f"{server.url}: no answer within attempt_timeout_s={timeout} s", url=server.url)
        finally:
            server.attempt_scopes.discard(eject_scope)
            self.pool.end(server, cost)
            self.control.end(wire_id)

    async def _abort_shielded(self, server: Server, wire_id: str) -> None:
        """Tell ``server`` to stop working on ``wire_id``; runs even while being cancelled."""
        method, path, body, params = self.wire.abort_call(wire_id)
        with trio.CancelScope(shield=True):
            self._stats["aborts_sent"] += 1
            try:
                await self.call(server.url, method, path, json=body, params=params,
                                timeout_s=self.timeouts.abort_timeout_s)
            except RemoteCallError as exc:
                # a router or a server without the route: the dropped connection aborts it anyway
                self._stats["aborts_failed"] += 1
                logger.debug("abort of %s on %s failed: %s", wire_id, server.url, exc)

    def _note_weight_version(self, server: Server, weight_version: str | None, version: int) -> None:
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

    # -- control and weight sync (engine.backends.base.WeightSync) ---------------------
    async def pause_generation(self, mode: str = "abort", *, servers: Sequence[str] | None = None) -> dict[str, Any]:
        """Stop sending segments (client side) and pause every healthy server.

        With ``mode="abort"`` the servers return in-flight requests at once (``abort`` with
        their partial tokens); those are re-sent after :meth:`continue_generation`.
        ``servers`` overrides the targets (e.g. the workers behind a router, which does not
        forward control calls: ``servers=await backend.router_workers()``).

        Returns ``{url: answer}``.

        Raises:
            InvalidRequestError: ``mode`` is not one of the wire protocol's ``pause_modes``.
            BackendError: a server failed (the client side stays paused).
        """
        return await self.control.pause_generation(mode, servers=servers)

    async def continue_generation(self, *, servers: Sequence[str] | None = None) -> dict[str, Any]:
        """Resume every healthy server (or ``servers``), then let segments flow again (even if
        a server failed)."""
        return await self.control.continue_generation(servers=servers)

    @property
    def paused(self) -> bool:
        """The client-side pause is on."""
        return self.control.paused

    async def pause(self, mode: str = "abort") -> None:
        """:meth:`pause_generation` with the engine's mode names (``"abort"``, and
        ``"in_place"`` as this server calls it: the wire protocol's ``sync_pause_modes``).

        A backend that serves a LoRA adapter pauses no server: every update it takes is an
        adapter update, which needs only its own requests back, so it closes its gate and
        aborts its own requests in flight by id (:meth:`PoolControl.pause_client
        <._control.PoolControl.pause_client>`); the servers go on serving their other
        clients (other tenants' adapters, other runs).  ``"in_place"`` then only closes
        the gate (and the update refuses the mode).

        Raises:
            InvalidRequestError: unknown mode.
            BackendError: a server failed to pause (the client side stays paused).
        """
        check_sync_mode(f"{self.kind} backend pause", mode)
        if self.adapters is not None:
            await self.control.pause_client(mode, abort_timeout_s=self.timeouts.abort_timeout_s,
                                            timeout_s=self.timeouts.control_timeout_s)
            return
        await self.pause_generation(self.wire.sync_pause_modes[mode])

    async def resume(self) -> None:
        """:meth:`continue_generation` on every healthy server, then the client (after a
        client-only :meth:`pause`: the client only)."""
        if self.control.client_only:
            self.control.open_client()
            return
        await self.continue_generation()

    def serves_adapter(self, source: Any) -> bool:
        """Whether an update from ``source`` is a LoRA adapter update: the backend serves
        an adapter, or ``source`` is one (:func:`~engine.backends.lora.is_adapter_source`)."""
        return self.adapters is not None or is_adapter_source(source)

    async def update_weights(self, source: Any, *, version: int, mode: str = "abort") -> None:
        """Load the checkpoint folder ``source`` on every server (the wire protocol's
        ``weight_update_calls``; see :mod:`engine.backends.remote._control` for servers that
        miss it); the servers are told ``version`` as their weight version.  Call it between
        :meth:`pause` and :meth:`resume` (``engine.update_weights`` does).  Only mode
        ``"abort"``: after an in-place swap a server does not report at which token the
        weights changed, so tokens could not carry the right version.

        A LoRA adapter (:meth:`serves_adapter`: a peft model, a peft state dict, an adapter
        folder) is loaded instead as ``{lora_name}-v{version}`` next to the one in use, from
        a fresh folder; the old version is unloaded once no segment of it is in flight
        (:mod:`._lora`).  Only the adapter travels.

        Raises:
            InvalidRequestError: unknown mode.
            BackendError: ``mode="in_place"``; ``source`` is not a folder path; or no
                server succeeded (the error names each server's failure); for an adapter,
                also full weights sent to a backend that serves one, and the checks of
                :meth:`RemoteAdapters.load <._lora.RemoteAdapters.load>` (LoRA off, rank,
                base model).
        """
        if self.serves_adapter(source):
            checkpoint_folder(self.kind, "adapter", mode)  # the mode rules of any update
            if not is_adapter_source(source):
                raise BackendError(f"{self.kind} backend serves the LoRA adapter {self.adapters.name!r}: "  # type: ignore[union-attr]
                                   "update_weights takes an adapter (a peft model, a peft state dict or an adapter "
                                   "folder), not full weights")
            adapters = self.adapters or self._enable_adapters()
            if self._adapter_nursery is not None and adapters._send is None:
                await self._adapter_nursery.start(adapters.run)
            await adapters.load(source, version)
            self._stats["weight_updates"] += 1
            return
        folder = checkpoint_folder(self.kind, source, mode)
        await self.apply_weight_update(self.wire.weight_update_calls(folder, version), what=folder)

    async def apply_weight_update(self, calls: list[WireCall], *, what: str,
                                  servers: Sequence[str] | None = None) -> dict[str, Any]:
        """Send ``calls`` in order to every healthy server (or ``servers``):
        :meth:`PoolControl.apply_weight_update <._control.PoolControl.apply_weight_update>`."""
        return await self.control.apply_weight_update(calls, what=what, servers=servers)

    async def router_workers(self, url: str | None = None) -> list[str]:
        """The worker URLs behind an sglang-router / SGLang Model Gateway (``GET /workers``)
        at ``url`` (default: the first server), for control calls the router does not forward."""
        url = normalize_url(url) if url else self.pool.servers[0].url
        answer = await self.call(url, "GET", "/workers")
        try:
            return [normalize_url(w["url"]) for w in answer["workers"]]
        except (TypeError, KeyError):
            raise BackendError(f"{url}/workers: not a router's worker list: {excerpt(str(answer))}") from None

    # -- statistics -----------------------------------------------------------------
    def statistics(self) -> RemoteStatistics:
        counters: dict[str, Any] = {name: self._stats[name] for name in COUNTERS}
        return RemoteStatistics(**self._base_stats(), **counters, paused=self.control.paused,
                                servers=tuple(self.pool.statistics()))
