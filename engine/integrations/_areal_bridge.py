"""trio -> asyncio -> trio for AReaL's workflows: an episode task runs an asyncio coroutine.

AReaL's workflows are asyncio code (``asyncio.gather``, AReaL's ``AsyncRewardWrapper``,
the OpenAI SDK, aiohttp).  The engine runs each episode as a trio task.  This module
joins the two without a thread per call:

* :class:`AsyncioLoop`: one asyncio event loop running in one daemon thread, owned by
  the adapter (started at ``initialize``, closed at ``destroy``).  Every bridged
  coroutine runs there.
* :func:`run_bridged`, awaited by an episode's trio task: starts ``coro_fn(*args)`` as
  an asyncio task on that loop and serves the task's calls back into trio
  (:func:`call_trio` / :meth:`Bridge.call`) as child tasks of the episode task, so they
  run with the episode's context (episode id, sample index, reward accounting) and
  under its cancel scope.  It returns what the coroutine returns and raises what it
  raises (same exception object).

Cancellation goes both ways:

* the episode task is cancelled (staleness cut, engine closing, episode timeout): the
  asyncio task is cancelled, its calls in flight in trio are cancelled, and the episode
  waits up to ``cancel_grace_s`` (shielded) for the asyncio task to end before it
  re-raises; a task that ignores the cancellation past that is logged, never waited on
  without a bound;
* the asyncio side cancels an ``await bridge.call(...)`` (``asyncio.wait_for``, a
  cancelled task): the trio call's cancel scope is cancelled.

Thread-safety: the asyncio side posts to trio with ``TrioToken.run_sync_soon``, trio
posts back with ``loop.call_soon_threadsafe``; nothing else crosses threads.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import trio

__all__ = ["AsyncioLoop", "Bridge", "call_trio", "current_bridge", "run_bridged"]

logger = logging.getLogger(f"rollout.{__name__}")

_CURRENT: contextvars.ContextVar[Bridge | None] = contextvars.ContextVar("areal_bridge", default=None)


class AsyncioLoop:
    """An asyncio event loop running forever in one daemon thread.

    Args:
        name: the thread's name.
        start_timeout_s: seconds :meth:`start` waits for the loop to run.

    Raises (from :meth:`start`): :class:`RuntimeError` when the loop does not start in time.
    """

    def __init__(self, name: str = "areal-asyncio", start_timeout_s: float = 30.0) -> None:
        self.name = name
        self._start_timeout_s = start_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running = threading.Event()

    def start(self) -> AsyncioLoop:
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: start() called twice")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        if not self._running.wait(self._start_timeout_s):
            raise RuntimeError(f"{self.name}: the asyncio loop did not start within {self._start_timeout_s} s")
        return self

    def _main(self) -> None:
        loop = self.loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        loop.call_soon(self._running.set)
        try:
            loop.run_forever()
        finally:
            asyncio.set_event_loop(None)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.loop is not None and self.loop.is_running()

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel the loop's tasks, give them ``timeout_s`` seconds to end, stop the loop and
        join its thread (bounded too).  Idempotent; a no-op before :meth:`start`."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return
        if thread.is_alive():
            done = threading.Event()

            async def _cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                if tasks:
                    await asyncio.wait(tasks, timeout=timeout_s)
                await loop.shutdown_asyncgens()
                done.set()

            asyncio.run_coroutine_threadsafe(_cancel_all(), loop)
            if not done.wait(timeout_s + 1.0):
                logger.warning("%s: tasks did not end within %.0f s of the cancellation", self.name, timeout_s)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning("%s: the loop thread did not stop within %.0f s", self.name, timeout_s)
                return
        loop.close()


class Bridge:
    """The asyncio side's handle on the trio episode task that runs it (see the module docstring)."""

    def __init__(self, token: trio.lowlevel.TrioToken, send: trio.MemorySendChannel[Any]) -> None:
        self._token = token
        self._send = send
        self._ids = itertools.count()

    def _post(self, message: tuple[Any, ...]) -> bool:
        """Hand ``message`` to the episode task (from the asyncio thread); False when it has gone."""
        def deliver() -> None:
            try:
                self._send.send_nowait(message)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the episode already returned; its calls were answered then

        try:
            self._token.run_sync_soon(deliver)
        except trio.RunFinishedError:
            return False
        return True

    async def call(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``await async_fn(*args)`` in the episode's trio task (as its child); from asyncio.

        Returns its result; raises its exception; cancelling this await cancels it in trio.

        Raises:
            RuntimeError: the episode (or the engine's trio loop) has ended.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        call_id = next(self._ids)
        if not self._post(("call", call_id, async_fn, args, loop, future)):
            raise RuntimeError("the rollout engine's trio loop is not running")
        try:
            return await future
        except asyncio.CancelledError:
            if not future.done() or future.cancelled():
                self._post(("cancel", call_id))
            raise


def current_bridge() -> Bridge | None:
    """The bridge of the episode whose asyncio task is running here, or None (outside one)."""
    return _CURRENT.get()


async def call_trio(async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """:meth:`Bridge.call` on the current episode's bridge (from asyncio).

    Raises:
        RuntimeError: not inside a bridged episode.
    """
    bridge = _CURRENT.get()
    if bridge is None:
        raise RuntimeError("call_trio: not inside an episode run by run_bridged")
    return await bridge.call(async_fn, *args)


def _answer(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], outcome: Any, error: bool) -> None:
    def settle() -> None:
        if future.done():
            return
        if error:
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody waits for the answer any more
        pass


def _cancel_future(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
    try:
        loop.call_soon_threadsafe(future.cancel)
    except RuntimeError:
        pass


async def _serve(message: tuple[Any, ...], scopes: dict[int, trio.CancelScope]) -> None:
    _, call_id, async_fn, args, loop, future = message
    with trio.CancelScope() as scope:
        scopes[call_id] = scope
        try:
            result = await async_fn(*args)
        except trio.Cancelled:
            _cancel_future(loop, future)
            raise
        except BaseException as exc:  # handed to the asyncio caller, as itself
            _answer(loop, future, exc, error=True)
        else:
            _answer(loop, future, result, error=False)
        finally:
            scopes.pop(call_id, None)
    if scope.cancelled_caught:  # the asyncio side gave up on this call
        _cancel_future(loop, future)


async def run_bridged(loop: AsyncioLoop, coro_fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any,
                      cancel_grace_s: float = 10.0) -> Any:
    """Run ``coro_fn(*args)`` as an asyncio task on ``loop`` and await it from this trio task,
    serving its :meth:`Bridge.call`\\ s here (see the module docstring).

    Args:
        cancel_grace_s: when this task is cancelled, how long (seconds) to wait for the
            cancelled asyncio task to end before re-raising.

    Raises:
        whatever ``coro_fn`` raises (the same object);
        RuntimeError: ``loop`` is not running;
        trio.Cancelled: this task was cancelled (after the asyncio task was cancelled).
    """
    aloop = loop.loop
    if aloop is None or not loop.running:
        raise RuntimeError(f"{loop.name}: the asyncio loop is not running (initialize() the engine first)")
    send, recv = trio.open_memory_channel[Any](math.inf)
    bridge = Bridge(trio.lowlevel.current_trio_token(), send)
    holder: dict[str, asyncio.Task[Any]] = {}

    def start() -> None:  # on the asyncio thread
        context = contextvars.copy_context()
        context.run(_CURRENT.set, bridge)
        try:
            task: asyncio.Task[Any] = aloop.create_task(coro_fn(*args), context=context)
        except BaseException as exc:  # coro_fn itself raised: report it as the task's outcome
            failed: asyncio.Future[Any] = aloop.create_future()
            failed.set_exception(exc)
            failed.add_done_callback(lambda f: bridge._post(("done", f)))
            return
        holder["task"] = task
        task.add_done_callback(lambda t: bridge._post(("done", t)))

    def cancel_task() -> None:  # on the asyncio thread, after start() (call_soon is FIFO)
        task = holder.get("task")
        if task is not None:
            task.cancel()

    scopes: dict[int, trio.CancelScope] = {}
    done: asyncio.Future[Any] | None = None
    aloop.call_soon_threadsafe(start)
    try:
        async with trio.open_nursery() as nursery:  # the served calls: children of this task
            async for message in recv:
                kind = message[0]
                if kind == "call":
                    nursery.start_soon(_serve, message, scopes)
                elif kind == "cancel":
                    scope = scopes.get(message[1])
                    if scope is not None:
                        scope.cancel()
                else:  # "done": a call the task left behind is not waited for
                    done = message[1]
                    nursery.cancel_scope.cancel()
                    break
    except BaseException:  # cancelled (the served calls are cancelled and ended by now)
        aloop.call_soon_threadsafe(cancel_task)
        ended = False
        with trio.CancelScope(shield=True), trio.move_on_after(cancel_grace_s):
            async for message in recv:  # serve nothing more: wait for the task to end
                if message[0] == "call":
                    _cancel_future(message[4], message[5])
                elif message[0] == "done":
                    _outcome(message[1], quiet=True)
                    ended = True
                    break
        if not ended:
            logger.warning("an episode's asyncio task did not end within %.0f s of its cancellation "
                           "(cancel_grace_s); left running on the asyncio loop", cancel_grace_s)
        raise
    finally:
        send.close()
        recv.close()
    assert done is not None  # the loop above ends only at "done"
    return _outcome(done)


def _outcome(future: asyncio.Future[Any], quiet: bool = False) -> Any:
    """The finished asyncio task's result (read from the trio thread: it is done, so its
    state no longer changes)."""
    if future.cancelled():
        if quiet:
            return None
        raise RuntimeError("the episode's asyncio task was cancelled from the asyncio side")
    exc = future.exception()  # (also marks it retrieved: asyncio logs no "never retrieved")
    if exc is not None:
        if quiet:
            return None
        raise exc
    return future.result()
