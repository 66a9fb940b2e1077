"""Issue 13, class 7 (the engine boundary): errors raised while a backend starts, and
errors raised in the body of ``async with open_rollout_engine(...)``, reach the caller as
themselves, not wrapped in an ``ExceptionGroup``; several at once stay a group."""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio

from engine import MockBackend, open_rollout_engine


async def _never(request, budget):
    raise AssertionError("no request is sent")


class _FailsToStart(MockBackend):
    def __init__(self, exc):
        super().__init__(_never)
        self.exc = exc

    @asynccontextmanager
    async def open(self):
        await trio.lowlevel.checkpoint()
        raise self.exc
        yield self  # pragma: no cover


def _Idle():
    return MockBackend(_never)


async def test_a_backend_start_up_error_reaches_the_caller_as_itself(reward_pool):
    error = OSError("no file named model.safetensors in /models/empty")
    with pytest.raises(OSError) as info:
        async with open_rollout_engine(_FailsToStart(error), reward_pool=reward_pool):
            pytest.fail("the engine must not open")
    assert info.value is error


async def test_an_error_in_the_body_reaches_the_caller_as_itself(reward_pool):
    with pytest.raises(KeyError, match="missing"):
        async with open_rollout_engine(_Idle(), reward_pool=reward_pool):
            raise KeyError("missing")


async def test_several_errors_stay_a_group(reward_pool):
    async def fail(exc):
        raise exc

    with pytest.RaisesGroup(ValueError, KeyError):
        async with open_rollout_engine(_Idle(), reward_pool=reward_pool):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail, ValueError("a"))
                nursery.start_soon(fail, KeyError("b"))
