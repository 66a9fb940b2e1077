"""LoRA adapters on a pool of servers (vLLM ``/v1/load_lora_adapter``, SGLang
``/load_lora_adapter``): :class:`RemoteAdapters`.

Each version is written to a fresh folder under ``lora_dir`` (``{name}-v{version}-<random>``),
checked against every healthy server (LoRA on, rank within ``--max-lora-rank``, the same base
model), loaded on every healthy server under its versioned name, and made current (the engine
then sets the version, so every segment sent from then on names it).  A retired version is
unloaded from the servers that loaded it once no segment of it is in flight, by a background
task, and its folder removed only after every one of those servers unloaded it: a folder is
never touched while a server may still read it, and no name is ever reloaded in place (both
corrupt or crash vLLM: ``shared/docs/TOOLING_NOTES.md``, "LoRA on the vLLM CPU server").

A server that fails a load is ejected and marked stale, like one that misses a weight update;
before it is re-admitted it gets the current adapter (:meth:`RemoteAdapters.replay`).  A pool
server that is down when a version is retired keeps that version's folder (it may come back
with the adapter loaded).  On close, the adapters this client loaded are unloaded (bounded,
best effort) and their folders removed.  The servers and this client must share the folder
(``lora_dir`` on a filesystem both see), as for a weight update from disk.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import trio

from ...errors import BackendError
from ...types import versioned_lora_name
from ..lora import AdapterLease, AdapterVersions, AdapterWeights, check_adapter, read_adapter, write_adapter
from ._config import RemoteTimeouts
from ._errors import RemoteCallError, check_success
from ._http import ServerClient
from ._routing import Server, ServerPool
from ._wire import WireProtocol

__all__ = ["RemoteAdapters"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace


class RemoteAdapters:
    """The versions of one adapter name on one pool (see the module docstring).

    Args:
        pool, http, wire, timeouts: the backend's server pool, HTTP side, wire protocol
            and deadlines.
        kind: the backend's name, for messages.
        name: the adapter name.
        source: the adapter to load when the backend opens (folder, peft model, ...), or ``None``.
        lora_dir: where version folders are written (default: a new temporary folder,
            removed on close when empty).
        check_base: refuse an adapter trained on another base model than the servers'.

    Attributes:
        versions: the loaded versions and their leases (the backend's ``lora``).
        config: the current version's peft config (a later bare state dict reuses it).
    """

    def __init__(self, pool: ServerPool, http: ServerClient, wire: WireProtocol, timeouts: RemoteTimeouts, *,
                 kind: str, name: str, source: Any = None, lora_dir: str | None = None,
                 check_base: bool = True) -> None:
        self.pool, self.http, self.wire, self.timeouts, self.kind = pool, http, wire, timeouts, kind
        self.source = source
        self.check_base = check_base
        self.versions = AdapterVersions(self._retired, default=name)
        self.config: dict[str, Any] | None = None
        self._lora_dir = lora_dir
        self._own_dir: Path | None = None
        self._folders: dict[str, Path] = {}  # served name -> its folder
        self._loaded_on: dict[str, set[str]] = {}  # served name -> server URLs that loaded it
        self._send: trio.MemorySendChannel[AdapterLease] | None = None
        self._pending: list[AdapterLease] = []  # retired before the janitor ran
        self._queued = 0  # retired versions not yet unloaded
        self._idle: trio.Event | None = None

    @property
    def name(self) -> str:
        return self.versions.default

    def __getstate__(self) -> dict[str, Any]:  # an idle backend pickles (engine shards)
        state = dict(self.__dict__)
        state["_send"] = state["_idle"] = None
        return state

    # -- lifetime (RemoteBackend.open) ----------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The background task: unload retired versions, one at a time, as they come."""
        send, recv = trio.open_memory_channel[AdapterLease](math.inf)
        self._send = send
        for lease in self._pending:
            self._queued += 1
            send.send_nowait(lease)
        self._pending.clear()
        task_status.started()
        async with recv:
            async for lease in recv:
                try:
                    await self._unload(lease)
                finally:
                    self._queued -= 1
                    if not self._queued and self._idle is not None:
                        self._idle.set()

    async def drained(self) -> None:
        """Return once every retired version nothing holds is unloaded and its folder
        removed (versions still in flight are not waited for: they are not retired yet)."""
        while self._queued:
            if self._idle is None or self._idle.is_set():
                self._idle = trio.Event()
            await self._idle.wait()

    async def aclose(self) -> None:
        """Unload what this client loaded (bounded by ``control_timeout_s`` in all, shielded)
        and remove the folders of what was unloaded everywhere."""
        with trio.CancelScope(shield=True), trio.move_on_after(self.timeouts.control_timeout_s):
            leftovers = list(self._pending)
            self._pending.clear()
            for lease in leftovers + self.versions.retire_all():
                await self._unload(lease)
        if self._own_dir is not None:
            try:
                self._own_dir.rmdir()  # only when empty: a kept folder stays with its parent
            except OSError:
                pass

    def _retired(self, lease: AdapterLease) -> None:
        if self._send is not None:
            self._queued += 1
        if self._send is None:
            self._pending.append(lease)
        else:
            self._send.send_nowait(lease)

    # -- loading ------------------------------------------------------------------------------
    async def load(self, source: Any, version: int) -> AdapterLease:
        """Write ``source`` to a fresh folder, check it, load it on every healthy server as
        ``{name}-v{version}`` and make it current.

        Raises:
            BackendError: the version is loaded already; the adapter cannot be read; a
                server runs without LoRA, with a smaller ``--max-lora-rank``, or serves
                another base model (before anything is loaded); no server loaded it (each
                server's failure named, with the fix where known).
        """
        served = versioned_lora_name(self.name, version)
        if served in self.versions.loaded():
            raise BackendError(f"LoRA adapter {served!r} is loaded already: a new adapter needs a new version")
        weights = await trio.to_thread.run_sync(lambda: read_adapter(source, config=self.config))
        targets = [s.url for s in self.pool.healthy]
        await self._check(weights, targets)
        await self._check_name(targets)
        folder = await trio.to_thread.run_sync(self._write, weights, served)
        method, path, body = self.wire.lora_load_call(served, str(folder))
        try:
            answers, errors = await self._broadcast(targets, method, path, body)
        except BaseException:  # cancelled (or failed) part-way: no server keeps a name we do not know
            await self._roll_back(served, folder, targets)
            raise
        if not answers:
            await trio.to_thread.run_sync(shutil.rmtree, folder, True)
            raise BackendError(f"{self.kind}: loading LoRA adapter {served!r} failed on every server: "
                               + ("; ".join(f"{u}: {self._explain(e)}" for u, e in errors.items())
                                  or "no healthy server"))
        self._folders[served] = folder
        self._loaded_on[served] = set(answers)
        for server in self.pool.servers:  # missed it: ejected, gets it before re-admission
            if server.url not in answers:
                server.stale_weights = True
                if server.healthy:
                    self.pool.eject(server, f"failed to load LoRA adapter {served}: "
                                                    f"{self._explain(errors[server.url])}")
        self.config = dict(weights.config)
        return self.versions.add(self.name, version)

    async def _roll_back(self, served: str, folder: Path, targets: list[str]) -> None:
        """Undo a load that did not complete (its caller was cancelled, or it raised):
        unload ``served`` from every server it was sent to (an answer that it is not
        loaded there is fine) and remove its folder; shielded, within ``abort_timeout_s``
        (past it a server may keep the name: the next load names it, with the fix)."""
        method, path, body = self.wire.lora_unload_call(served)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.timeouts.abort_timeout_s) as bound:
                await self._broadcast(targets, method, path, body)
            if bound.cancelled_caught:
                logger.warning("%s: unloading the LoRA adapter %s of a cancelled update took more than %s s",
                               self.kind, served, self.timeouts.abort_timeout_s)
            await trio.to_thread.run_sync(shutil.rmtree, folder, True)

    async def replay(self, server: Server) -> bool:
        """Load the current version on ``server`` (it missed it) before its re-admission;
        ``False`` (``server.last_error`` says why) when that failed."""
        current = self.versions.current()
        if current is None or server.url in self._loaded_on.get(current.served_name, set()):
            return True
        method, path, body = self.wire.lora_load_call(current.served_name,
                                                               str(self._folders[current.served_name]))
        answers, errors = await self._broadcast([server.url], method, path, body)
        if not answers:
            server.last_error = f"loading the LoRA adapter it missed failed: {self._explain(errors[server.url])}"
            return False
        self._loaded_on[current.served_name].add(server.url)
        return True

    def _write(self, weights: AdapterWeights, served: str) -> Path:
        root = self._lora_dir
        if root is None:
            if self._own_dir is None:
                self._own_dir = Path(tempfile.mkdtemp(prefix="rollout-lora-"))
            root = str(self._own_dir)
        os.makedirs(root, exist_ok=True)
        return write_adapter(weights, tempfile.mkdtemp(prefix=f"{served}-", dir=root))  # fresh, never reused

    async def _check(self, weights: AdapterWeights, targets: list[str]) -> None:
        """Every server's LoRA limits (the wire protocol's ``lora_info_call``), before any load."""
        wire = self.wire
        method, path, params = wire.lora_info_call()
        for url in targets:
            try:
                answer = await self.http.call(url, method, path, params=params,
                                                 timeout_s=self.timeouts.health_timeout_s)
                limits = wire.parse_lora_limits(answer)
            except (RemoteCallError, TypeError, KeyError, AttributeError):
                continue  # not readable (e.g. no dev mode): the load itself will say
            where = f"the {self.kind} server {url}"
            if limits.enabled is False:
                raise BackendError(f"{where} runs without LoRA: {wire.lora_enable_fix(weights.rank)}")
            check_adapter(weights, where=where, base_model=limits.base_model, max_rank=limits.max_rank,
                          check_base=self.check_base)

    async def _check_name(self, targets: list[str]) -> None:
        """No other client serves a version of this adapter name (``{name}-v<N>`` loaded on
        a server, not by this backend): two tenants with one ``lora_name`` would each unload
        and reload the other's versions, or collide at the first version both reach."""
        method, path = self.wire.lora_list_call()
        versioned = re.compile(rf"{re.escape(self.name)}-v\d+")
        for url in targets:
            try:
                names = self.wire.parse_loaded_adapters(await self.http.call(
                    url, method, path, timeout_s=self.timeouts.health_timeout_s))
            except (RemoteCallError, TypeError, KeyError, AttributeError):
                continue  # not readable: the load's own "already loaded" error is the fallback
            foreign = sorted(n for n in names if versioned.fullmatch(n) and url not in self._loaded_on.get(n, ()))
            if foreign:
                raise BackendError(
                    f"{self.kind}: the LoRA adapter name {self.name!r} is in use on {url} by another client (it "
                    f"serves {foreign[0]!r}, which this backend did not load): give each tenant its own lora_name "
                    f"(lora_name='tenant-a', 'tenant-b', ...; --lora-name tenant-a on the CLI), or, if a run that ended left it loaded, unload it "
                    f"({' '.join(self.wire.lora_unload_call(foreign[0])[:2])} {{\"lora_name\": \"{foreign[0]}\"}})")

    async def _broadcast(self, urls: list[str], method: str, path: str,
                         body: Any) -> tuple[dict[str, Any], dict[str, RemoteCallError]]:
        answers: dict[str, Any] = {}
        errors: dict[str, RemoteCallError] = {}
        decode = self.wire.lora_answers_json

        async def one(url: str) -> None:
            try:
                answer = await self.http.call(url, method, path, json=body, decode=decode)
                check_success(url, path, answer)
                answers[url] = answer
            except RemoteCallError as exc:
                errors[url] = exc

        async with trio.open_nursery() as nursery:
            for url in urls:
                nursery.start_soon(one, url)
        return answers, errors

    def _explain(self, exc: RemoteCallError) -> str:
        return self.wire.explain_lora_error(str(exc), self.versions.default)

    # -- unloading ------------------------------------------------------------------------------
    async def _unload(self, lease: AdapterLease) -> None:
        """Unload a retired version from the servers that loaded it; remove its folder once
        every one of them did (a server down now keeps it: it may come back with it)."""
        served = lease.served_name
        urls = sorted(self._loaded_on.get(served, set()))
        healthy = {s.url for s in self.pool.healthy}
        method, path, body = self.wire.lora_unload_call(served)
        answers, errors = await self._broadcast([u for u in urls if u in healthy], method, path, body)
        for url, exc in list(errors.items()):
            if self.wire.lora_not_loaded(str(exc)):  # gone already (a restarted server)
                answers[url] = None
                del errors[url]
        remaining = set(urls) - set(answers)
        self._loaded_on[served] = remaining
        ok = not errors
        if errors:
            logger.warning("%s: unloading LoRA adapter %s failed: %s", self.kind, served,
                           "; ".join(f"{u}: {e}" for u, e in errors.items()))
        folder = self._folders.get(served)
        if not remaining:
            self._loaded_on.pop(served, None)
            self._folders.pop(served, None)
            if folder is not None:
                await trio.to_thread.run_sync(shutil.rmtree, folder, True)
        elif ok:
            logger.warning("%s: LoRA adapter %s stays loaded on %s (down now): its folder %s is kept",
                           self.kind, served, ", ".join(sorted(remaining)), folder)
        self.versions.unloaded(lease, ok=ok)

    def folder(self, served_name: str) -> Path | None:
        """The folder a loaded version was written to (``None`` once removed)."""
        return self._folders.get(served_name)
