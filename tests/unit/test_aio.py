"""Unit tier: the asyncio bridge (engine.aio) over the blocking facade's trio thread.

Each asyncio test is a plain function that runs ``asyncio.run`` (pytest-trio owns the
async tests of this suite); every wait in it is bounded by ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio

import pytest
import trio
import trio.lowlevel

from engine import EngineConfig, MockBackend
from engine.aio import AsyncioEngine, CallCancelled
from engine.sync import RolloutEngineThread
from engine.testing import InProcessRewardPool
from engine.types import ModelRequest, ModelResponse

BOUND_S = 60.0  # every asyncio wait below; a hang fails the test instead of the suite


class Gate:
    """A backend handler that holds every request until ``n`` of them are in flight."""

    def __init__(self, n: int) -> None:
        self.n, self.running, self.peak = n, 0, 0
        self.open = trio.Event()

    async def __call__(self, req: ModelRequest, budget: int) -> ModelResponse:
        self.running += 1
        self.peak = max(self.peak, self.running)
        if self.running >= self.n:
            self.open.set()
        try:
            await self.open.wait()
        finally:
            self.running -= 1
        toks = [len(req.input_ids)]
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=toks, output_logprobs=[-0.5],
                             output_versions=[0], stop_reason="stop")


def _thread(handler) -> RolloutEngineThread:
    return RolloutEngineThread(MockBackend(handler), EngineConfig(), reward_pool=InProcessRewardPool())


def test_calls_in_flight_are_not_capped_by_a_thread_pool():
    # 200 generations that can only finish once all 200 are in flight at the same time:
    # a bridge with a thread per call (asyncio.to_thread: 32 workers here at most) hangs.
    gate = Gate(200)
    with _thread(gate) as thread:
        aio = AsyncioEngine(thread)

        async def main():
            reqs = [ModelRequest(input_ids=[1] * (i % 7 + 1)) for i in range(200)]
            return await asyncio.wait_for(asyncio.gather(*(aio.agenerate(r) for r in reqs)), BOUND_S)

        replies = asyncio.run(main())
    assert gate.peak == 200
    assert [r.output_tokens for r in replies] == [[i % 7 + 1] for i in range(200)]


def test_values_and_errors_come_back_with_their_type():
    with _thread(Gate(1)) as thread:
        aio = AsyncioEngine(thread)

        async def answer(x):
            await trio.lowlevel.checkpoint()
            return x * 2

        async def broken():
            await trio.lowlevel.checkpoint()
            raise KeyError("no such field")

        async def main():
            assert await asyncio.wait_for(aio.run(answer, 21), BOUND_S) == 42
            with pytest.raises(KeyError, match="no such field"):
                await asyncio.wait_for(aio.run(broken), BOUND_S)
            # the engine's own API: a version set from asyncio is the engine's
            await asyncio.wait_for(aio.run(_set_version, aio, 3), BOUND_S)

        asyncio.run(main())
        assert thread.version == 3


async def _set_version(aio: AsyncioEngine, version: int) -> None:
    aio.engine.set_version(version)
    await trio.lowlevel.checkpoint()


def test_cancelling_the_asyncio_caller_cancels_the_trio_task():
    seen: list[str] = []

    with _thread(Gate(1)) as thread:
        aio = AsyncioEngine(thread)

        async def main():
            loop, started = asyncio.get_running_loop(), asyncio.Event()

            async def forever():
                loop.call_soon_threadsafe(started.set)
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    seen.append("cancelled in trio")
                    raise

            task = asyncio.ensure_future(aio.run(forever))
            await asyncio.wait_for(started.wait(), BOUND_S)  # the trio task is running
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, BOUND_S)

        asyncio.run(main())
    assert seen == ["cancelled in trio"]


def test_closing_the_engine_fails_the_calls_still_running():
    thread = _thread(Gate(1)).start()
    aio = AsyncioEngine(thread)

    async def main():
        loop, started = asyncio.get_running_loop(), asyncio.Event()

        async def forever():
            loop.call_soon_threadsafe(started.set)
            await trio.sleep_forever()

        task = asyncio.ensure_future(aio.run(forever))
        await asyncio.wait_for(started.wait(), BOUND_S)  # the trio task is running
        await asyncio.get_running_loop().run_in_executor(None, thread.close)
        with pytest.raises(RuntimeError, match="closed while the call ran"):
            await asyncio.wait_for(task, BOUND_S)
        with pytest.raises(Exception, match="closed"):
            await aio.run(forever)

    asyncio.run(asyncio.wait_for(main(), BOUND_S))


def test_cancel_grace_is_validated():
    with pytest.raises(ValueError, match="cancel_grace_s"):
        AsyncioEngine(None, cancel_grace_s=float("nan"))  # type: ignore[arg-type]
    assert issubclass(CallCancelled, Exception)
