"""The trio -> asyncio -> trio bridge of the AReaL adapter (engine.integrations._areal_bridge).

No AReaL needed: an episode's trio task runs an asyncio coroutine on the adapter's loop
thread and serves its calls back into trio as its own children."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest
import trio

from engine.integrations._areal_bridge import AsyncioLoop, call_trio, current_bridge, run_bridged

EPISODE = contextvars.ContextVar("episode", default=None)


@pytest.fixture
def aloop():
    loop = AsyncioLoop(name="test-asyncio").start()
    yield loop
    loop.close()


async def test_calls_run_in_the_episode_task_context_and_results_come_back(aloop):
    seen = []

    async def trio_side(x):
        await trio.lowlevel.checkpoint()
        seen.append((EPISODE.get(), trio.lowlevel.current_task().parent_nursery is not None))
        return x * 2

    async def workflow(n):
        assert current_bridge() is not None
        return await asyncio.gather(*[call_trio(trio_side, i) for i in range(n)])

    EPISODE.set("episode-7")
    with trio.fail_after(10):
        out = await run_bridged(aloop, workflow, 5)
    assert out == [0, 2, 4, 6, 8]
    assert seen == [("episode-7", True)] * 5  # children of the episode task: its context


async def test_no_thread_per_call(aloop):
    async def trio_side(i):
        await trio.lowlevel.checkpoint()
        return i

    async def workflow():
        return await asyncio.gather(*[call_trio(trio_side, i) for i in range(300)])

    before = threading.active_count()
    with trio.fail_after(20):
        out = await run_bridged(aloop, workflow)
    assert out == list(range(300))
    assert threading.active_count() == before


async def test_errors_keep_their_type_both_ways(aloop):
    class Boom(Exception):
        pass

    async def trio_side():
        raise Boom("from trio")

    caught = []

    async def workflow():
        try:
            await call_trio(trio_side)
        except Boom as exc:
            caught.append(exc)
        raise KeyError("from asyncio")

    with trio.fail_after(10), pytest.raises(KeyError, match="from asyncio"):
        await run_bridged(aloop, workflow)
    assert len(caught) == 1 and str(caught[0]) == "from trio"


async def test_cancelling_the_episode_cancels_the_asyncio_task_and_its_trio_calls(aloop):
    trio_cancelled = trio.Event()
    asyncio_cancelled = threading.Event()
    call_started = trio.Event()

    async def trio_side():
        call_started.set()
        try:
            await trio.sleep_forever()
        finally:
            trio_cancelled.set()

    async def workflow():
        try:
            await call_trio(trio_side)
        except asyncio.CancelledError:
            asyncio_cancelled.set()
            raise

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            async def episode():
                with trio.CancelScope() as scope:
                    cancel_scopes.append(scope)
                    await run_bridged(aloop, workflow)

            cancel_scopes: list[trio.CancelScope] = []
            nursery.start_soon(episode)
            await call_started.wait()
            cancel_scopes[0].cancel()
    assert trio_cancelled.is_set()
    assert asyncio_cancelled.is_set()  # the asyncio task ended before run_bridged returned


async def test_an_asyncio_timeout_cancels_the_trio_call(aloop):
    trio_cancelled = trio.Event()

    async def trio_side():
        try:
            await trio.sleep_forever()
        finally:
            trio_cancelled.set()

    async def workflow():
        try:
            await asyncio.wait_for(call_trio(trio_side), timeout=0.05)
        except TimeoutError:
            return "timed out"

    with trio.fail_after(10):
        assert await run_bridged(aloop, workflow) == "timed out"
    assert trio_cancelled.is_set()


async def test_outside_an_episode_there_is_no_bridge(aloop):
    async def probe():
        return current_bridge()

    fut = asyncio.run_coroutine_threadsafe(probe(), aloop.loop)
    assert await trio.to_thread.run_sync(fut.result, 10) is None


async def test_a_stopped_loop_is_refused():
    loop = AsyncioLoop(name="never-started")

    async def workflow():
        return 1

    with pytest.raises(RuntimeError, match="not running"):
        await run_bridged(loop, workflow)
