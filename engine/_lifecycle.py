"""What an engine runs in: the reward pool (local worker processes or Ray actors, unless
one is shared), the dump writer, the backend and the nursery of the episodes, opened and
closed in the order :func:`engine.open_rollout_engine` documents (episodes end before
the backend closes; dumps are flushed last).  The engine itself is built, started and
closed by :func:`~engine.open_rollout_engine` inside this scope."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import trio

from ._config import EngineConfig
from .backends.base import InferenceBackend
from .dump import TrajectoryDumper
from .workflow import EngineRewards

__all__ = ["open_services"]


@asynccontextmanager
async def open_services(backend: InferenceBackend, config: EngineConfig, reward_pool: EngineRewards | None,
                        dumper: TrajectoryDumper | None) -> AsyncIterator[tuple[trio.Nursery, EngineRewards]]:
    """Yield ``(nursery, pool)``: the nursery the episodes run in (cancelled on the way
    out, before the backend closes) and the reward pool (``reward_pool``, or one opened
    with ``config``'s ``reward_*`` settings and closed on the way out)."""
    from rewards import open_reward_pool

    async with _maybe_pool(reward_pool, config, open_reward_pool) as pool:
        async with trio.open_nursery() as services:
            if dumper is not None:
                await services.start(dumper.run)
            try:
                async with backend.open(), trio.open_nursery() as nursery:  # episodes end before the backend
                    try:
                        yield nursery, pool
                    finally:
                        nursery.cancel_scope.cancel()
            finally:
                if dumper is not None:
                    dumper.close()  # the writer drains what is queued, then returns
                with trio.CancelScope(shield=True):
                    await backend.aclose()


@asynccontextmanager
async def _maybe_pool(pool: EngineRewards | None, config: EngineConfig,
                      opener: Callable[..., AbstractAsyncContextManager[Any]]) -> AsyncIterator[EngineRewards]:
    if pool is not None:
        yield pool
        return
    backend_options: dict[str, Any] = {}
    if config.reward_backend == "ray":  # Ray actors instead of local worker processes
        from rewards import open_ray_reward_pool

        opener, backend_options = open_ray_reward_pool, {"address": config.reward_ray_address}
    async with opener(config.reward_options, **backend_options) as opened:
        yield opened
