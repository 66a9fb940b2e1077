"""Episodes timed while they run (:class:`EpisodeTracker`): when each started, its
generated tokens and requests so far, seen through a wrapped workflow.
:class:`engine.cli._monitor.RunMonitor` has one; each engine shard has one when the live
view asks for stragglers (:mod:`engine.shards`).  Times are seconds on trio's clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

from .workflow import EpisodeEngine

__all__ = ["EpisodeTiming", "EpisodeTracker"]


@dataclass(frozen=True)
class EpisodeTiming:
    """One episode as the monitor saw it.

    Attributes:
        task_id: the engine's id.
        seconds: running time so far (in flight) or in all (ended).
        tokens: generated tokens so far (requests that returned) or in all.
        requests: generation requests that returned / in flight now.
    """

    task_id: int
    seconds: float
    tokens: int
    requests: int = 0
    requests_in_flight: int = 0


@dataclass
class _Live:
    start: float
    members: int = 0
    tokens: int = 0
    requests: int = 0
    in_flight: int = 0


class _EngineView:
    """The engine as a tracked episode sees it: ``agenerate`` counts tokens."""

    def __init__(self, engine: EpisodeEngine, live: _Live) -> None:
        self._engine = engine
        self._live = live

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def agenerate(self, req: Any) -> Any:
        live = self._live
        live.in_flight += 1
        try:
            resp = await self._engine.agenerate(req)
        finally:
            live.in_flight -= 1
        live.requests += 1
        live.tokens += len(resp.output_tokens)
        return resp


class _TrackedWorkflow:
    """``arun_episode`` of the wrapped workflow, seen by a tracker."""

    def __init__(self, inner: Any, tracker: EpisodeTracker) -> None:
        self._inner = inner
        self._tracker = tracker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def arun_episode(self, engine: EpisodeEngine, data: Any) -> Any:
        from .context import episode_id

        task_id = episode_id.get()
        if task_id is None:  # not inside an engine episode: nothing to attribute
            return await self._inner.arun_episode(engine, data)
        live = self._tracker._episode_started(task_id)
        try:
            return await self._inner.arun_episode(_EngineView(engine, live), data)
        finally:
            self._tracker._member_ended(task_id)


class EpisodeTracker:
    """The episodes running now, seen through wrapped workflows (:meth:`track`): when
    each started, its generated tokens and requests so far.  :class:`RunMonitor`
    has one; each engine shard has one when the live view asks for stragglers
    (``open_sharded_engine(track_episodes=True)``) and sends its longest-running
    episodes with its statistics.

    Args:
        on_ended: called with the :class:`EpisodeTiming` of each episode whose
            last member ended (optional).
    """

    def __init__(self, on_ended: Any = None) -> None:
        self._live: dict[int, _Live] = {}
        self._on_ended = on_ended

    def track(self, workflow: Any) -> Any:
        """``workflow`` (a spec :func:`workflows.resolve_workflow` accepts) wrapped so
        that its episodes are timed and their tokens counted."""
        from engine.workflow import resolve_workflow

        return _TrackedWorkflow(resolve_workflow(workflow), self)

    def _episode_started(self, task_id: int) -> _Live:
        live = self._live.get(task_id)
        if live is None:
            live = self._live[task_id] = _Live(start=trio.current_time())
        live.members += 1
        return live

    def _member_ended(self, task_id: int) -> None:
        live = self._live[task_id]
        live.members -= 1
        if live.members == 0:
            del self._live[task_id]
            if self._on_ended is not None:
                self._on_ended(EpisodeTiming(task_id, trio.current_time() - live.start, live.tokens, live.requests))

    def longest_running(self, top: int) -> tuple[EpisodeTiming, ...]:
        """The ``top`` episodes running longest, longest first (``seconds`` so far)."""
        now = trio.current_time()
        oldest = sorted(self._live.items(), key=lambda kv: kv[1].start)[:top]
        return tuple(EpisodeTiming(tid, now - v.start, v.tokens, v.requests, v.in_flight) for tid, v in oldest)
