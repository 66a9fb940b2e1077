"""Shards as Ray actors (``shard_backend="ray"``, or ``open_sharded_engine(ray_address=...)``).

Each shard is one Ray actor (:class:`_ShardActor`, ``max_restarts=0``, ``num_cpus``
Ray CPUs) whose process runs the shard's trio loop (:func:`run_shard`) on a thread;
frames (the same wire as the process shards, :func:`pack_frame`) go in through
``push`` and come out through ``pull`` (a long poll), both plain Ray method calls.

trio never blocks on Ray, as in :mod:`engine.ray_cluster`: every call's object ref is
awaited with ``trio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)``.
Frames to a shard are sent one at a time (each ``push`` is awaited before the next),
so a threaded actor keeps them in order.  A dead actor (``ray.kill``, its node lost,
a crash) raises ``RayActorError`` on the next ``pull``: the coordinator treats its
channel as ended and re-runs its episodes elsewhere.

Ray is the optional ``ray`` extra.  Without ``address`` a local Ray is started
(unless this process has initialised one; it is then used and left running), with
this process's ``sys.path`` as the workers' code search path; on a cluster the
shards' modules (``engine``, the workflow's, the reward's) must be importable on
every node (installed, or a Ray runtime env).
"""

from __future__ import annotations

import collections
import math
import os
import queue
import threading
from typing import Any

import trio

from ._protocol import pack_frame, unpack_frame

__all__ = ["RayShards"]

#: seconds one ``pull`` waits for a frame before returning empty
PULL_WAIT_S = 1.0


class _ThreadChannel:
    """The shard's side, inside the actor: queues shared with the actor's methods."""

    def __init__(self, inbound: queue.Queue[bytes | None], outbound: queue.Queue[bytes | None]) -> None:
        self._in = inbound
        self._out = outbound

    async def send(self, messages: list[Any]) -> None:
        self._out.put(pack_frame(messages))

    async def receive(self) -> list[Any] | None:
        frame = await trio.to_thread.run_sync(self._in.get, abandon_on_cancel=True)
        return None if frame is None else unpack_frame(bytearray(frame))

    async def aclose(self) -> None:
        return None


class _ShardActor:
    """The Ray actor body: one engine shard on a thread of the actor's process."""

    def __init__(self) -> None:
        self._in: queue.Queue[bytes | None] = queue.Queue()
        self._out: queue.Queue[bytes | None] = queue.Queue()
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="engine-shard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ._shard_main import run_shard

        try:
            trio.run(run_shard, _ThreadChannel(self._in, self._out))
        finally:
            self._out.put(None)

    def pid(self) -> int:
        return os.getpid()

    def push(self, frame: bytes) -> None:
        self._in.put(frame)

    def pull(self, wait_s: float) -> list[bytes] | None:
        """Frames the shard sent (waits up to ``wait_s`` for the first); None once it ended."""
        if self._ended:
            return None
        try:
            first = self._out.get(timeout=wait_s)
        except queue.Empty:
            return []
        frames: list[bytes] = []
        item: bytes | None = first
        while True:
            if item is None:
                self._ended = True
                return frames or None
            frames.append(item)
            try:
                item = self._out.get_nowait()
            except queue.Empty:
                return frames


class _RayChannel:
    def __init__(self, ray: Any, actor: Any) -> None:
        self._ray = ray
        self._actor = actor
        self._pending: collections.deque[bytes] = collections.deque()
        self.ended_because: str | None = None

    async def send(self, messages: list[Any]) -> None:
        from ..ray_cluster import await_ref

        try:
            await await_ref(self._ray, self._actor.push.remote(pack_frame(messages)))
        except self._ray.exceptions.RayActorError as exc:
            raise trio.BrokenResourceError(f"the shard's Ray actor died: {_first_line(exc)}") from None

    async def receive(self) -> list[Any] | None:
        from ..ray_cluster import await_ref

        while not self._pending:
            try:
                frames = await await_ref(self._ray, self._actor.pull.remote(PULL_WAIT_S))
            except self._ray.exceptions.RayActorError as exc:
                self.ended_because = f"its Ray actor died ({_first_line(exc)})"
                return None
            if frames is None:
                self.ended_because = "its trio loop ended"
                return None
            self._pending.extend(frames)
        return unpack_frame(bytearray(self._pending.popleft()))

    async def aclose(self) -> None:
        return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


class RayShardLink:
    kind = "ray"

    def __init__(self, ray: Any, actor: Any, pid: int) -> None:
        self._ray = ray
        self.actor = actor
        self.pid: int | None = pid
        self.channel = _RayChannel(ray, actor)

    async def exit_reason(self, wait_s: float = 5.0) -> str:
        return self.channel.ended_because or "its Ray actor ended"

    def kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # already dead
            pass

    async def aclose(self, grace_s: float = 10.0) -> None:
        """Wait up to ``grace_s`` for the shard's loop to end (after ``close``), then kill the actor."""
        with trio.move_on_after(grace_s):
            while self.channel.ended_because is None:
                if await self.channel.receive() is None:
                    break
        await trio.to_thread.run_sync(self.kill)


class RayShards:
    """The Ray side of a sharded engine: connects (or starts) Ray, makes the actors."""

    def __init__(self, ray: Any, actor_class: Any, num_cpus: float, started: bool, start_timeout_s: float) -> None:
        self._ray = ray
        self._actor_class = actor_class
        self._num_cpus = num_cpus
        self._started = started
        self._start_timeout_s = start_timeout_s

    @classmethod
    async def connect(cls, address: str | None, shards: int, num_cpus: float,
                      start_timeout_s: float = 600.0) -> RayShards:
        """Initialise Ray unless this process has (a local one sized for the shards).

        Raises:
            RuntimeError: Ray is not installed.
        """
        from ..ray_cluster import import_ray as _import_ray, init_ray as _init_ray

        if isinstance(num_cpus, bool) or not isinstance(num_cpus, (int, float)) or not num_cpus >= 0:
            raise ValueError(f"ray_num_cpus must be a number >= 0, got {num_cpus!r}")
        ray = _import_ray()
        local_cpus = max(1, math.ceil(shards * num_cpus))
        started = await trio.to_thread.run_sync(_init_ray, ray, address, local_cpus)
        return cls(ray, ray.remote(_ShardActor), float(num_cpus), started, start_timeout_s)

    async def start(self, index: int) -> RayShardLink:
        from ..ray_cluster import await_ref

        actor = self._actor_class.options(num_cpus=self._num_cpus, max_concurrency=4, max_restarts=0,
                                          name=None).remote()
        link = RayShardLink(self._ray, actor, 0)
        try:
            with trio.fail_after(self._start_timeout_s):
                link.pid = await await_ref(self._ray, actor.pid.remote())
        except trio.TooSlowError:
            from ._coordinator import ShardStartError

            link.kill()
            raise ShardStartError(f"the Ray actor of engine shard {index} did not start within "
                               f"{self._start_timeout_s} s (does the cluster have {self._num_cpus} CPUs free?)") from None
        except BaseException:
            link.kill()
            raise
        return link

    async def aclose(self) -> None:
        if self._started:
            await trio.to_thread.run_sync(self._ray.shutdown)
