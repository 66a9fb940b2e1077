"""Engine shards: N engine processes behind one :class:`~engine.executor.RolloutEngine`-shaped
coordinator (issue 16).

::

    from engine.shards import open_sharded_engine

    async with open_sharded_engine(SimBackend(sim_config), EngineConfig(...), shards=2) as engine:
        batch = await engine.prepare_batch(dataloader, workflow)   # same API as open_rollout_engine
        engine.set_version(v + 1)

Each shard is a process (or, with ``shard_backend="ray"`` / a ``ray_address``, a Ray
actor) with its own trio loop, backend client and reward pool; the coordinator
(:mod:`engine.shards._coordinator`) owns the version, the global staleness budget,
the result buffer and the exactly-once accounting, and re-runs the episodes of a
shard that dies.  The wire is :mod:`engine.shards._protocol`.
"""

from __future__ import annotations

from ._coordinator import AdmissionRecord, ShardedRolloutEngine, ShardStatistics, ShardsDiedError
from ._open import SHARD_BACKENDS, open_sharded_engine
from ..context import shard_index

__all__ = ["AdmissionRecord", "SHARD_BACKENDS", "ShardStatistics", "ShardedRolloutEngine", "ShardsDiedError",
           "open_sharded_engine", "shard_index"]
