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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import outcome

from .sync import CallCancelled, RolloutEngineThread
from .types import ModelRequest, ModelResponse

__all__ = ["AsyncioEngine", "CallCancelled"]

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
