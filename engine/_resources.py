"""Resources shared by an engine's episodes: opened on first use, closed with the engine.

A workflow that needs something long-lived and shared (the asyncio loop of
:func:`engine.aio.run_asyncio`, the HTTP endpoint of
:func:`engine.openai.open_agent_session`) asks the engine for it by key::

    loop = await engine.shared_resource("engine.aio.loop", open_asyncio_loop)

The first call opens ``opener()`` (an async context manager) in a task of the
engine's own, and every later call with that key gets the same value; the value
is closed (its context manager exits) when the engine closes, after its episodes
have ended and its backend has closed, in the reverse order of opening.  Opening
is serialized per key: concurrent first calls wait for one opening, and a
failed opening raises in the caller whose call opened it (the next call tries
again).  A resource still opening when the engine closes (its asker was
cancelled meanwhile: an episode timeout) is closed as soon as it is open, and
the close waits for it.  A resource runs in the context of whoever opened the engine, not of the
episode that asked for it first.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import outcome
import trio

__all__ = ["EngineResources", "open_engine_resources"]


class EngineResources:
    """Created by :func:`open_engine_resources`.

    Every resource is opened by a task of the resources' own nursery started by
    their own spawner task, so it runs in the context of whoever opened the engine,
    never in the context of the episode that asked first (an episode's context
    variables, e.g. its drift-event sink, must not leak into a shared server).
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._values: dict[Hashable, Any] = {}
        self._locks: dict[Hashable, trio.Lock] = {}
        self._held: list[tuple[trio.Event, trio.Event]] = []  # (stop, closed) per resource, in opening order
        self._requests, self._inbox = trio.open_memory_channel[Any](math.inf)
        self._closed = False

    async def get(self, key: Hashable, opener: Callable[[], AbstractAsyncContextManager[Any]]) -> Any:
        """The value of ``key``, opened with ``opener()`` on first use.

        Raises:
            trio.ClosedResourceError: the engine is closing.
            Whatever ``opener()`` raises while it opens.
        """
        if key in self._values:
            return self._values[key]
        async with self._locks.setdefault(key, trio.Lock()):
            if key not in self._values:
                if self._closed:
                    raise trio.ClosedResourceError("the engine is closed; its shared resources are gone")
                reply: list[outcome.Outcome[Any]] = []
                done = trio.Event()
                self._requests.send_nowait((key, opener, reply, done))
                await done.wait()
                reply[0].unwrap()
        return self._values[key]

    async def _spawner(self) -> None:
        async for request in self._inbox:
            self._nursery.start_soon(self._open, *request)

    async def _open(self, key: Hashable, opener: Callable[[], AbstractAsyncContextManager[Any]],
                    reply: list[outcome.Outcome[Any]], done: trio.Event) -> None:
        stop, closed = trio.Event(), trio.Event()
        try:
            if self._closed:  # asked before the close, spawned after it: not opened
                raise trio.ClosedResourceError("the engine is closed; its shared resources are gone")
            self._values[key] = await self._nursery.start(self._hold, opener, stop, closed)
            self._held.append((stop, closed))
            if self._closed:  # the close ran while this opened (its asker was cancelled): close it now
                stop.set()
            reply.append(outcome.Value(None))
        except Exception as exc:  # noqa: BLE001 - handed to the caller that asked
            reply.append(outcome.Error(exc))
        finally:
            done.set()

    @staticmethod
    async def _hold(opener: Callable[[], AbstractAsyncContextManager[Any]], stop: trio.Event, closed: trio.Event,
                    task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with opener() as value:
                task_status.started(value)
                await stop.wait()
        finally:
            closed.set()

    async def _close(self) -> None:
        self._closed = True
        self._requests.close()
        while self._held:
            stop, closed = self._held.pop()
            stop.set()
            await closed.wait()


@asynccontextmanager
async def open_engine_resources() -> AsyncIterator[EngineResources]:
    """A scope for an engine's shared resources: those opened in it close when it
    exits, newest first (an error while one closes propagates from here)."""
    async with trio.open_nursery() as nursery:
        resources = EngineResources(nursery)
        nursery.start_soon(resources._spawner, name="engine-resources")
        try:
            yield resources
        finally:
            await resources._close()
