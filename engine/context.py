"""What running code can read about where it runs: trio-task-local context variables, set by
the engine before ``arun_episode`` is called (:data:`episode_id`, :data:`sample_index`) and
by an engine shard (:func:`shard_index`).

Its own module, at the bottom of the house: backends, workflows and the shards read it
without importing the executor or :mod:`engine.shards`.  A shard process runs ``python -m
engine.shards._shard_main``, so that module is ``__main__`` there: the variable lives here,
imported by both, never in ``_shard_main`` (it would be loaded a second time, with a
second context variable)."""

from __future__ import annotations

import contextvars

__all__ = ["SHARD_INDEX", "episode_id", "sample_index", "shard_index"]

#: Inside ``arun_episode``: this member's sample index within its group (0 for
#: ``group_size=1``).  Workflows may read it, e.g. to vary a per-sample seed.
sample_index: contextvars.ContextVar[int] = contextvars.ContextVar("sample_index", default=0)
#: Inside an episode: its task id (remote backends route every request of an
#: episode to the same server, to reuse its prefix cache).
episode_id: contextvars.ContextVar[int | None] = contextvars.ContextVar("episode_id", default=None)

SHARD_INDEX: contextvars.ContextVar[int | None] = contextvars.ContextVar("rollout_shard_index", default=None)


def shard_index() -> int | None:
    """The index (0..N-1) of the engine shard this code runs in: in a backend
    factory that the shard calls, in its workflows and filters; None outside a
    shard (e.g. in the coordinator's process).  For factories that give each shard
    its own resource (:class:`~engine.backends.hf.HFBackendFactory`'s ``devices``:
    one GPU per shard)."""
    return SHARD_INDEX.get()
