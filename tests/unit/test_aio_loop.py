"""Unit tier: trio -> asyncio (engine.aio.AsyncioLoop, run_asyncio) and the engine's shared
resources (RolloutEngine.shared_resource).  A real worker thread runs the asyncio loop, so
these tests use the real clock (no autojump: virtual time would jump past the thread) and
every wait is bounded by trio.fail_after."""

from __future__ import annotations

import asyncio
import contextvars
import signal
import threading
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from engine import MockBackend, ModelResponse, RolloutWorkflow, open_rollout_engine
from engine.aio import AsyncioLoop, open_asyncio_loop, run_asyncio
from engine.testing import InProcessRewardPool

BOUND_S = 30.0


async def where(tag):
    await asyncio.sleep(0)
    return tag, threading.get_ident(), id(asyncio.get_running_loop())


async def test_many_calls_share_one_loop_in_one_thread_and_errors_keep_their_type():
    with trio.fail_after(BOUND_S):
        async with open_asyncio_loop() as loop:
            out = []

            async def call(i):
                out.append(await loop.run(where, i))

            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(call, i)
            assert sorted(tag for tag, *_ in out) == list(range(64))
            assert len({(t, lp) for _, t, lp in out}) == 1 and out[0][1] != threading.get_ident()

            async def boom(x):
                raise KeyError(x)

            with pytest.raises(KeyError, match="7"):
                await loop.run(boom, 7)
            with pytest.raises(TypeError):  # not an awaitable: raised in the caller, the loop lives on
                await loop.run(lambda: 3)
            assert (await loop.run(where, "after"))[0] == "after" and loop.running == 0
        thread = loop._thread
    assert not thread.is_alive() and loop._loop.is_closed()
    with pytest.raises(trio.ClosedResourceError):
        await loop.run(where, 1)


async def test_cancelling_the_trio_caller_cancels_the_asyncio_task():
    started, seen = threading.Event(), []

    async def agent():
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    with trio.fail_after(BOUND_S):
        async with open_asyncio_loop() as loop:
            with trio.move_on_after(0.1) as scope:
                await loop.run(agent)
            assert scope.cancelled_caught and seen == ["cancelled"] and started.is_set()


async def test_a_cancel_that_comes_during_a_step_lets_the_tasks_that_step_created_start_first():
    """Regression (new-user trial: "RuntimeWarning: coroutine 'run_single_turn' was never
    awaited" on an episode timeout): the Agents SDK creates a task over a wrapper of a coroutine
    and awaits it (``create_task(preserve_tool_task_cancellation(run_single_turn(...)))``); a
    cancel that came from trio while that step ran cancelled the new task before its first step,
    so the wrapped coroutine was never awaited (the step was the SDK's first import, ~1.5 s)."""
    entered, release = threading.Event(), threading.Event()
    started, cancelled = [], []

    async def turn():
        started.append("turn")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append("turn")
            raise

    async def wrapper(awaitable):
        return await awaitable

    async def sdk_like():
        entered.set()
        release.wait(BOUND_S)  # a long step (an import, the SDK's set-up) while the cancel arrives
        await asyncio.create_task(wrapper(turn()))

    scope = trio.CancelScope()

    async def call(loop):
        with scope:
            await loop.run(sdk_like)

    with trio.fail_after(BOUND_S):
        async with open_asyncio_loop() as loop:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, loop)
                await trio.to_thread.run_sync(entered.wait, BOUND_S)
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked()  # the cancel is queued in the asyncio loop
                release.set()
    assert scope.cancelled_caught and started == ["turn"] and cancelled == ["turn"]


async def test_a_task_that_ignores_cancellation_is_waited_for_a_bounded_time_only():
    release = threading.Event()

    async def stubborn():
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue  # swallows every cancellation

    with trio.fail_after(BOUND_S):
        async with open_asyncio_loop(cancel_grace_s=0.2, close_timeout_s=0.5) as loop:
            t0 = trio.current_time()
            with trio.move_on_after(0.05):
                await loop.run(stubborn)
            assert 0.2 <= trio.current_time() - t0 < 5  # the grace, not forever
            release.set()


async def test_closing_the_loop_ends_calls_in_flight_and_changes_nothing_process_wide():
    policy, handler = asyncio.get_event_loop_policy(), signal.getsignal(signal.SIGINT)
    errors = []

    async def forever():
        await asyncio.sleep(3600)

    with trio.fail_after(BOUND_S):
        loop = AsyncioLoop(close_timeout_s=1.0)

        async def call():
            try:
                await loop.run(forever)
            except trio.ClosedResourceError as exc:
                errors.append(str(exc))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()  # the call waits on its asyncio task
            assert loop.running == 1
            await loop.aclose()
    assert errors and "closed during the call" in errors[0]
    assert asyncio.get_event_loop_policy() is policy and signal.getsignal(signal.SIGINT) is handler
    assert asyncio._get_running_loop() is None


class AsyncioEpisode(RolloutWorkflow):
    """An episode that runs an asyncio function and keeps where it ran."""

    def __init__(self):
        self.seen = []

    async def arun_episode(self, engine, data):
        self.seen.append(await run_asyncio(engine, where, data["i"]))
        return None


def _backend():
    return MockBackend(lambda req, budget: ModelResponse(input_tokens=list(req.input_ids), output_tokens=[1],
                                                         output_logprobs=[-0.1], output_versions=[0]))


async def test_run_asyncio_uses_one_loop_per_engine_closed_with_the_engine():
    workflow = AsyncioEpisode()
    threads = []
    with trio.fail_after(BOUND_S):
        for _ in range(2):
            async with open_rollout_engine(_backend(), reward_pool=InProcessRewardPool()) as engine:
                for i in range(8):
                    engine.submit({"i": i}, workflow)
                results = await engine.wait_results(8)
                loop = await engine.shared_resource("engine.aio.asyncio_loop", open_asyncio_loop)
                threads.append(loop._thread)
            assert not loop._thread.is_alive() and loop._loop.is_closed()
            with pytest.raises(trio.ClosedResourceError):
                await engine.shared_resource("anything", open_asyncio_loop)
    assert [r.reason for r in results] == ["workflow_returned_none"] * 8
    first, second = workflow.seen[:8], workflow.seen[8:]
    assert len({(t, lp) for _, t, lp in first}) == 1 and len({(t, lp) for _, t, lp in second}) == 1
    assert first[0][1:] != second[0][1:] and threads[0] is not threads[1]


async def test_shared_resources_open_once_close_newest_first_after_the_episodes():
    log = []

    def opener(name, fail=False):
        @asynccontextmanager
        async def cm():
            log.append(f"open {name}")
            await trio.sleep(0.01)  # concurrent first calls wait for this one opening
            if fail:
                raise OSError(f"{name} failed")
            yield name
            log.append(f"close {name}")
        return cm

    attempts = []

    def flaky():
        attempts.append(1)
        return opener("flaky", fail=len(attempts) == 1)()

    with trio.fail_after(BOUND_S):
        async with open_rollout_engine(_backend(), reward_pool=InProcessRewardPool()) as engine:
            got = []

            async def get(key, op):
                got.append(await engine.shared_resource(key, op))

            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(get, "a", opener("a"))
            await get("b", opener("b"))
            with pytest.raises(OSError, match="flaky failed"):
                await engine.shared_resource("c", flaky)
            assert await engine.shared_resource("c", flaky) == "flaky"  # a failed opening is tried again
            log.append("engine closing")
    assert got == ["a"] * 5 + ["b"]
    assert log == ["open a", "open b", "open flaky", "open flaky", "engine closing",
                   "close flaky", "close b", "close a"]


async def test_a_shared_resource_runs_in_the_engines_context_not_the_first_askers():
    """Regression: the first episode's context (its drift-event sink) leaked into the shared proxy."""
    var = contextvars.ContextVar("var", default="engine")

    @asynccontextmanager
    async def cm():
        yield var.get()

    with trio.fail_after(BOUND_S):
        async with open_rollout_engine(_backend(), reward_pool=InProcessRewardPool()) as engine:
            var.set("episode")
            assert await engine.shared_resource("ctx", cm) == "engine"


async def test_a_resource_still_opening_when_the_engine_closes_is_closed_too(autojump_clock):
    """Regression (found with an episode timeout of 0.05 s on the agents path): the episode that
    asked for the shared proxy timed out while the proxy was still starting, the engine closed
    then, and the proxy, opened after the close had run, was never closed: the close hung."""
    log = []

    @asynccontextmanager
    async def slow():
        log.append("open")
        await trio.sleep(5)  # a server starting (the proxy: imports, binding)
        yield "slow"
        log.append("close")

    class Asks(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            await engine.shared_resource("slow", slow)

    from engine import EngineConfig

    with trio.fail_after(BOUND_S):
        async with open_rollout_engine(_backend(), EngineConfig(episode_timeout_s=1.0),
                                       reward_pool=InProcessRewardPool()) as engine:
            result = await engine.wait_for_task(engine.submit({}, Asks()))
        assert (result.status, result.reason) == ("failed", "episode_timeout")
    assert log == ["open", "close"]
    with pytest.raises(trio.ClosedResourceError):  # and after the close, nothing opens
        await engine.shared_resource("late", slow)
