"""The engine for asyncio code: trainers whose rollout seam is a coroutine.

AReaL's ``InferenceEngine.agenerate``, verl's ``LLMServerClient.generate`` and the agent
executors of OpenRLHF are awaited from an asyncio event loop; our engine lives in a trio
loop (:class:`~engine.sync.RolloutEngineThread` runs it in a background thread).
:class:`AsyncioEngine` bridges the two without a thread per call: each
:meth:`~AsyncioEngine.run` starts the coroutine as its own task in the engine's loop and
parks the asyncio caller on a future that the trio side settles with
``loop.call_soon_threadsafe``.  So the number of calls in flight is bounded by the
engine's own admission (``EngineConfig.max_concurrent_rollouts``), never by a thread pool
(``asyncio.to_thread`` / ``run_in_executor`` would cap it at the executor's workers,
32 by default).

::

    with RolloutEngineThread(HFBackend("builtin:tiny")) as thread:
        aio = AsyncioEngine(thread)

        async def main():
            replies = await asyncio.gather(*(aio.agenerate(req) for req in requests))

        asyncio.run(main())

Cancellation goes both ways: cancelling the awaiting asyncio task cancels the trio task
(a generation in flight is aborted on the server as any cancelled episode's is) and waits
up to ``cancel_grace_s`` for it to end; closing the engine fails the calls still running
with :class:`RuntimeError`.  Errors raised in the engine reach the caller with their own
type and traceback.

The other direction, trio -> asyncio (:class:`AsyncioLoop`, :func:`run_asyncio`): agent
frameworks (the OpenAI Agents SDK, LangGraph, ...) are asyncio code; a trio workflow runs
them in *one* asyncio event loop in one worker thread, shared by all its episodes (no
thread and no loop per agent), with ``await run_asyncio(engine, agent_fn, *args)``::

    class MyAgent(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            async with open_agent_session(engine, self.tokenizer) as session:   # engine.openai
                answer = await run_asyncio(engine, my_asyncio_agent, session.base_url, session.api_key, data)
            ...

The engine's loop is opened on the first call and closed when the engine closes
(:meth:`engine.RolloutEngine.shared_resource`); :func:`open_asyncio_loop` opens one of
your own.  Cancelling the trio caller cancels the asyncio task and waits for it (at most
``cancel_grace_s``); the cancel lands one loop pass after it reaches the loop, so tasks the
call had just created take their first step before it (cancelled before that, a task drops
the coroutine it wraps unawaited).  Errors raised in the asyncio task reach the trio caller
with their own type.  Nothing process-wide is changed: the loop is the worker thread's own
(``asyncio.set_event_loop`` there only), no signal handler, no policy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import outcome
import trio

from .sync import CallCancelled, RolloutEngineThread
from .types import ModelRequest, ModelResponse

__all__ = ["AsyncioEngine", "AsyncioLoop", "CallCancelled", "LOOP_KEY", "open_asyncio_loop", "run_asyncio"]

logger = logging.getLogger(f"rollout.{__name__}")  # the package's one logging namespace

T = TypeVar("T")


class AsyncioEngine:
    """Awaitable access to a running :class:`~engine.sync.RolloutEngineThread` from asyncio.

    Args:
        thread: the started engine thread (its ``with`` block or ``start()``).
        cancel_grace_s: seconds a cancelled asyncio caller waits for the engine's task to
            end before its :class:`asyncio.CancelledError` propagates (the task is cancelled
            either way; this bounds the wait, it does not orphan the task).

    Raises:
        ValueError: ``cancel_grace_s`` negative or NaN.
    """

    def __init__(self, thread: RolloutEngineThread, *, cancel_grace_s: float = 30.0) -> None:
        if not cancel_grace_s >= 0:
            raise ValueError(f"cancel_grace_s must be >= 0 seconds, got {cancel_grace_s!r}")
        self._thread = thread
        self._cancel_grace_s = cancel_grace_s

    @property
    def engine(self) -> Any:
        """The trio :class:`engine.RolloutEngine`; use it only inside functions given to :meth:`run`."""
        self._thread._check()
        return self._thread._engine

    async def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await async_fn(*args)`` in the engine's trio loop and return its value.

        Call it from a coroutine running in an asyncio event loop (any thread).  ``async_fn``
        runs as its own trio task (so it may use ``self.engine`` and trio primitives).

        Raises:
            whatever ``async_fn`` raises, with its type; :class:`RuntimeError` when the engine
            is not running or closes during the call; :class:`asyncio.CancelledError` when
            the caller is cancelled (after the trio task was cancelled).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: outcome.Outcome[T]) -> None:  # in the asyncio loop's thread
            if future.done():
                return
            if isinstance(result, outcome.Error):
                future.set_exception(result.error)
            else:
                future.set_result(result.unwrap())

        def done(result: outcome.Outcome[T]) -> None:  # in the engine's thread
            try:
                loop.call_soon_threadsafe(settle, result)
            except RuntimeError:
                pass  # the asyncio loop is closed: nobody is waiting any more

        cancel = self._thread._spawn(async_fn, args, done)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel()
            try:
                await asyncio.wait_for(asyncio.shield(future), self._cancel_grace_s)
            except BaseException:  # noqa: BLE001 - CallCancelled, a late error or the grace ran out
                pass
            raise

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """One generation through the engine (:meth:`engine.RolloutEngine.agenerate`).

        Returns:
            the :class:`~engine.types.ModelResponse` (``output_tokens``, ``output_logprobs``
            per token, ``output_versions``, ``stop_reason``).

        Raises:
            as :meth:`run`, and what the engine's ``agenerate`` raises for the request.
        """
        engine = self.engine
        return await self.run(engine.agenerate, req)


class AsyncioLoop:
    """An asyncio event loop in one worker thread, driven from trio (see the module docstring).

    Args:
        cancel_grace_s: seconds a cancelled :meth:`run` waits for its asyncio task to
            finish cancelling before the trio ``Cancelled`` propagates (the task was
            cancelled either way).
        close_timeout_s: seconds :meth:`aclose` waits for the tasks still running to
            finish cancelling, for async generators and the default executor to shut
            down, and for the thread to end (then it is left behind, a daemon, with a
            warning logged).

    Raises:
        ValueError: a timeout negative or NaN.
    """

    def __init__(self, *, cancel_grace_s: float = 10.0, close_timeout_s: float = 10.0) -> None:
        for name, value in (("cancel_grace_s", cancel_grace_s), ("close_timeout_s", close_timeout_s)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
        self.cancel_grace_s, self.close_timeout_s = cancel_grace_s, close_timeout_s
        self._loop = asyncio.new_event_loop()  # run (and made current) only in the worker thread
        self._thread = threading.Thread(target=self._main, name="trio-rollout-asyncio", daemon=True)
        self._closing = False
        self._running = 0
        self._thread.start()

    def _main(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)  # this thread's current loop; no other thread's, no policy change
        try:
            loop.run_forever()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            deadline = self.close_timeout_s
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=deadline))
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_asyncgens(), deadline))
            loop.run_until_complete(asyncio.wait_for(loop.shutdown_default_executor(), deadline))
        except Exception:  # noqa: BLE001 - a shutdown step that timed out or failed: close anyway
            logger.warning("the asyncio loop did not shut down cleanly", exc_info=True)
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    @property
    def running(self) -> int:
        """Calls of :meth:`run` in flight."""
        return self._running

    async def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await async_fn(*args)`` as a task of the asyncio loop; its value.

        Raises:
            whatever the asyncio task raises, with its type;
            trio.ClosedResourceError: the loop is closed, or closed during the call.
        """
        if self._closing:
            raise trio.ClosedResourceError("the asyncio loop is closed")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[outcome.Outcome[T]] = []
        task: list[asyncio.Future[T]] = []

        def settle(value: outcome.Outcome[T]) -> None:  # in the asyncio thread
            if not result:
                result.append(value)
                try:
                    token.run_sync_soon(done.set)
                except trio.RunFinishedError:
                    pass  # nobody waits any more

        def finished(fut: asyncio.Future[T]) -> None:
            if fut.cancelled():
                settle(outcome.Error(trio.ClosedResourceError("the asyncio task was cancelled "
                                                              "(the asyncio loop closed during the call)")))
            elif fut.exception() is not None:
                settle(outcome.Error(fut.exception()))  # type: ignore[arg-type]
            else:
                settle(outcome.Value(fut.result()))

        def start() -> None:  # in the asyncio thread
            try:
                fut = asyncio.ensure_future(async_fn(*args))
            except Exception as exc:  # noqa: BLE001 - not a coroutine, or it raised at once
                settle(outcome.Error(exc))
                return
            task.append(fut)
            fut.add_done_callback(finished)

        def cancel() -> None:  # in the asyncio thread
            # one loop pass later: the first steps of the tasks that the task's last step created
            # are queued already and run first.  A task cancelled before its first step never
            # awaits the coroutine it was given as an argument: the Agents SDK's
            # create_task(preserve_tool_task_cancellation(run_single_turn(...))) warned
            # "coroutine 'run_single_turn' was never awaited" when a cancel from trio came while
            # the step that created it ran.
            if task:
                self._loop.call_soon(task[0].cancel)

        try:
            self._loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop closed in between
            raise trio.ClosedResourceError("the asyncio loop is closed") from None
        self._running += 1
        try:
            await done.wait()
        except trio.Cancelled:
            try:
                self._loop.call_soon_threadsafe(cancel)
            except RuntimeError:
                pass  # the loop is closed: its tasks are gone
            with trio.move_on_after(self.cancel_grace_s, shield=True):
                await done.wait()
            raise
        finally:
            self._running -= 1
        return result[0].unwrap()

    async def aclose(self) -> None:
        """Stop the loop: cancel its tasks (their :meth:`run` callers get
        ``trio.ClosedResourceError``), shut it down and join the thread, all within
        ``close_timeout_s`` (x3 at most: tasks, async generators, executor).  Idempotent."""
        if not self._closing:
            self._closing = True
            try:
                self._loop.call_soon_threadsafe(self._loop.stop)
            except RuntimeError:
                pass  # already closed
        limit = 3 * self.close_timeout_s + 1.0
        with trio.move_on_after(limit, shield=True):
            await trio.to_thread.run_sync(self._thread.join, limit, abandon_on_cancel=True)
        if self._thread.is_alive():
            logger.warning("the asyncio loop's thread did not end within %.0f s; left behind (a daemon)", limit)


@asynccontextmanager
async def open_asyncio_loop(*, cancel_grace_s: float = 10.0, close_timeout_s: float = 10.0
                            ) -> AsyncIterator[AsyncioLoop]:
    """An :class:`AsyncioLoop` for the block; closed (:meth:`AsyncioLoop.aclose`) on the way out.

    Raises:
        ValueError: as :class:`AsyncioLoop`.
    """
    loop = AsyncioLoop(cancel_grace_s=cancel_grace_s, close_timeout_s=close_timeout_s)
    try:
        yield loop
    finally:
        await loop.aclose()


#: The key of the engine's shared loop (:meth:`engine.RolloutEngine.shared_resource`).
LOOP_KEY = "engine.aio.asyncio_loop"


async def run_asyncio(engine: Any, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await async_fn(*args)`` in ``engine``'s asyncio loop (one worker thread for all
    of the engine's calls, opened on first use, closed when the engine closes); from trio.

    Args:
        engine: the engine given to ``arun_episode`` (anything with
            :meth:`~engine.RolloutEngine.shared_resource`), or an :class:`AsyncioLoop`.
        async_fn: an async function of asyncio code (an agent framework's run).

    Raises:
        whatever ``async_fn`` raises, with its type; ``trio.ClosedResourceError`` when
        the engine or the loop closes; ``TypeError`` when ``engine`` has no shared resources.
    """
    if isinstance(engine, AsyncioLoop):
        return await engine.run(async_fn, *args)
    shared = getattr(engine, "shared_resource", None)
    if shared is None:
        raise TypeError(f"run_asyncio: {type(engine).__name__} has no shared_resource(); pass the engine that "
                        "arun_episode got, or an AsyncioLoop (open_asyncio_loop())")
    loop = await shared(LOOP_KEY, open_asyncio_loop)
    return await loop.run(async_fn, *args)
