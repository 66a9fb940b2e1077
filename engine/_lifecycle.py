"""Opening and closing an engine: the reward pool (local worker processes or Ray
actors, unless one is shared), the dump writer, the backend and the engine's
nursery, in the order :func:`engine.open_rollout_engine` documents (episodes end
before the backend closes; dumps are flushed last)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from ._config import EngineConfig
from .backends.base import InferenceBackend
from .dump import TrajectoryDumper

__all__ = ["open_engine"]


@asynccontextmanager
async def open_engine(engine_cls: Callable[..., Any], backend: InferenceBackend, config: EngineConfig, reward_pool: Any,
                       dumper: TrajectoryDumper | None) -> AsyncIterator[Any]:
    from rewards import open_reward_pool

    async with _maybe_pool(reward_pool, config, open_reward_pool) as pool:
        async with trio.open_nursery() as services:
            if dumper is not None:
                await services.start(dumper.run)
            try:
                async with backend.open(), trio.open_nursery() as nursery:  # episodes end before the backend
                    engine = engine_cls(nursery, backend, pool, config, dumper)
                    nursery.start_soon(engine._admit_forever, name="admission")
                    try:
                        yield engine
                    finally:
                        engine._close()
                        nursery.cancel_scope.cancel()
            finally:
                if dumper is not None:
                    dumper.close()  # the writer drains what is queued, then returns
                with trio.CancelScope(shield=True):
                    await backend.aclose()


@asynccontextmanager
async def _maybe_pool(pool: Any, config: EngineConfig, opener: Any) -> AsyncIterator[Any]:
    if pool is not None:
        yield pool
        return
    backend_options: dict[str, Any] = {}
    if config.reward_backend == "ray":  # Ray actors instead of local worker processes
        from rewards import open_ray_reward_pool

        opener, backend_options = open_ray_reward_pool, {"address": config.reward_ray_address}
    async with opener(config.reward_options, **backend_options) as opened:
        yield opened
