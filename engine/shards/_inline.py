"""Shards inside this process's trio loop (``shard_backend="inline"``): the same
coordinator, shard code and wire format (every frame is packed and unpacked), without
the processes.  For tests (virtual time, deterministic schedules) and debugging; no
parallelism.  ``kill()`` cancels the shard, as a SIGKILL ends a process."""

from __future__ import annotations

import math
from typing import Any

import trio

from ._protocol import pack_frame, unpack_frame

__all__ = ["InlineShardLink", "start_inline_shard"]


class _MemoryChannel:
    def __init__(self, send: Any, receive: Any) -> None:
        self._send = send
        self._receive = receive

    async def send(self, messages: list[Any]) -> None:
        await self._send.send(pack_frame(messages))

    async def receive(self) -> list[Any] | None:
        try:
            frame = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None
        return unpack_frame(bytearray(frame))

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()


class InlineShardLink:
    kind = "inline"
    pid = None

    def __init__(self, channel: _MemoryChannel, scope: trio.CancelScope, done: trio.Event) -> None:
        self.channel = channel
        self._scope = scope
        self._done = done
        self.killed = False

    async def exit_reason(self, wait_s: float = 5.0) -> str:
        with trio.move_on_after(wait_s):
            await self._done.wait()
        return "was killed" if self.killed else "ended"

    def kill(self) -> None:
        self.killed = True
        self._scope.cancel()

    async def aclose(self, grace_s: float = 10.0) -> None:
        with trio.move_on_after(grace_s):
            await self._done.wait()
        self.kill()
        await self._done.wait()
        await self.channel.aclose()


async def start_inline_shard(index: int, nursery: trio.Nursery) -> InlineShardLink:
    from ._shard_main import run_shard

    to_shard_send, to_shard_receive = trio.open_memory_channel[bytes](math.inf)
    from_shard_send, from_shard_receive = trio.open_memory_channel[bytes](math.inf)
    scope = trio.CancelScope()
    done = trio.Event()

    async def serve() -> None:
        try:
            with scope:
                async with from_shard_send:
                    await run_shard(_MemoryChannel(from_shard_send, to_shard_receive))
        finally:
            done.set()

    nursery.start_soon(serve, name=f"inline-engine-shard-{index}")
    return InlineShardLink(_MemoryChannel(to_shard_send, from_shard_receive), scope, done)
